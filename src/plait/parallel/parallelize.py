"""Apply parallelism to a model written for one device, in one fixed order.

``parallelize(model, mesh, ...)`` replaces and wraps modules from outside (the model
file never changes) in this fixed order (docs/api.md describes it too):

1. **tensor / sequence parallelism** over the tp axis (when it has several ranks): a
   TP plan as data (default: the built-in transformer's), applied in place by
   :func:`~plait.parallel.tensor.plan.apply_tensor_parallel`;
2. **context parallelism** over cp (when it has several ranks): every attention core
   becomes ring or all-to-all (Ulysses) attention on the cp group and the token
   positions become the rank's global positions
   (:func:`~plait.parallel.context.context_parallel.apply_context_parallel`); the step
   feeds each cp rank its shard of every sequence;
3. **pipeline split** over pp (when it has several ranks): this rank's pieces
   (:func:`~plait.parallel.pipeline.engine.split_for_pipeline`);
4. **activation recomputation** (:func:`~plait.parallel.recompute.apply_recompute`);
5. **ZeRO sharding or data parallelism** over dp (over dp x cp when cp > 1: the cp
   ranks hold the same parameters, so gradients and shards span both):
   ``zero`` 1, 2 or 3 -> :class:`~plait.parallel.zero.ZeroDataParallel`; ``zero = 0``
   with fp32 parameters and reduction -> :class:`~plait.parallel.data.DataParallel`
   (bucketed, overlapped all-reduce); ``zero = 0`` with bf16/fp16 parameters (or another
   reduction dtype) -> ``ZeroDataParallel`` at stage 0 (replicated, but flattened so the
   optimizer holds fp32 masters). Gradient compression (``parallel.compression``) plugs
   into ``DataParallel``'s buckets and needs the plain path.

The model may return logits, a Hugging Face output with ``.logits`` or a tuple whose
first element is the logits (:func:`~plait.model.factory.logits_of` picks them for the
loss). The result, a :class:`ParallelModel`, holds all a training step needs: the wrapped
module, the loss that fits the layout (vocabulary-parallel when tp > 1, so the full
logits are never gathered), and the pipeline driver when pp > 1. Its :meth:`step` is the
same call with or without a pipeline, so a user's own loop and plait's trainer are the
same few lines::

    pm = plait.parallelize(model, mesh, zero=3)
    opt = plait.optim.Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    loss = pm.step(tokens, targets)          # forward + backward (+ pipeline schedule)
    opt.step(); opt.zero_grad()

One rank is the degenerate case of the same path: every wrapper is applied, its
collectives are counted no-ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.config import Config, ParallelConfig, PrecisionConfig, Recompute
from plait.config_checks import check_compression
from plait.mesh import Mesh
from plait.model.factory import logits_of
from plait.parallel.compression import Compressor, make_compressor
from plait.parallel.context.context_parallel import ContextLayout, apply_context_parallel
from plait.parallel.data import DataParallel
from plait.parallel.pipeline.engine import PipelineEngine, at_least_fp32, split_for_pipeline
from plait.parallel.pipeline.split import PipelineStages, check_splittable
from plait.parallel.precision import PrecisionPolicy
from plait.parallel.recompute import apply_recompute
from plait.parallel.tensor.layers import shard_info, tensor_parallel_piece
from plait.parallel.tensor.loss import IGNORE_INDEX, vocab_parallel_loss
from plait.parallel.tensor.plan import Plan, apply_tensor_parallel, vocab_size_of
from plait.parallel.zero import ZeroDataParallel
from plait.pieces import LocalPiece

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(ignore_index: int = IGNORE_INDEX) -> LossFn:
    """Mean cross-entropy of logits ``(..., vocab)`` against targets ``(...)``, in at
    least float32, skipping ``ignore_index`` — the default loss at tp = 1."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=ignore_index
        )

    return loss


