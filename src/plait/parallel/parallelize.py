"""Apply parallelism to a model written for one device, in one fixed order.

``parallelize(model, mesh, ...)`` replaces and wraps modules from outside (the model
file never changes) in this fixed order (docs/api.md describes it too):

1. **tensor / sequence parallelism** over the tp axis (when it has several ranks): a
   TP plan as data (default: the built-in transformer's), applied in place by
   :func:`~plait.parallel.tensor.sharding_plan.apply_tensor_parallel`;
1c. **LoRA** (``lora.rank`` set): every parameter is frozen (the base cast to the
   compute dtype under bf16/fp16, since a frozen tensor needs no fp32 master) and the
   targeted linear layers get adapters, split like the base layer they attach to
   (:func:`~plait.parallel.lora.apply_lora`; after tensor parallelism, so that each
   adapter sees its layer's local product; before the split and the data-parallel
   wrappers, which then shard and reduce only the adapters);
2. **context parallelism** over cp (when it has several ranks): every attention core
   becomes ring or all-to-all (Ulysses) attention on the cp group and the token
   positions become the rank's global positions
   (:func:`~plait.parallel.context.context_parallel.apply_context_parallel`); the step
   feeds each cp rank its shard of every sequence;
3. **pipeline split** over pp (when it has several ranks): this rank's pieces
   (:func:`~plait.parallel.pipeline.engine.split_for_pipeline`);
4. **activation recomputation** (:func:`~plait.parallel.recompute.apply_recompute`);
   then, with ``compile`` (``train.compile``), **torch.compile per block**
   (:func:`~plait.parallel.compile.apply_compile`): each block's forward, recompute
   wrapper included, becomes one compiled graph; the data-parallel / ZeRO hooks applied
   next stay eager around it (docs/compile.md); then, with ``activation_offload``
   (``train.activation_offload``), the saved tensors of each block (the first
   ``activation_offload_blocks``, 0: all) go to host memory in forward
   (:func:`~plait.parallel.activation_offload.apply_activation_offload`, outermost);
5. **ZeRO sharding or data parallelism** over dp (over dp x cp when cp > 1: the cp
   ranks hold the same parameters, so gradients and shards span both):
   ``zero`` 1, 2 or 3 -> :class:`~plait.parallel.zero.ZeroDataParallel`; ``zero = 0``
   with fp32 parameters and reduction -> :class:`~plait.parallel.data_parallel.DataParallel`
   (bucketed, overlapped all-reduce); ``zero = 0`` with bf16/fp16 parameters (or another
   reduction dtype) -> ``ZeroDataParallel`` at stage 0 (replicated, but flattened so the
   optimizer holds fp32 masters). ZeRO's driver is chosen here, once: autograd's hooks,
   or for stages 2/3 under pp the pipeline schedule (no hook installed; the pipeline
   engine is handed the wrapper's :attr:`~plait.parallel.zero.ZeroDataParallel.drive`).
   Gradient compression (``parallel.compression``) plugs into ``DataParallel``'s buckets
   and needs the plain path.

The model may return logits, a Hugging Face output with ``.logits`` or a tuple whose
first element is the logits (:func:`~plait.model.factory.logits_of` picks them for the
loss). The result, a :class:`~plait.parallel.model.ParallelModel`, holds all a training
step needs: the wrapped module, the loss that fits the layout
(:mod:`plait.parallel.loss`; vocabulary-parallel when tp > 1, so the full logits are
never gathered), and the pipeline driver when pp > 1. Its
:meth:`~plait.parallel.model.ParallelModel.step` is the same call with or without a
pipeline, so a user's own loop and plait's trainer are the same few lines::

    pm = plait.parallelize(model, mesh, zero=3)
    opt = plait.optim.Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    loss = pm.step(tokens, targets)          # forward + backward (+ pipeline schedule)
    opt.step(); opt.zero_grad()

One rank is the degenerate case of the same path: every wrapper is applied, its
collectives are counted no-ops.

A model built on the meta device (:func:`plait.model.factory.build_meta_model`, or
``with torch.device("meta"): Transformer(cfg, seed=s)``) goes through steps 1-4 as
shapes only; before step 5 each rank allocates on ``mesh.device`` only what it keeps
and initialises it with the one-device values (:mod:`plait.parallel.materialize`): its
full replica for plain data parallelism and ZeRO 0-2, its flat shards for ZeRO-3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from plait.checkpoint.peft_io import read_peft_adapter
from plait.config import (
    Config,
    CPAttention,
    LoraConfig,
    ParallelConfig,
    PrecisionConfig,
    Recompute,
    TrainConfig,
)
from plait.config.rules.features import check_compression
from plait.config.rules.layout import check_expert_parallel
from plait.config.rules.model import check_moe_aux_scope
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.model.init import SEED_ATTR, InitialValues, has_meta
from plait.model.moe import MoE
from plait.parallel.activation_offload import OffloadPool, apply_activation_offload
from plait.parallel.compile import apply_compile
from plait.parallel.compression import Compressor, adam_before, make_compressor
from plait.parallel.context.context_parallel import apply_context_parallel
from plait.parallel.data_parallel import DataParallel
from plait.parallel.expert import ExpertGradSync, apply_expert_parallel
from plait.parallel.expert.tp_plan import moe_tp_plan
from plait.parallel.float8 import apply_float8, check_float8
from plait.parallel.lora import LoraValues, apply_lora
from plait.parallel.loss import LossFn, cross_entropy_loss
from plait.parallel.materialize import LocalInit, materialize_module, tensor_names
from plait.parallel.model import ParallelModel, data_axes
from plait.parallel.pipeline.engine import PipelineEngine, split_for_pipeline
from plait.parallel.pipeline.split import check_splittable
from plait.parallel.precision import PrecisionPolicy
from plait.parallel.recompute import apply_recompute
from plait.parallel.tensor.loss import IGNORE_INDEX, vocab_parallel_loss
from plait.parallel.tensor.sharding_plan import ShardingPlan, apply_tensor_parallel, vocab_size_of
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.drive import SCHEDULE_STAGES, ZeroDrive, ZeroDriver


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
    tp_plan: ShardingPlan | None = None,
    sequence_parallel: bool | None = None,
    cp_attention: CPAttention | None = None,
    recompute: Recompute | None = None,
    precision: PrecisionConfig | str | None = None,
    loss_fn: LossFn | None = None,
    ignore_index: int = IGNORE_INDEX,
    compressor: Compressor | None = None,
    compile: bool | None = None,
    loss_chunk: int | None = None,
    lora: LoraConfig | None = None,
    activation_offload: bool | None = None,
    activation_offload_blocks: int | None = None,
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
    default: the one ``parallel.compression`` names), ``compile`` (torch.compile each
    block; default: ``train.compile``), ``loss_chunk`` (tokens per chunk of the
    default loss; default ``train.loss_chunk``), ``lora`` (low-rank adapters on the
    frozen model; default: the ``lora`` section), ``activation_offload`` and
    ``activation_offload_blocks`` (saved activations to host memory; default: the
    ``train`` section). The degrees come from ``mesh``.
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
    if compile is None:
        compile = full.train.compile if full is not None else False
    if activation_offload is None:
        activation_offload = full.train.activation_offload if full is not None else False
    if activation_offload_blocks is None:
        activation_offload_blocks = full.train.activation_offload_blocks if full else 0
    if isinstance(precision, str):
        precision = PrecisionConfig(dtype=precision)  # type: ignore[arg-type]
    precision = precision or (full.precision if full is not None else PrecisionConfig())
    policy = PrecisionPolicy.from_names(precision.dtype, precision.reduce_dtype)
    tp, pp = mesh.size("tp"), mesh.size("pp")
    sp = p.sequence_parallel and tp > 1
    if loss_chunk is None:
        loss_chunk = (full.train if full is not None else TrainConfig()).loss_chunk
    if tp > 1 and tp_plan is None:  # MoE layers: routed experts whole on every tp rank
        tp_plan = moe_tp_plan(model)
    if loss_fn is None:
        loss_fn = (
            vocab_parallel_loss(mesh, vocab_size_of(model, tp_plan), ignore_index, loss_chunk)
            if tp > 1
            else cross_entropy_loss(ignore_index, loss_chunk)
        )
    if pp > 1:  # refuse a model the split cannot cut, naming it, before any change
        check_splittable(model)
    # a meta-built model: its one-device values, captured before any module is replaced
    values = InitialValues(model) if has_meta(model) else None
    start_names = tensor_names(model) if values is not None else {}
    # 1. tensor (and sequence) parallelism over the tp axis.
    if tp > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, plan=tp_plan)
    # 1b. expert parallelism: this rank's experts of every MoE layer, all-to-all dispatch.
    dp, cp = mesh.size("dp"), mesh.size("cp")
    for n_experts in _experts(model):  # of every MoE layer
        check_expert_parallel(p.ep, dp, cp, n_experts, p.compression)
    for layer in model.modules():  # the model-wide load-balancing loss spans every stage
        if isinstance(layer, MoE):
            check_moe_aux_scope(layer.aux_scope, layer.aux_coef, layer.n_experts, mesh.size("pp"))
    data = mesh.axis(*data_axes(mesh))
    tokens = mesh.axis(*data_axes(mesh), "tp") if sp else None  # SP: tp ranks route too
    experts = apply_expert_parallel(model, mesh, p.ep, data, values, tokens)
    # 1c. LoRA: freeze the model, attach adapters split like their base layers.
    if lora is None and full is not None:
        lora = full.lora
    if lora is not None and lora.enabled:
        values = _apply_lora(model, lora, full, values, policy, precision.float8)
    names, aliases = _one_device_names(model)
    init: LocalInit | None = None
    param_names = list(names.values())
    # 2. context parallelism over cp: attention cores and token positions.
    context = apply_context_parallel(model, mesh, p.cp_attention) if mesh.size("cp") > 1 else None
    if precision.float8:  # 2b. float8 linear layers (torchao), refused where they cannot run
        check_float8(True, mesh.device.type)
        apply_float8(model)
    # 3. pipeline split (pp > 1): keep this rank's pieces.
    inner: nn.Module = model
    if values is not None and pp > 1 and p.balance == "measured":
        # the profile runs every block: materialise the (tp-local) whole model first
        init = LocalInit(values, {**start_names, **names}, mesh.index("tp"))
        materialize_module([model], init, mesh.device)
        values = None
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
    # 4b. torch.compile per block (after recompute: its wrapper is compiled with the block).
    if compile:
        apply_compile(inner)
    # 4c. activation offload around each (compiled) block: saved tensors to host memory.
    pool = None
    if activation_offload:
        pool = OffloadPool(mesh.device)
        apply_activation_offload(inner, pool, activation_offload_blocks or 0)
    # 5. ZeRO sharding or data parallelism over dp.
    plain = (
        p.zero == 0
        and not policy.needs_master_weights
        and policy.grad_reduce_dtype == policy.param_dtype
    )
    init = None
    if values is not None:  # allocate only what this rank keeps (ZeRO-3: shards itself)
        init = LocalInit(values, {**start_names, **names}, mesh.index("tp"))
        zero3 = not plain and p.zero == 3
        materialize_module([inner, model], init, mesh.device, params=not zero3)
    if compressor is None:
        compressor = make_compressor(
            p.compression,
            ratio=p.compression_ratio,
            rank=p.compression_rank,
            start=p.compression_start,
            warmup=p.compression_warmup_steps,
            scope=p.compression_topk_scope,
            sign_every=p.compression_topk_sign_every,
            sign_scale=p.compression_topk_sign_scale,
            **adam_before(p, full),
        )
    if compressor is not None:  # the plain path only (same rule as the config's)
        check_compression(compressor.name, p.zero, precision.dtype, precision.reduce_dtype)
    split = experts if experts is not None and experts.ep > 1 else None  # experts split
    wrapped: nn.Module
    drive: ZeroDrive | None = None  # ZeRO-2/3 under pp: what the schedule sequences
    if plain:
        wrapped = DataParallel(
            inner,
            mesh,
            bucket_mb=p.bucket_mb,
            find_unused_parameters=p.find_unused_parameters,
            axes=data_axes(mesh),
            compressor=compressor,
            broadcast=init is None,  # materialised values are equal on every rank
            exclude=split.params if split is not None else (),
        )
    else:
        # chosen once: under pp the schedule drives ZeRO-2/3 (no hook installed)
        driver: ZeroDriver = "schedule" if pp > 1 and p.zero in SCHEDULE_STAGES else "autograd"
        zdp = ZeroDataParallel(
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
            axis=data_axes(mesh),
            bucket_mb=p.bucket_mb if p.zero in (1, 2) else None,  # fused like DP's buckets
            init=init,
            offload_dir=p.offload_dir,
            offload_delay=p.offload_delay,
            # ep > 1: expert weights in units of their own over their replica group
            expert_params=split.params if split is not None else (),
            expert_group=split.replica_group if split is not None else None,
            driver=driver,
        )
        wrapped = zdp
        drive = zdp.drive if driver == "schedule" else None
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
            zero=drive,
            zero_grad_reduce=p.pp_grad_reduce,
            zero_reshard=p.pp_reshard,
        )
    if experts is not None:  # this pipeline stage's MoE layers only: no reference keeps
        experts.keep_only(inner)  # another stage's experts alive on this rank
    if split is not None and isinstance(wrapped, DataParallel):  # (ZeRO: its expert units)
        dp_wrapper = wrapped
        split.sync = ExpertGradSync(
            split.params, split.replica_group, data.size, lambda: dp_wrapper.syncing
        )
    return ParallelModel(
        wrapped,
        mesh,
        loss_fn,
        pipeline,
        names,
        param_names,
        context,
        experts=experts,
        offload_pool=pool,
    )


def _apply_lora(
    model: nn.Module,
    lora: LoraConfig,
    full: Config | None,
    values: InitialValues | None,
    policy: PrecisionPolicy,
    float8: bool,
) -> InitialValues | None:
    """Step 1c: :func:`~plait.parallel.lora.apply_lora` with the run's seed, the base in
    the compute dtype when the precision keeps fp32 masters (the frozen base needs no
    master), and ``lora.init_from``'s adapter; returns the initial values to materialise
    from (the adapters' first) for a meta-built model."""
    if float8:
        raise ConfigError("LoRA with precision.float8 is not supported; turn one of them off")
    assert lora.rank is not None
    seed = values.seed if values is not None else getattr(model, SEED_ATTR, None)
    if seed is None:  # a model built on a real device: the run's seed
        seed = full.train.seed if full is not None else 0
    family = full.model.family if full is not None else "plait"
    initial = (
        read_peft_adapter(lora.init_from, lora.rank, lora.alpha, family) if lora.init_from else None
    )
    base_dtype = policy.param_dtype if policy.needs_master_weights else None
    applied = apply_lora(model, lora, seed=seed, base_dtype=base_dtype, initial=initial)
    if values is None:
        return None
    return LoraValues(values, applied.values)  # type: ignore[return-value]


def _experts(model: nn.Module) -> list[int]:
    """The distinct routed-expert counts of the model's MoE layers (``[0]``: none);
    found by scanning its modules, as :func:`apply_expert_parallel` does."""
    found = sorted({m.n_experts for m in model.modules() if isinstance(m, MoE)})
    return found or [0]


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
