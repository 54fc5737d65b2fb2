"""ParallelModel: a model prepared for a mesh, with the loss that fits and its step driver.

:func:`~plait.parallel.parallelize.parallelize` builds it; this module holds what a
training step does with it:

* :meth:`ParallelModel.step` / :meth:`~ParallelModel.evaluate` — forward and backward
  (or forward only) of this rank's batch, the same call with or without a pipeline
  (micro-batches under ``no_sync``, or the pipeline schedule), sharding sequences for
  context parallelism, returning the global batch's token-weighted loss
  (:mod:`plait.parallel.token_weight`);
* the layout as the optimizer and checkpoints see it, composed from the data wrapper's
  own answers refined by tensor and pipeline parallelism: :meth:`~ParallelModel.norm_groups`,
  :meth:`~ParallelModel.norm_weight`, :meth:`~ParallelModel.zero_wrapper` (the
  :class:`~plait.optim.OptimizerTarget` protocol) and :meth:`~ParallelModel.local_pieces`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.mesh import Mesh
from plait.model.factory import logits_of
from plait.parallel.activation_offload import OffloadPool
from plait.parallel.compression import Compressor
from plait.parallel.context.context_parallel import ContextLayout
from plait.parallel.data_parallel import DataParallel
from plait.parallel.expert import ExpertLayout, expert_split
from plait.parallel.lora.frozen import frozen_pieces
from plait.parallel.loss import LossFn, loss_input
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.split import PipelineStages
from plait.parallel.tensor.layers import tensor_parallel_piece
from plait.parallel.token_weight import token_sum, token_weight, weighted
from plait.parallel.zero import ZeroDataParallel
from plait.pieces import LocalPiece


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes whose ranks hold the same parameters and average their gradients:
    dp, and cp when it has several ranks."""
    return ("dp", "cp") if mesh.size("cp") > 1 else ("dp",)