class ParallelModel(nn.Module):
    """A model prepared for a mesh: the wrapped module, its loss and its step driver.

    Built by :func:`parallelize`; see the module docstring. Attributes:

    * ``module`` — the outermost wrapper (:class:`DataParallel` or
      :class:`ZeroDataParallel`) around the (tensor-parallel) model or, when pp > 1,
      around this rank's :class:`PipelineStages`;
    * ``loss_fn`` — ``(logits, targets) -> mean loss`` that fits the layout;
    * ``pipeline`` — the :class:`PipelineEngine` when pp > 1, else None;
    * ``mesh`` — the mesh it was built for.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        loss_fn: LossFn,
        pipeline: PipelineEngine | None,
        names: dict[int, str],
        param_names: list[str],
        context: ContextLayout | None = None,
    ) -> None:
        super().__init__()
        self.context = context
        """The cp sequence layout (None when cp = 1): :meth:`step` shards by it."""
        self.module = module
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.pipeline = pipeline
        self._names = names
        self.param_names = param_names
        """Every parameter's one-device name, in the one-device model's order."""

    # ------------------------------------------------------------------ layout

    @property
    def zero(self) -> ZeroDataParallel | None:
        """The ZeRO wrapper (None under plain data parallelism)."""
        return self.module if isinstance(self.module, ZeroDataParallel) else None

    @property
    def compressor(self) -> Compressor | None:
        """The gradient compressor of plain data parallelism (None: plain all-reduce).
        Its per-rank state (error feedback, PowerSGD's Q) is saved with checkpoints."""
        return self.module.compressor if isinstance(self.module, DataParallel) else None

    @property
    def stages(self) -> PipelineStages | None:
        """This rank's pipeline pieces (None when pp = 1)."""
        return self.pipeline.stages if self.pipeline is not None else None

    def norm_groups(self) -> list[AxisGroup]:
        """The groups a global gradient norm's local square is summed over, in order:
        the ZeRO shard group (each element of a replica on exactly one rank), tp (the
        tensor-parallel pieces) and pp (the stages), each only when it has several
        ranks. Replicas (dp outside the shard group, cp) are not summed: they are equal."""
        groups: list[AxisGroup] = []
        zero = self.zero
        if zero is not None and zero.shard_group.size > 1:
            groups.append(zero.shard_group)
        for axis in ("tp", "pp"):
            if self.mesh.size(axis) > 1:
                groups.append(self.mesh.axis(axis))
        return groups

    def norm_weight(self, p: torch.Tensor) -> float:
        """Weight of ``p``'s squared gradient norm in the global norm: 1/k for a tensor
        held identically by k tp ranks, 0 for the last stage's copy of a tied matrix
        (the first stage counts it), else 1."""
        stages = self.stages
        if stages is not None and p is stages.tied and stages.pp_index > 0:
            return 0.0
        info = shard_info(p)
        return info.norm_weight if info is not None else 1.0

    def local_pieces(self) -> list[LocalPiece]:
        """The parameter pieces this rank holds, in one-device names and shapes, each
        written by exactly one rank: the data wrapper's pieces (whole tensors, or ZeRO
        shard segments) refined by tensor parallelism (the block held) and the pipeline
        (the tied copy is written by the first stage); the data wrapper spans dp x cp,
        so cp replicas are covered by its own write flags."""
        inner = self.module
        assert isinstance(inner, DataParallel | ZeroDataParallel)
        own = inner.local_pieces()  # each wrapper describes its own pieces
        tp_index = self.mesh.index("tp")
        stages = self.stages
        skip = stages.tied if stages is not None and stages.pp_index > 0 else None
        out = []
        for piece in own:
            piece = tensor_parallel_piece(piece, tp_index)
            write = piece.write and piece.key is not skip
            out.append(piece.but(name=self._names[id(piece.key)], write=write))
        return out

    # ------------------------------------------------------------------ step

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating."""
        no_sync = getattr(self.module, "no_sync", None)
        with no_sync() if no_sync is not None else contextlib.nullcontext():
            yield

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (not available when pp > 1: use :meth:`step`).
        Under context parallelism it takes this rank's tokens (``self.context.shard(x)``);
        :meth:`step` and :meth:`evaluate` shard whole sequences themselves."""
        if self.pipeline is not None:
            raise RuntimeError(
                "a pipeline-parallel model runs through ParallelModel.step / evaluate "
                "(the schedule drives every stage), not forward()"
            )
        return self.module(*args, **kwargs)

    def _dp_mean(self, value: torch.Tensor | float) -> torch.Tensor:
        """``value`` averaged over the data-parallel ranks (and the cp ranks, whose
        token shards are equal in size: the mean over all tokens; float64, detached);
        reduced on the mesh's device (NCCL cannot all-reduce CPU tensors)."""
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=torch.float64)
        v = value.detach().to(self.mesh.device, torch.float64).reshape(1).clone()
        comm.all_reduce(v, self.mesh.axis(*_data_axes(self.mesh)), op="avg")
        return v.reshape(())

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        micro_batches: int = 1,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of this rank's batch; returns the mean loss of the global
        batch (averaged over dp; float64, detached).

        Without a pipeline the batch is cut into ``micro_batches`` equal micro-batches;
        all but the last accumulate without communicating (``no_sync``) and each loss
        is divided by their number, so the gradient is the batch mean whatever the
        split. With a pipeline the schedule cuts it into its own ``m`` micro-batches
        (``micro_batches`` must then be 1 or m). ``loss_scale`` multiplies the loss
        before backward (the fp16 loss scaler: :attr:`plait.optim.Optimizer.loss_scale`).
        After the call every gradient is reduced and ready for the optimizer. Under
        context parallelism every cp rank passes the same whole sequences and keeps its
        own tokens of each.
        """
        if self.context is not None:
            inputs, targets = self.context.shard(inputs), self.context.shard(targets)
        if self.pipeline is not None:
            m = self.pipeline.schedule.microbatches
            if micro_batches not in (1, m):
                raise ValueError(
                    f"the pipeline cuts each batch into its {m} micro-batches; pass "
                    f"micro_batches=1 or {m}, not {micro_batches}"
                )
            return self._dp_mean(self.pipeline.train(inputs, targets, loss_scale))
        if inputs.shape[0] % micro_batches:
            raise ValueError(
                f"a batch of {inputs.shape[0]} does not split into {micro_batches} "
                "equal micro-batches"
            )
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        pairs = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True))
        for k, (x, y) in enumerate(pairs):
            last = k == len(pairs) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                micro_loss = self.loss_fn(at_least_fp32(logits_of(self.module(x))), y)
                (micro_loss * (loss_scale / micro_batches)).backward()
            total += micro_loss.detach().double() / micro_batches
        return self._dp_mean(total)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch without backward (averaged over dp; float64)."""
        if self.context is not None:
            inputs, targets = self.context.shard(inputs), self.context.shard(targets)
        if self.pipeline is not None:
            return self._dp_mean(self.pipeline.evaluate(inputs, targets))
        return self._dp_mean(self.loss_fn(at_least_fp32(logits_of(self.module(inputs))), targets))

    def describe(self) -> str:
        """One line: the wrappers applied, outermost last."""
        zero = self.zero
        if zero is not None:
            note = (
                f"ZeRO stage {zero.stage} over dp: shard groups of {zero.shard_group.size}, "
                f"replicated x{zero.replicate_group.size}, {len(zero.units)} units"
                + (f", offload {zero.offload}" if zero.offload != "none" else "")
            )
        else:
            note = "plain data parallel (bucketed all-reduce)"
            if self.compressor is not None:
                note += f", {self.compressor.describe()}"
        tp, cp = self.mesh.size("tp"), self.mesh.size("cp")
        if cp > 1 and self.context is not None:
            kind = "ring, zigzag" if self.context.layout == "zigzag" else "all-to-all"
            note = f"context parallel cp {cp} ({kind}); {note}"
        if tp > 1:
            note = f"tensor parallel tp {tp} (vocabulary-parallel loss); {note}"
        if self.pipeline is not None:
            note = f"{self.pipeline.describe()}; {note}"
        return note


