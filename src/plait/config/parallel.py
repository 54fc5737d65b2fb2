"""The parallel section (``[parallel]``): the layout (mesh degrees) and how gradients are
reduced, sharded, compressed and offloaded."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import (
    ZERO_MEANING,
    ZERO_STAGES,
    Backend,
    Balance,
    Compression,
    CompressionAdam,
    CPAttention,
    Offload,
    PipelineSchedule,
    PPGradReduce,
    TopKScope,
    check_choices,
)
from plait.config.rules.choices import check_choice, check_positive
from plait.config.rules.features import check_compression_warmup
from plait.config.rules.layout import check_pp_reshard
from plait.errors import ConfigError


@dataclass
class ParallelConfig:
    """The parallel layout: degrees of the mesh axes and how gradients are reduced."""

    dp: int | None = None
    """Data-parallel degree (default: world size / (tp·pp·cp))."""
    tp: int = 1
    """Tensor-parallel degree (Megatron: heads, MLP and vocabulary split over tp ranks).
    model.n_heads and the MLP width must be divisible by it, and model.n_kv_heads too
    unless tp is a multiple of it (then each KV head is replicated on tp/n_kv_heads
    ranks); the vocabulary is padded to a multiple of tp."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each cp rank holds 1/cp of every sequence and attention
    runs across the cp ranks (parallel.cp_attention). Parameters are replicated over cp,
    so gradients (and ZeRO shards) reduce over the combined dp x cp group."""
    cp_attention: CPAttention = "ring"
    """How attention spans the cp ranks: 'ring' (K/V blocks pass around the ring,
    overlapped with block compute; causal load balance by the zigzag layout, so
    train.seq_len must be divisible by 2·cp) or 'ulysses' (all-to-all from sequence
    shards to head shards and back; seq_len divisible by cp, the heads per tp rank
    divisible by cp)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1; no effect at tp = 1): the norm/residual
    regions between tensor-parallel regions hold a 1/tp shard of the sequence; an
    all-gather enters each region and a reduce-scatter leaves it (the bytes of the
    all-reduce they replace, 1/tp of those activations). train.seq_len must be
    divisible by tp."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule when pp > 1: 'naive' (one micro-batch at a time), 'gpipe' (all
    forwards, then all backwards), '1f1b' (one forward one backward; activations bounded by
    pp), 'interleaved' (1F1B over parallel.chunks pieces per rank) or 'zb' (zero-bubble
    ZB-H1: backward split into input and weight gradients)."""
    microbatches: int | None = None
    """Pipeline micro-batches per optimizer step and data-parallel rank (pp > 1; default:
    the accumulation count global_batch / (dp x train.micro_batch) when train.micro_batch
    is set, else 2 x pp). The per-rank batch global_batch / dp must divide into them."""
    chunks: int = 1
    """Model pieces per pipeline rank (v, > 1 only with the 'interleaved' schedule): the
    model is cut into pp x chunks pieces of contiguous blocks, assigned round-robin."""
    balance: Balance = "equal"
    """How blocks are assigned to pipeline pieces: 'equal' (equal block counts) or
    'measured' (profile each block's forward + backward time in a short run and choose
    the contiguous split that minimises the slowest piece; boundaries are printed)."""
    zero: int = 0
    """ZeRO stage over the data-parallel axis: 0 = plain data parallel, 1 = optimizer state
    sharded, 2 = also gradients, 3 = also parameters (fully sharded)."""
    zero_shard_size: int | None = None
    """Hybrid sharding factor F for ZeRO: shard inside groups of F consecutive dp ranks
    and all-reduce across the dp/F groups (default: dp, full sharding; 1: replicate
    everything, i.e. plain data parallelism). Must divide dp."""
    reshard_after_forward: bool = True
    """ZeRO-3: free a unit's gathered parameters after its forward and gather them again
    for its backward (false: keep them until the backward; less traffic, more memory)."""
    pp_grad_reduce: PPGradReduce = "step"
    """ZeRO-2/3 with pp > 1: when gradients, accumulated over the micro-batches of a step,
    are reduce-scattered over dp: 'step' (once per unit and step, right after the last
    backward of its pipeline piece; the piece's full gradients are held through the
    step; the torchtitan/FSDP2 choice) or 'microbatch' (after every backward action:
    only one piece's full gradients at a time, m times the reduce-scatters)."""
    pp_reshard: bool = False
    """ZeRO-3 with pp > 1: free a pipeline piece's gathered parameters after every forward
    and backward action (unless the rank's next action runs the same piece) and gather
    them again for the next micro-batch (true: one piece's parameters held at a time,
    which pays with several chunks per rank), or keep them gathered from the piece's
    first action of a step to its last (false, the default: one all-gather per unit and
    step; torchtitan's reshard_after_forward=False under PP)."""
    prefetch: bool = True
    """ZeRO-3: start gathering the next unit's parameters while the current one computes."""
    offload: Offload = "none"
    """CPU offload under ZeRO (zero >= 1): 'optimizer' keeps the fp32 master weights and
    the optimizer state on the CPU and steps there; 'params' (zero 3) also keeps the
    parameter shards on the CPU between uses."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for the overlapped data-parallel all-reduce; under
    ZeRO 1/2 consecutive units are fused into reduce-scatter and all-gather buckets of
    at least this size."""
    find_unused_parameters: bool = False
    """Treat parameters that get no gradient as zero gradients instead of refusing."""
    compression: Compression = "none"
    """Gradient compression over dp (plain data parallelism only): 'fp16' / 'bf16' (cast,
    all-reduce, cast back), 'topk' (largest entries, error feedback) or 'powersgd'
    (low-rank, error feedback); see docs/compression.md."""
    compression_ratio: float = 0.01
    """topk: the fraction rho of each bucket's entries sent per step, in (0, 1]."""
    compression_rank: int = 4
    """powersgd: the approximation rank r (>= 1) of each matrix-shaped gradient."""
    compression_start: int = 0
    """Plain (uncompressed) steps before compression begins (PowerSGD's start_iter)."""
    compression_warmup_steps: int = 0
    """topk: sparsity warm-up (Deep Gradient Compression): over this many compressed
    steps the density decays exponentially from 25 % to compression_ratio (0: none)."""
    compression_adam: CompressionAdam = "before"
    """topk with the trainer's AdamW: 'before' runs Adam's moments on each rank's own
    gradient in front of the sparsification and sends the step direction (the Adam form of
    DGC's momentum correction; the optimizer becomes plain SGD); 'after' sends the raw
    gradient and runs AdamW after the exchange (exact at ratio 1)."""
    backend: Backend = "auto"
    """Process-group backend: gloo on CPU, nccl on CUDA, auto picks by device."""
    timeout_s: float = 300.0
    """Every collective raises an error naming rank, axis and operation after this long."""
    offload_dir: str | None = None
    """With parallel.offload: keep the offloaded optimizer state (with 'params' also the
    fp32 masters) in files in this folder on a local disk, ZeRO-Infinity's NVMe tier
    (None: in host memory). Refused when not writable or too small (docs/offload.md)."""
    offload_delay: bool = False
    """With parallel.offload: the one-step-delayed update (DeepSpeed's delayed parameter
    update): the host step of step t runs while the device computes step t+1's gradients
    on the weights before it, which hides the CPU step; changes the loss curve (one step
    of gradient staleness; docs/offload.md)."""
    ep: int = 1
    """Expert-parallel degree: the routed experts of every MoE layer are split over groups
    of ep consecutive data-parallel ranks (a sub-axis of dp x cp; ep divides dp * cp and
    model.moe_experts); tokens travel to their experts by all-to-all (docs/moe.md)."""
    compression_topk_scope: TopKScope = "tensor"
    """topk: where the largest entries are picked: 'tensor' (ceil(rho * n) per matrix, as
    in DGC) or 'bucket' (one top-k over all matrix entries of a gradient bucket, the same
    count in total, so a matrix whose residual is larger gets more of the budget; vectors
    go whole either way); see docs/compression.md."""
    compression_topk_sign_every: int = 0
    """topk: every this many compressed steps also send one bit per remaining matrix entry
    of the residual (its sign, one scale per tensor: compression_topk_sign_scale times its
    mean magnitude), error-fed; 1 adds 1/32 of the fp32 gradient bytes per step (0: off);
    see docs/compression.md."""
    compression_topk_sign_scale: float = 1.8
    """topk with compression_topk_sign_every: the magnitude of the sent signs as a multiple
    of each tensor's mean residual magnitude (> 0; 1 is the least-squares scale of one
    step, error feedback takes back any overshoot; 1.8, the default, converged best of
    the scales measured; above 2 the residual's oscillation grows); see
    docs/compression.md."""

    def __post_init__(self) -> None:
        check_choices(self, "parallel.")
        check_positive(
            "parallel.",
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            bucket_mb=self.bucket_mb,
            timeout_s=self.timeout_s,
        )
        check_choice("parallel.zero", self.zero, ZERO_STAGES, ZERO_MEANING)
        check_positive(
            "parallel.",
            microbatches=self.microbatches,
            chunks=self.chunks,
            zero_shard_size=self.zero_shard_size,
        )
        check_pp_reshard(self.pp_reshard, self.zero, self.pp)
        if not 0.0 < self.compression_ratio <= 1.0:
            raise ConfigError(
                f"parallel.compression_ratio must be in (0, 1], got {self.compression_ratio} "
                "(the fraction of gradient entries top-k sends, e.g. 0.01)."
            )
        if self.compression_rank < 1:
            raise ConfigError(
                f"parallel.compression_rank must be >= 1, got {self.compression_rank}."
            )
        if self.compression_start < 0:
            raise ConfigError(
                f"parallel.compression_start must be >= 0, got {self.compression_start}."
            )
        check_compression_warmup(self.compression_warmup_steps, self.compression_ratio)
        if self.compression_topk_sign_every < 0:
            raise ConfigError(
                "parallel.compression_topk_sign_every must be >= 0, got "
                f"{self.compression_topk_sign_every}."
            )
        if not self.compression_topk_sign_scale > 0:
            raise ConfigError(
                "parallel.compression_topk_sign_scale must be > 0, got "
                f"{self.compression_topk_sign_scale}."
            )
        if self.compression_topk_sign_every and self.compression != "topk":
            raise ConfigError(
                "parallel.compression_topk_sign_every sends top-k's residual signs and "
                f"needs parallel.compression = topk, got {self.compression!r}."
            )
        if (self.offload_dir is not None or self.offload_delay) and self.offload == "none":
            raise ConfigError(
                "parallel.offload_dir and parallel.offload_delay need parallel.offload = "
                "'optimizer' or 'params' (they are about the offloaded optimizer state)."
            )

    def resolved_dp(self, world_size: int) -> int:
        """The data-parallel degree for a world of ``world_size`` ranks."""
        if self.dp is not None:
            return self.dp
        return max(1, world_size // (self.tp * self.pp * self.cp))