class ParallelModel(nn.Module):
    """A model prepared for a mesh: the wrapped module, its loss and its step driver.

    Built by :func:`~plait.parallel.parallelize.parallelize` (whose docstring gives the
    order the wrappers are applied in). Attributes:

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
        *,
        experts: ExpertLayout | None = None,
        offload_pool: OffloadPool | None = None,
    ) -> None:
        super().__init__()
        self.offload_pool = offload_pool
        """``train.activation_offload``: the host copies of the blocks' saved activations
        and their byte counts (None: off)."""
        self.experts = experts
        """The MoE layers and, under expert parallelism (ep > 1), the expert weights,
        their groups and their gradient reduction (None: no MoE layer)."""
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

    @property
    def data_wrapper(self) -> DataParallel | ZeroDataParallel:
        """The outermost wrapper, :class:`DataParallel` or :class:`ZeroDataParallel`."""
        inner = self.module
        assert isinstance(inner, DataParallel | ZeroDataParallel)
        return inner

    # ------------------------------------------------------------------ optimizer

    def norm_groups(self) -> list[AxisGroup]:
        """The groups a global gradient norm's local square is summed over, in order:
        the data wrapper's (the ZeRO shard group, each element of a replica on exactly
        one rank; tp, the tensor-parallel pieces), then pp (the stages) when it has
        several ranks. Replicas (dp outside the shard group, cp) are not summed: they
        are equal."""
        groups = self.data_wrapper.norm_groups()
        if self._experts_outside:  # each expert on one ep rank
            groups.append(self.experts.ep_group)  # type: ignore[union-attr]
        if self.mesh.size("pp") > 1:
            groups.append(self.mesh.axis("pp"))
        return groups

    def norm_weight(self, p: torch.Tensor) -> float:
        """Weight of ``p``'s squared gradient norm in the global norm: 0 for the last
        stage's copy of a tied matrix (the first stage counts it), else the data
        wrapper's (1/k for a tensor held identically by k tp ranks, else 1)."""
        stages = self.stages
        if stages is not None and p is stages.tied and stages.pp_index > 0:
            return 0.0
        if self._experts_outside:  # summed over ep too
            assert self.experts is not None
            if expert_split(p) is not None:  # whole on every tp rank
                return 1.0 / self.mesh.size("tp")
            return self.data_wrapper.norm_weight(p) / self.experts.ep
        return self.data_wrapper.norm_weight(p)

    @property
    def _experts_outside(self) -> bool:
        """Expert weights split over ep ranks and left out of the data wrapper (plain data
        parallelism: :class:`~plait.parallel.expert.ExpertGradSync` reduces them); under
        ZeRO they are the wrapper's own expert units, which answer for themselves."""
        return self.experts is not None and self.experts.ep > 1 and self.zero is None

    def zero_wrapper(self) -> ZeroDataParallel | None:
        """The ZeRO wrapper whose shards the optimizer steps (None under plain data
        parallelism: the parameters are their own masters)."""
        return self.zero

    def local_pieces(self) -> list[LocalPiece]:
        """The parameter pieces this rank holds, in one-device names and shapes, each
        written by exactly one rank: the data wrapper's pieces (whole tensors, or ZeRO
        shard segments) refined by tensor parallelism (the block held) and the pipeline
        (the tied copy is written by the first stage); the data wrapper spans dp x cp,
        so cp replicas are covered by its own write flags."""
        own = self.data_wrapper.local_pieces()  # each wrapper describes its own pieces
        writer = self.mesh.axis(*data_axes(self.mesh)).index == 0
        own += frozen_pieces(self.data_wrapper.module, writer)  # LoRA's base, whole
        tp_index = self.mesh.index("tp")
        stages = self.stages
        skip = stages.tied if stages is not None and stages.pp_index > 0 else None
        out = []
        for piece in own:
            piece = ExpertLayout.refine(tensor_parallel_piece(piece, tp_index))  # ZeRO: ep block
            write = piece.write and piece.key is not skip
            out.append(piece.but(name=self._names[id(piece.key)], write=write))
        if self._experts_outside:  # not the data wrapper's
            out += self.experts.pieces(self._names, tp_index)  # type: ignore[union-attr]
        return out

    # ------------------------------------------------------------------ step

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating."""
        no_sync = getattr(self.module, "no_sync", None)
        with no_sync() if no_sync is not None else contextlib.nullcontext():
            yield  # expert gradients follow the data wrapper's syncing

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
        comm.all_reduce(v, self.mesh.axis(*data_axes(self.mesh)), op="avg")
        return v.reshape(())

    def _token_weight(self, targets: torch.Tensor) -> torch.Tensor | None:
        """``D / N`` for this step's targets (this rank's share of the global batch, cp
        shard included): one all-reduce of a count over the data axes; None for a loss
        without ``token_sum`` (:mod:`plait.parallel.token_weight`)."""
        group = self.mesh.axis(*data_axes(self.mesh))
        return token_weight(self.loss_fn, targets, group, self.mesh.device)

    def _micro_loss(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, parts: int
    ) -> torch.Tensor:
        """One micro-batch's share of the rank's loss, the tensor to differentiate: its
        summed loss times ``weight`` (token weighting), else its mean over ``parts``."""
        logits = loss_input(self.loss_fn, logits_of(self.module(x)))
        if weight is None:
            return self.loss_fn(logits, y) / parts
        return weighted(token_sum(self.loss_fn, logits, y), weight)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        micro_batches: int = 1,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of this rank's batch; returns the loss of the global
        batch (float64, detached, the same on every rank).

        The loss is token-weighted (:mod:`plait.parallel.token_weight`): the sum over
        every counted target of the global batch (all micro-batches, cp shards and data
        ranks) divided by their number, one all-reduce of a count per step; for a
        ``loss_fn`` without ``token_sum``, the mean of micro-batch means. Without a
        pipeline the batch is cut into ``micro_batches`` equal micro-batches; all but the
        last accumulate without communicating (``no_sync``). With a pipeline the schedule
        cuts it into its own ``m`` micro-batches (``micro_batches`` must then be 1 or m).
        ``loss_scale`` multiplies the loss before backward (the fp16 loss scaler:
        :attr:`plait.optim.Optimizer.loss_scale`). After the call every gradient is
        reduced and ready for the optimizer. Under context parallelism every cp rank
        passes the same whole sequences and keeps its own tokens of each.
        """
        if self.context is not None:
            inputs, targets = self.context.shard(inputs), self.context.shard(targets)
        if self.experts is not None:  # the MoE aux losses' share of the scaled loss
            m = self.pipeline.schedule.microbatches if self.pipeline is not None else 1
            self.experts.set_grad_scale(loss_scale / (m if m > 1 else micro_batches))
        if self.pipeline is not None:
            m = self.pipeline.schedule.microbatches
            if micro_batches not in (1, m):
                raise ValueError(
                    f"the pipeline cuts each batch into its {m} micro-batches; pass "
                    f"micro_batches=1 or {m}, not {micro_batches}"
                )
            weight = self._token_weight(targets)
            return self._dp_mean(self.pipeline.train(inputs, targets, loss_scale, weight))
        if inputs.shape[0] % micro_batches:
            raise ValueError(
                f"a batch of {inputs.shape[0]} does not split into {micro_batches} "
                "equal micro-batches"
            )
        weight = self._token_weight(targets)
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        pairs = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True))
        for k, (x, y) in enumerate(pairs):
            last = k == len(pairs) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                micro_loss = self._micro_loss(x, y, weight, micro_batches)
                (micro_loss * loss_scale).backward()
            total += micro_loss.detach().double()
        return self._dp_mean(total)

    def moe_summary(self) -> dict[str, float]:
        """The last step's router figures (load-balancing and z-loss, expert load,
        dropped tokens; :meth:`ExpertLayout.summary`); empty without MoE layers. A
        collective over the data ranks when the model has MoE layers."""
        if self.experts is None:
            return {}
        return self.experts.summary(self.mesh.axis(*data_axes(self.mesh)))

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of a global batch without backward, token-weighted as in
        :meth:`step` (float64, the same on every rank)."""
        if self.context is not None:
            inputs, targets = self.context.shard(inputs), self.context.shard(targets)
        weight = self._token_weight(targets)
        if self.pipeline is not None:
            return self._dp_mean(self.pipeline.evaluate(inputs, targets, weight))
        return self._dp_mean(self._micro_loss(inputs, targets, weight, 1))

    def describe(self) -> str:
        """One line: the wrappers applied, outermost last."""
        zero = self.zero
        if zero is not None:
            note = (
                f"ZeRO stage {zero.stage} over dp: shard groups of {zero.shard_group.size}, "
                f"replicated x{zero.replicate_group.size}, {len(zero.units)} units"
                + (f", offload {zero.offload}" if zero.offload != "none" else "")
            )
            if zero.expert_groups is not None:  # ep > 1: the expert units' own groups
                g = zero.expert_groups[0 if zero.stage else 1]
                verb = "sharded" if zero.stage else "replicated"
                note += f", expert units {verb} over ep_replica ({g.size})"
        else:
            note = "plain data parallel (bucketed all-reduce)"
            if self.compressor is not None:
                note += f", {self.compressor.describe()}"
        tp, cp = self.mesh.size("tp"), self.mesh.size("cp")
        if self.experts is not None and self.experts.ep > 1:
            note = f"{note}; expert parallel ep {self.experts.ep} (all-to-all)"
        if cp > 1 and self.context is not None:
            kind = "ring, zigzag" if self.context.layout == "zigzag" else "all-to-all"
            note = f"context parallel cp {cp} ({kind}); {note}"
        if tp > 1:
            note = f"tensor parallel tp {tp} (vocabulary-parallel loss); {note}"
        if self.pipeline is not None:
            note = f"{self.pipeline.describe()}; {note}"
        return note
