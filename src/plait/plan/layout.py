"""What the planner is asked about: a parallel layout, a precision policy, a runtime.

* :class:`Layout`: the degrees of the mesh (dp, tp, pp, cp), the ZeRO stage and hybrid
  sharding factor F, the batch split (micro-batch size and micro-batches per step),
  activation recomputation, the pipeline schedule and Megatron sequence parallelism.
* :class:`Precision`: bytes per parameter of weights, gradients, fp32 master weights and
  optimizer state, and the element size of saved activations.
* :class:`Runtime`: implementation choices that change memory or time but are not
  layout decisions (attention kernel, dropout, how gradient buckets are held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from plait.config import (
    PLANNED_SCHEDULES,
    ZERO_MEANING,
    ZERO_STAGES,
    Compression,
    Config,
    CPAttention,
    Offload,
    PlannedSchedule,
    PPGradReduce,
    Recompute,
    check_choices,
)
from plait.config.rules.activation_offload import check_offload_blocks
from plait.config.rules.choices import check_choice, check_non_negative, check_positive
from plait.config.rules.features import check_compression, check_offload
from plait.config.rules.layout import (
    check_chunks,
    check_ep_axis,
    check_sequence_parallel,
    check_shard_size,
    check_world,
)
from plait.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """One way of splitting a training step over ``dp·tp·pp·cp`` devices."""

    dp: int = 1
    """Data-parallel degree (replicas, or ZeRO shards)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split of every block)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree (the sequence split across ranks)."""
    zero: int = 0
    """ZeRO stage over the data-parallel axis: 0 (replicated), 1, 2 or 3."""
    zero_shard_size: int | None = None
    """Hybrid sharding factor F: ZeRO shards inside groups of F data-parallel ranks and
    replicates across the dp/F groups (None: F = dp, full sharding)."""
    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel replica."""
    microbatches: int = 1
    """Micro-batches per optimizer step on one replica (gradient accumulation steps, or
    the pipeline's m)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (core attention) or full (per block)."""
    schedule: PlannedSchedule = "1f1b"
    """Pipeline schedule (ignored when pp = 1); one of those the planner models."""
    chunks: int = 1
    """v: model chunks per pipeline rank for the interleaved schedule."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the norm/dropout regions (needs tp > 1)."""
    cp_attention: CPAttention = "ring"
    """How attention spans the cp ranks: 'ring' (K/V blocks around the ring, overlapped
    with the blocks' compute) or 'ulysses' (four all-to-alls per layer and pass)."""
    compression: Compression = "none"
    """Data-parallel gradient compression: none, fp16, bf16, topk or powersgd
    (:mod:`plait.plan.compression`)."""
    compression_ratio: float = 0.01
    """topk: the fraction of gradient entries sent."""
    compression_rank: int = 4
    """powersgd: the approximation rank."""
    pp_grad_reduce: PPGradReduce = "step"
    """ZeRO-2/3 with pp > 1: gradients reduce-scattered once per step (the pieces' full
    gradients held through the step) or after every backward action (one piece's)."""
    pp_reshard: bool = False
    """ZeRO-3 with pp > 1: free a piece's gathered parameters after every action (one
    piece's held at a time, 2 all-gathers per piece and micro-batch) instead of keeping
    every local piece gathered through the step (one all-gather per step)."""
    offload: Offload = "none"
    """ZeRO-Offload: 'optimizer' (masters and optimizer state on the host) or 'params'
    (ZeRO-3: also the parameter shards); :mod:`plait.plan.offload`."""
    offload_nvme: bool = False
    """ZeRO-Infinity's NVMe tier (``parallel.offload_dir``): optimizer state in files."""
    edge_trim: int = 0
    """Blocks the first and the last pipeline stage each hold fewer than an even split
    of ``n_layers + 2·edge_trim`` (they also hold the embedding and the head): Llama 3
    405B's balancing (Dubey et al. 2024, section 3.3.2). plait's runtime splits evenly
    (0); a planner-only option for published layouts."""
    offload_delay: bool = False
    """ZeRO-Offload's one-step-delayed update (``parallel.offload_delay``): the host keeps
    a full fp32 gradient buffer (the gradients outlive the next backward) instead of the
    ring of a few units' buffers; :mod:`plait.plan.offload`."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model (``parallel.ep``): the routed
    experts split over groups of ep of the dp x cp ranks (ep divides dp·cp); ignored for
    a dense model (:mod:`plait.plan.moe_estimate`)."""
    offload_two_pass: bool = True
    """ZeRO-Offload's step depends on the global gradient norm (``train.grad_clip > 0``,
    the default; fp16 loss scaling; ``precision.nonfinite`` not 'error'): the norm first,
    then unit by unit copy -> unscale/clip -> host step; False: each unit steps as its
    gradient lands, under backward (:mod:`plait.plan.offload_time`)."""
    activation_offload: bool = False
    """The blocks' saved activations go to host memory in forward and come back before
    backward (``train.activation_offload``; :mod:`plait.plan.activation_offload`)."""
    activation_offload_blocks: int = 0
    """With activation_offload: only the first N blocks of each rank (0: every block)."""

    def __post_init__(self) -> None:
        degrees = ("dp", "tp", "pp", "cp", "micro_batch", "microbatches", "chunks")
        check_positive("layout ", **{key: getattr(self, key) for key in degrees})
        check_non_negative("layout ", edge_trim=self.edge_trim)
        check_choice("layout zero", self.zero, ZERO_STAGES, ZERO_MEANING)
        check_choices(self, "layout ")
        check_compression(self.compression, self.zero)
        check_offload(self.offload, self.zero)
        check_shard_size(self.zero_shard_size, self.zero, self.dp)
        check_chunks(self.schedule, self.chunks)
        check_sequence_parallel(self.sequence_parallel, self.tp)
        check_ep_axis(self.ep, self.dp, self.cp)
        check_offload_blocks(self.activation_offload, self.activation_offload_blocks)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        """The layout a run of ``cfg`` on ``world_size`` ranks uses: every
        :data:`FROM_PARALLEL` field under its layout name, the batch split and
        recomputation of ``[train]`` (:data:`FROM_ELSEWHERE`). Values that mean nothing
        in the run are the layout's neutral ones (no F without ZeRO, no sequence
        parallelism at tp = 1, v = 1 but interleaved); zero-bubble ZB-H1 keeps 1F1B's
        activations and naive holds fewer: both are counted as 1F1B (a safe
        over-estimate)."""
        p, t = cfg.parallel, cfg.train
        dp = check_world(p.dp, p.tp, p.pp, p.cp, world_size)
        values: dict[str, Any] = {lay: getattr(p, par) for par, lay in FROM_PARALLEL.items()}
        micro = cfg.micro_batch(world_size)
        m = max(1, t.global_batch // (dp * micro))
        if p.pp > 1:
            m = cfg.pipeline_microbatches(world_size)
            micro = max(1, t.global_batch // (dp * m))
        schedule = p.pipeline_schedule if p.pipeline_schedule in PLANNED_SCHEDULES else "1f1b"
        values.update(
            dp=dp,
            microbatches=m,
            schedule=schedule if p.pp > 1 else "1f1b",
            chunks=p.chunks if p.pp > 1 and schedule == "interleaved" else 1,
            zero_shard_size=p.zero_shard_size if p.zero else None,
            sequence_parallel=p.sequence_parallel and p.tp > 1,
            offload_nvme=p.offload_dir is not None,
            micro_batch=micro,
            recompute=t.recompute,
            activation_offload=t.activation_offload,
            activation_offload_blocks=t.activation_offload_blocks,
            offload_two_pass=(  # the step needs the global norm first
                t.grad_clip > 0
                or cfg.precision.dtype == "fp16"
                or cfg.precision.nonfinite != "error"
            ),
        )
        return cls(**values)

    def parallel_settings(self) -> dict[str, object]:
        """The :class:`~plait.config.ParallelConfig` values a run of this layout sets,
        by :data:`FROM_PARALLEL` read backwards: ``parallel.microbatches`` only for a
        pipeline (without one the accumulation follows from the global batch), the
        hybrid factor only when it is not dp, and no ``offload_dir`` (a folder the run
        names; the layout says only whether there is one)."""
        out: dict[str, object] = {
            par: getattr(self, lay) for par, lay in FROM_PARALLEL.items() if par != "offload_dir"
        }
        out["zero_shard_size"] = (
            self.shard_factor if self.zero and self.shard_factor != self.dp else None
        )
        if self.pp == 1:
            out["microbatches"] = None
        return out

    @property
    def world(self) -> int:
        """Devices the layout uses: dp·tp·pp·cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: dp · micro_batch · microbatches."""
        return self.dp * self.micro_batch * self.microbatches

    @property
    def shard_factor(self) -> int:
        """F with its default: dp when ZeRO is on, 1 otherwise."""
        if self.zero == 0:
            return 1
        return self.zero_shard_size if self.zero_shard_size is not None else self.dp

    def describe(self) -> str:
        """A compact one-line label, e.g. ``dp8 tp2 pp1 cp1 zero1 mb2x4 rc=none``."""
        s = f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} zero{self.zero}"
        if self.cp > 1 and self.cp_attention == "ulysses":
            s += " ulysses"
        if self.zero and self.shard_factor != self.dp:
            s += f" F{self.shard_factor}"
        s += f" mb{self.micro_batch}x{self.microbatches}"
        if self.pp > 1:
            s += f" {self.schedule}"
            if self.schedule == "interleaved":
                s += f"(v{self.chunks})"
            if self.zero >= 2 and self.pp_grad_reduce == "microbatch":
                s += " rs/mb"  # gradients reduce-scattered per micro-batch
            if self.zero == 3 and self.pp_reshard:
                s += " reshard"
        if self.sequence_parallel:
            s += " sp"
        if self.edge_trim and self.pp > 1:
            s += f" edges-{self.edge_trim}"
        if self.compression != "none":
            s += f" {self.compression}"
        if self.offload != "none":
            s += f" offload={self.offload}" + ("+nvme" if self.offload_nvme else "")
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.activation_offload:  # saved activations on the host (N: the first N blocks)
            n = self.activation_offload_blocks
            s += f" act-offload{n if n else ''}"
        return s + f" rc={self.recompute}"


FROM_PARALLEL: dict[str, str] = {
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
    "cp_attention": "cp_attention",
    "sequence_parallel": "sequence_parallel",
    "pipeline_schedule": "schedule",
    "microbatches": "microbatches",
    "chunks": "chunks",
    "zero": "zero",
    "zero_shard_size": "zero_shard_size",
    "pp_grad_reduce": "pp_grad_reduce",
    "pp_reshard": "pp_reshard",
    "offload": "offload",
    "offload_dir": "offload_nvme",
    "offload_delay": "offload_delay",
    "compression": "compression",
    "compression_ratio": "compression_ratio",
    "compression_rank": "compression_rank",
    "ep": "ep",
}
"""The one mapping between the run configuration and the planner: each
:class:`~plait.config.ParallelConfig` field that is a layout decision, and the
:class:`Layout` field it becomes (:meth:`Layout.from_config`, and backwards
:meth:`Layout.parallel_settings`). Every other ParallelConfig field is in
:data:`RUNTIME_ONLY`."""

RUNTIME_ONLY: tuple[str, ...] = (
    "balance",  # how blocks are cut into pipeline pieces (the planner splits evenly)
    "reshard_after_forward",  # ZeRO-3 within a step (the planner models the default)
    "prefetch",  # ZeRO-3 prefetch (the planner's Runtime.prefetch_units)
    "bucket_mb",  # the planner's Runtime.bucket_mb
    "find_unused_parameters",
    "compression_start",
    "compression_warmup_steps",
    "compression_adam",
    "compression_topk_scope",
    "compression_topk_sign_every",
    "compression_topk_sign_scale",
    "backend",
    "timeout_s",
)
""":class:`~plait.config.ParallelConfig` fields that are not layout decisions: how the
runtime carries a layout out (a test fails when a field is in neither this nor
:data:`FROM_PARALLEL`)."""

FROM_ELSEWHERE: dict[str, str] = {
    "micro_batch": "train.micro_batch (or global_batch / (dp x parallel.microbatches))",
    "recompute": "train.recompute",
    "activation_offload": "train.activation_offload",
    "activation_offload_blocks": "train.activation_offload_blocks",
    "offload_two_pass": "train.grad_clip > 0, precision.dtype fp16 or precision.nonfinite",
    "edge_trim": "none: a planner-only option for published layouts",
}
""":class:`Layout` fields that no ParallelConfig field maps to, and where they come from."""


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each training state, and the activation element size."""

    name: str
    """Label, e.g. ``bf16-mixed``."""
    param_bytes: int
    """Weights as used by forward/backward (2 for bf16, 4 for fp32)."""
    grad_bytes: int
    """Gradients as produced by backward."""
    master_bytes: int
    """fp32 master copy of the weights kept by the optimizer (0 when weights are fp32)."""
    optimizer_bytes: int
    """Optimizer state per parameter (Adam's m and v in fp32: 8)."""
    optimizer_tensor_bytes: int
    """Per-tensor optimizer scalars (torch Adam keeps a 4-byte ``step`` per tensor)."""
    activation_bytes: int
    """Element size of saved activations (2 for bf16/fp16, 4 for fp32)."""

    def __post_init__(self) -> None:
        for key in ("param_bytes", "grad_bytes", "activation_bytes"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"precision {key} must be positive.")
        for key in ("master_bytes", "optimizer_bytes", "optimizer_tensor_bytes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"precision {key} must not be negative.")

    @property
    def state_bytes_per_param(self) -> int:
        """Weights + gradients + master + optimizer state per parameter (16 for
        mixed-precision Adam: 2 + 2 + 4 + 4 + 4)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


PRECISIONS: dict[str, Precision] = {
    "bf16-mixed": Precision("bf16-mixed", 2, 2, 4, 8, 4, 2),
    "fp16-mixed": Precision("fp16-mixed", 2, 2, 4, 8, 4, 2),
    "fp32": Precision("fp32", 4, 4, 0, 8, 4, 4),
}
"""Precision policies with Adam(W): ZeRO paper's K = 12 for the mixed ones."""


def precision_preset(name: str) -> Precision:
    """The precision ``name``; unknown names are refused with the list."""
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[name]


@dataclass(frozen=True)
class Runtime:
    """Implementation traits of the training runtime that the models depend on."""

    name: str = "plait"
    """Label."""
    attention: Literal["flash", "math"] = "flash"
    """Attention kernel: fused (saves q, k, v, output and the log-sum-exp) or unfused
    (materialises the s x s scores)."""
    dropout: bool = False
    """Dropout after attention, MLP and embedding (adds 1-byte masks)."""
    fused_norm: bool = False
    """The norm kernel saves only its input and statistics; plait's RMSNorm is written
    in plain PyTorch and also saves its normalised output."""
    grad_buckets: Literal["copy", "view"] = "view"
    """Data-parallel gradient buckets: the gradients are views into the communication
    buckets (plait's DataParallel, Megatron's contiguous buffer, DDP's
    ``gradient_as_bucket_view``) or the buckets hold a persistent flat copy of every
    gradient (DDP's default; plait's DataParallel before issue 18)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (the unit of one overlapped all-reduce)."""
    prefetch_units: int = 1
    """ZeRO-3: units gathered ahead of the one computing."""
    step_collectives: int = 1
    """Small collectives per step outside the gradient path (e.g. the loss average)."""
    fused_accumulation: bool = False
    """Gradient accumulation is fused into the weight-gradient GEMM (Megatron-LM's
    gradient_accumulation_fusion) instead of a separate read-add-write per micro-batch."""
    sp_saves_gathered: bool = True
    """Under sequence parallelism, the all-gathered input of each column-parallel layer
    is saved whole for its weight gradient (plait); Megatron-LM saves only the sequence
    shard and all-gathers it again in backward (Korthikanti et al. 2022, section 4.2.2)."""
    fused_swiglu: bool = False
    """SwiGLU as one kernel that saves only its inputs (gate and up) and recomputes
    silu(gate) in backward (Megatron-LM's bias_swiglu); plait's SwiGLU is plain PyTorch
    and also saves silu(gate)."""

    def __post_init__(self) -> None:
        check_choices(self, "runtime ")
        if self.bucket_mb <= 0 or self.prefetch_units < 0 or self.step_collectives < 0:
            raise ConfigError("runtime bucket_mb must be positive and counts not negative.")


RUNTIMES: dict[str, Runtime] = {
    "plait": Runtime(),
    "megatron": Runtime(
        "megatron",
        attention="math",
        dropout=True,
        fused_norm=True,
        grad_buckets="view",
        bucket_mb=40.0,
        fused_accumulation=True,
        fused_swiglu=True,
        sp_saves_gathered=False,
    ),
    "megatron-flash": Runtime(
        "megatron-flash",
        attention="flash",
        dropout=False,
        fused_norm=True,
        grad_buckets="view",
        bucket_mb=40.0,
        fused_accumulation=True,
        fused_swiglu=True,
        sp_saves_gathered=False,
    ),
}
"""``plait``: this repository's runtime. ``megatron``: Megatron-LM as in Korthikanti et
al. 2022 (unfused attention, dropout, fused LayerNorm and SwiGLU, contiguous gradient
buffer);
``megatron-flash``: the same with a fused attention kernel and no dropout."""


def runtime_preset(name: str) -> Runtime:
    """The runtime ``name``; unknown names are refused with the list."""
    if name not in RUNTIMES:
        raise ConfigError(f"unknown runtime {name!r}; choose one of {', '.join(RUNTIMES)}.")
    return RUNTIMES[name]