def _one_device_names(model: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """(id(parameter) -> canonical name, every name -> canonical name) of ``model``;
    a tensor reachable under several names (tied weights) is named by its first."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return canonical, aliases


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    cfg: ParallelConfig | Config | None = None,
    *,
    zero: int | None = None,
    zero_shard_size: int | None = None,
    tp_plan: Plan | None = None,
    sequence_parallel: bool | None = None,
    cp_attention: str | None = None,
    recompute: Recompute | None = None,
    precision: PrecisionConfig | str | None = None,
    loss_fn: LossFn | None = None,
    ignore_index: int = IGNORE_INDEX,
    compressor: Compressor | None = None,
) -> ParallelModel:
    """Return ``model`` prepared for ``mesh`` (see the module docstring).

    ``cfg`` is the parallel section, a whole :class:`Config` (which also supplies
    ``train.recompute``, the ``precision`` section and the pipeline's profiling shape)
    or None (defaults); keyword arguments override it: ``zero`` (stage 0-3),
    ``zero_shard_size`` (hybrid factor F), ``tp_plan`` (a plan as data; default: the
    model's ``plait_tp_plan``, the shipped plan of a Hugging Face Llama or the built-in
    transformer's), ``sequence_parallel``, ``cp_attention`` (ring /
    ulysses), ``recompute`` (none / selective /
    full), ``precision`` (a :class:`PrecisionConfig` or a dtype name such as "bf16"),
    ``loss_fn`` (default: cross-entropy, vocabulary-parallel when tp > 1, skipping
    ``ignore_index``), ``compressor`` (a gradient compressor for plain data parallelism;
    default: the one ``parallel.compression`` names). The degrees come from ``mesh``.
    """
    full = cfg if isinstance(cfg, Config) else None
    p: ParallelConfig
    if full is not None:
        p = full.parallel
    elif isinstance(cfg, ParallelConfig):
        p = cfg
    else:
        p = ParallelConfig()
    overrides: dict[str, Any] = {
        k: v
        for k, v in (
            ("zero", zero),
            ("zero_shard_size", zero_shard_size),
            ("sequence_parallel", sequence_parallel),
            ("cp_attention", cp_attention),
        )
        if v is not None
    }
    p = dataclasses.replace(p, **overrides) if overrides else p  # validated again
    if recompute is None:
        recompute = full.train.recompute if full is not None else "none"
    if isinstance(precision, str):
        precision = PrecisionConfig(dtype=precision)  # type: ignore[arg-type]
    precision = precision or (full.precision if full is not None else PrecisionConfig())
    policy = PrecisionPolicy.from_names(precision.dtype, precision.reduce_dtype)
    tp, pp = mesh.size("tp"), mesh.size("pp")
    sp = p.sequence_parallel and tp > 1
    if loss_fn is None:
        loss_fn = (
            vocab_parallel_loss(mesh, vocab_size_of(model, tp_plan), ignore_index)
            if tp > 1
            else cross_entropy_loss(ignore_index)
        )
    if pp > 1:  # refuse a model the split cannot cut, naming it, before any change
        check_splittable(model)
    # 1. tensor (and sequence) parallelism over the tp axis.
    if tp > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, plan=tp_plan)
    names, aliases = _one_device_names(model)
    param_names = list(names.values())
    # 2. context parallelism over cp: attention cores and token positions.
    context = apply_context_parallel(model, mesh, p.cp_attention) if mesh.size("cp") > 1 else None
    # 3. pipeline split (pp > 1): keep this rank's pieces.
    inner: nn.Module = model
    if pp > 1:
        seq = full.train.seq_len // mesh.size("cp") if full else 0
        shape = (full.micro_batch(mesh.world_size), seq) if full else (1, 0)
        inner = split_for_pipeline(
            model,
            mesh,
            chunks=p.chunks,
            balance=p.balance,
            profile_shape=shape,
            seq_factor=tp if sp else 1,
        )
        for n, q in model.named_parameters():  # a copy made by the split (tied matrix)
            names.setdefault(id(q), aliases.get(n, n))
    # 4. activation recomputation.
    if recompute != "none":
        apply_recompute(inner, recompute)
    # 5. ZeRO sharding or data parallelism over dp.
    plain = (
        p.zero == 0
        and not policy.needs_master_weights
        and policy.grad_reduce_dtype == policy.param_dtype
    )
    if compressor is None:
        compressor = make_compressor(
            p.compression,
            ratio=p.compression_ratio,
            rank=p.compression_rank,
            start=p.compression_start,
        )
    if compressor is not None:  # the plain path only (same rule as the config's)
        check_compression(compressor.name, p.zero, precision.dtype, precision.reduce_dtype)
    wrapped: nn.Module
    if plain:
        wrapped = DataParallel(
            inner,
            mesh,
            bucket_mb=p.bucket_mb,
            find_unused_parameters=p.find_unused_parameters,
            axes=_data_axes(mesh),
            compressor=compressor,
        )
    else:
        wrapped = ZeroDataParallel(
            inner,
            mesh,
            stage=p.zero,
            zero_shard_size=p.zero_shard_size if p.zero > 0 else None,
            reshard_after_forward=p.reshard_after_forward,
            prefetch=p.prefetch,
            # fp32 (the default) keeps the model's own dtype (a float64 model stays float64)
            param_dtype=policy.param_dtype if policy.needs_master_weights else None,
            reduce_dtype=policy.reduce_dtype,
            offload=p.offload,
            find_unused_parameters=p.find_unused_parameters,
            axis=_data_axes(mesh),
            bucket_mb=p.bucket_mb if p.zero in (1, 2) else None,  # fused like DP's buckets
        )
    pipeline = None
    if pp > 1:
        m = full.pipeline_microbatches(mesh.world_size) if full else (p.microbatches or 2 * pp)
        pipeline = PipelineEngine(
            wrapped,
            mesh,
            loss_fn,
            schedule=p.pipeline_schedule,
            microbatches=m,
            hidden_dim=_hidden_dim(model),
            seq_factor=tp if sp else 1,
            zero_grad_reduce=p.pp_grad_reduce,
            zero_reshard=p.pp_reshard,
        )
    return ParallelModel(wrapped, mesh, loss_fn, pipeline, names, param_names, context)


def _data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes whose ranks hold the same parameters and average their gradients:
    dp, and cp when it has several ranks."""
    return ("dp", "cp") if mesh.size("cp") > 1 else ("dp",)


def _hidden_dim(model: nn.Module) -> int:
    """The width of the activations passed between pipeline pieces."""
    cfg = getattr(model, "cfg", None)
    dim = getattr(cfg, "dim", None)
    if not isinstance(dim, int):
        raise TypeError(
            f"pipeline parallelism needs the model's hidden width: {type(model).__name__} "
            "has no cfg.dim (the pipeline split supports plait's built-in Transformer)"
        )
    return dim
