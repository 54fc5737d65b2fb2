"""Typed configuration for a plait run.

Every field has a docstring (the string literal under it); `plait train --help-config`
prints them. Each dataclass validates its own fields in ``__post_init__``; checks that
need several sections (the layout against the world size, the global batch against
the layout) run in :meth:`Config.validate`, before any process starts. The rules
themselves are written once, as functions on plain values, in :mod:`plait.config_checks`
(which imports nothing from here); the constructors that need a rule call the same one.

Each set of allowed values (pipeline schedules, recompute policies, offload kinds, ...)
is declared here once, as a ``Literal`` type; the tuple of its values is derived from it
(``typing.get_args``) and every other module imports both from here.

The **global batch** (``train.global_batch``, in sequences) is the invariant of a run:
the per-rank micro-batch and the number of accumulation steps are derived from it and
the data-parallel degree, so changing the layout never changes the math.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from plait.config_checks import (
    check_batch,
    check_choice,
    check_compression,
    check_compression_warmup,
    check_cp_sequence,
    check_document_mask,
    check_expert_parallel,
    check_generation_layout,
    check_moe,
    check_offload,
    check_pipeline,
    check_positive,
    check_pp_reshard,
    check_rope_scaling,
    check_sample_length,
    check_seq_len,
    check_shard_size,
    check_sp_under_cp,
    check_tokenizer_vocab,
    check_ulysses_heads,
    check_world,
    parse_step_window,
)
from plait.errors import ConfigError

Backend = Literal["auto", "gloo", "nccl"]
Device = Literal["auto", "cpu", "cuda"]
Progress = Literal["auto", "bar", "lines", "none"]
Offload = Literal["none", "optimizer", "params"]
Recompute = Literal["none", "selective", "full"]
DType = Literal["fp32", "bf16", "fp16"]
ReduceDType = Literal["auto", "fp32", "bf16", "fp16"]
NonFinite = Literal["error", "skip"]
PipelineSchedule = Literal["naive", "gpipe", "1f1b", "interleaved", "zb"]
Balance = Literal["equal", "measured"]
PPGradReduce = Literal["step", "microbatch"]
AttentionKind = Literal["sdpa", "blockwise"]
ModelFamily = Literal["plait", "hf-llama"]
RopeScaling = Literal["none", "linear", "llama3"]
CPAttention = Literal["ring", "ulysses"]
MoERouter = Literal["softmax", "sigmoid"]
Compression = Literal["none", "fp16", "bf16", "topk", "powersgd"]
CompressionAdam = Literal["before", "after"]
WandbMode = Literal["off", "offline", "online"]
LaunchBackend = Literal["local", "torchrun", "ray"]
TokenDType = Literal["uint16", "uint32"]
PresetStyle = Literal["llama", "gpt"]
"""Block style of a model preset (:mod:`plait.presets`): ``llama`` (plait's built-in
block) or ``gpt`` (GPT-2/3's block)."""
PlannedSchedule = Literal["1f1b", "gpipe", "interleaved"]
"""The pipeline schedules the planner models (:class:`plait.plan.layout.Layout`); it
counts a run's 'naive' and 'zb' as '1f1b' (a safe over-estimate of their memory)."""

RECOMPUTES: tuple[Recompute, ...] = get_args(Recompute)
PIPELINE_SCHEDULES: tuple[PipelineSchedule, ...] = get_args(PipelineSchedule)
PLANNED_SCHEDULES: tuple[PlannedSchedule, ...] = get_args(PlannedSchedule)
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
CP_ATTENTIONS: tuple[CPAttention, ...] = get_args(CPAttention)
PP_GRAD_REDUCES: tuple[PPGradReduce, ...] = get_args(PPGradReduce)
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)
COMPRESSION_ADAMS: tuple[CompressionAdam, ...] = get_args(CompressionAdam)
NONFINITES: tuple[NonFinite, ...] = get_args(NonFinite)
PRESET_STYLES: tuple[PresetStyle, ...] = get_args(PresetStyle)
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""The ZeRO stages (``parallel.zero`` is a plain int: the planner counts with it)."""
ZERO_MEANING = (
    "0 = plain data parallel, 1 = optimizer state sharded, 2 = also gradients, "
    "3 = also parameters (fully sharded)"
)
"""What each of :data:`ZERO_STAGES` means, for the refusal of any other."""


_CHOICES: dict[type, tuple[tuple[str, tuple[Any, ...]], ...]] = {}


def _choices(cls: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """(field, allowed values) of each field of the dataclass ``cls`` annotated with a
    ``Literal`` (worked out once per class)."""
    if cls not in _CHOICES:
        hints = get_type_hints(cls)
        _CHOICES[cls] = tuple(
            (f.name, get_args(hints[f.name]))
            for f in fields(cls)
            if get_origin(hints[f.name]) is Literal
        )
    return _CHOICES[cls]


def check_choices(obj: object, prefix: str) -> None:
    """Each field of the dataclass ``obj`` annotated with a set of values (a ``Literal``)
    holds one of them; ``prefix`` names the owner in the message (``"parallel."``).
    The sections here and the planner's :class:`~plait.plan.layout.Layout` call it."""
    for name, allowed in _choices(type(obj)):
        check_choice(f"{prefix}{name}", getattr(obj, name), allowed)


@dataclass
class ModelConfig:
    """The model: size and shape of the built-in decoder-only transformer (the same sizes
    build a Hugging Face Llama with family 'hf-llama'), or your own model (factory)."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the built-in byte-level tokenizer."""
    dim: int = 128
    """Hidden (model) width h."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads; dim must be divisible by it."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention (default: n_heads)."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP (default: 8/3·dim rounded up to multiple_of)."""
    multiple_of: int = 32
    """The default ffn_dim is rounded up to a multiple of this."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables are built for."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    rope_scaling: RopeScaling = "none"
    """Rotary frequency scaling, as Hugging Face's rope_scaling: 'none', 'linear' (every
    frequency divided by rope_factor) or 'llama3' (Llama 3.1's: wavelengths above
    rope_original_max_seq_len / rope_low_freq_factor divided by rope_factor, below
    rope_original_max_seq_len / rope_high_freq_factor kept, smoothed between). Set from
    config.json by --init-from a Hugging Face folder."""
    rope_factor: float = 1.0
    """The rope_scaling factor."""
    rope_low_freq_factor: float = 1.0
    """'llama3' scaling's low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """'llama3' scaling's high_freq_factor."""
    rope_original_max_seq_len: int = 8192
    """'llama3' scaling's original_max_position_embeddings (the pretraining length)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    attention: AttentionKind = "sdpa"
    """Attention kernel on one device: 'sdpa' (torch's fused scaled_dot_product_attention)
    or 'blockwise' (plait's exact block-by-block online-softmax attention, which saves
    only O(seq) per head for backward). Under parallel.cp > 1 the cp attention is used."""
    family: ModelFamily = "plait"
    """Which model the size fields build: 'plait' (the built-in transformer) or
    'hf-llama' (Hugging Face transformers' LlamaForCausalLM from a LlamaConfig with these
    sizes, randomly initialised, nothing downloaded; needs the extra plait[hf]).
    docs/models.md maps the fields."""
    factory: str | None = None
    """Your own model: 'package.module:function', called as function(model_config) after
    torch.manual_seed(train.seed); it returns an nn.Module mapping token ids (batch, seq)
    to logits (batch, seq, vocab) or to an output with .logits. The module must be
    importable (installed, on PYTHONPATH or in the current folder). Overrides family."""
    moe_experts: int = 0
    """Routed experts per mixture-of-experts layer (E); 0: every feed-forward is dense
    (docs/moe.md)."""
    moe_top_k: int = 2
    """Experts each token is routed to (k <= moe_experts)."""
    moe_every: int = 1
    """Layer i uses the MoE feed-forward when (i + 1) % moe_every == 0 (1: every layer,
    2: every second layer, ...); the others stay dense."""
    moe_shared_experts: int = 0
    """Always-on experts (DeepSeek style), computed for every token beside the routed ones
    (one SwiGLU of width moe_shared_experts * moe_hidden_dim)."""
    moe_hidden_dim: int | None = None
    """Hidden width of one expert's SwiGLU (default: the dense hidden width / top-k, so a
    token's active feed-forward FLOPs match the dense model's)."""
    moe_router: MoERouter = "softmax"
    """Router: 'softmax' (softmax over experts, top-k, weights renormalised to sum 1) or
    'sigmoid' (sigmoid scores, top-k, weights normalised to sum 1; DeepSeek-V3)."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss E * sum_i f_i * P_i in the training
    loss (0: off)."""
    moe_z_loss_coef: float = 0.001
    """Weight of the router z-loss mean(logsumexp(logits)^2) in the training loss (0: off)."""
    moe_capacity_factor: float = 0.0
    """0: dropless (every routed token is computed). > 0: each expert takes at most
    ceil(factor * tokens * k / E) of a rank's routed tokens per layer; the overflow is
    dropped (top-1 choices first, then by token index) and counted."""

    def __post_init__(self) -> None:
        check_choices(self, "model.")
        check_positive(
            "model.",
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            multiple_of=self.multiple_of,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
            rope_factor=self.rope_factor,
            rope_low_freq_factor=self.rope_low_freq_factor,
            rope_high_freq_factor=self.rope_high_freq_factor,
            rope_original_max_seq_len=self.rope_original_max_seq_len,
            norm_eps=self.norm_eps,
            init_std=self.init_std,
        )
        check_rope_scaling(self.rope_scaling, self.rope_low_freq_factor, self.rope_high_freq_factor)
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})."
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"the head dimension dim/n_heads = {self.dim // self.n_heads} must be even "
                "for rotary positions."
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads "
                f"({self.kv_heads}) for grouped-query attention."
            )
        if self.factory is not None:
            module, sep, attr = self.factory.partition(":")
            if not (sep and module.strip() and attr.strip()):
                raise ConfigError(
                    f"model.factory must be 'package.module:function', got {self.factory!r}."
                )
        check_moe(
            self.moe_experts,
            self.moe_top_k,
            self.moe_every,
            self.moe_shared_experts,
            self.moe_hidden_dim,
            self.moe_aux_loss_coef,
            self.moe_z_loss_coef,
            self.moe_capacity_factor,
        )

    @property
    def kv_heads(self) -> int:
        """Key/value head count with the default applied."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width with the default applied."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        raw = (8 * self.dim) // 3
        return self.multiple_of * ((raw + self.multiple_of - 1) // self.multiple_of)

    def rope_scaling_entries(self) -> dict[str, Any] | None:
        """The RoPE scaling as Hugging Face's config writes it (``rope_type``, ``factor``
        and llama3's frequency factors); None: unscaled."""
        if self.rope_scaling == "none":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_scaling, "factor": self.rope_factor}
        if self.rope_scaling == "llama3":
            out["low_freq_factor"] = self.rope_low_freq_factor
            out["high_freq_factor"] = self.rope_high_freq_factor
            out["original_max_position_embeddings"] = self.rope_original_max_seq_len
        return out


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


@dataclass
class TrainConfig:
    """The optimisation: batch, schedule, optimizer and evaluation."""

    steps: int = 500
    """Number of optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step across all ranks (the invariant of the run)."""
    micro_batch: int | None = None
    """Sequences per rank per forward/backward (default: global_batch / dp, no accumulation)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    lr: float = 3e-3
    """Peak learning rate (before the linear scaling rule, if enabled)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr · min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay."""
    scale_lr: bool = False
    """Linear scaling rule: multiply lr by global_batch / base_batch (reported at start)."""
    base_batch: int = 16
    """Reference global batch for the linear scaling rule."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    seed: int = 0
    """Seed for weights, data order and every random generator."""
    eval_every: int = 100
    """Compute the validation loss every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Global batches averaged for one validation loss."""
    recompute: Recompute = "none"
    """Activation recomputation: 'none', 'selective' (recompute only the attention core
    of each block in backward), 'full' (recompute each whole block)."""
    checkpoint_dir: str | None = None
    """Folder of sharded checkpoints (one step_<n> folder each and a `latest` pointer);
    must be visible to every rank (one node or a shared filesystem)."""
    checkpoint_every: int = 0
    """Save every this many optimizer steps (0: only at the end of the run and on
    SIGTERM/SIGINT); needs checkpoint_dir."""
    keep_checkpoints: int = 2
    """Keep the newest this many verified checkpoints; older ones are deleted after each
    save (never the one the run resumed from; see docs/reliability.md)."""
    async_checkpoint: bool = False
    """Save in the background: at a save the state is copied to host memory and training
    continues while a writer thread writes the files and commits (``latest`` is replaced
    only once every rank's files are complete); at most one save is in flight (the next
    save, and the end of the run, wait for it). See docs/checkpoints.md."""
    resume: str | None = None
    """'latest' (what checkpoint_dir's `latest` points to; an unreadable one falls back
    to the previous checkpoint with a warning), 'auto' (latest if any, else start fresh)
    or a checkpoint folder. `--resume` alone means 'latest'. A job restarted by
    torchrun's elastic agent resumes as 'auto' by itself."""
    init_from: str | None = None
    """Start from these weights (a consolidated .safetensors file or a checkpoint folder)
    under any layout; optimizer state, step and data order start fresh."""
    straggler_factor: float = 2.0
    """Report a rank whose compute time in a step (step time minus communication wait)
    exceeds the lower median over all ranks by this factor as a straggler; 0: off."""
    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (inductor; per block, as
    torchtitan does); collectives stay outside the graphs. See docs/compile.md."""
    loss_chunk: int = 4096
    """Tokens per chunk of the default cross-entropy (replicated and vocabulary-parallel
    head): the float32 logits exist one (loss_chunk, vocab) block at a time and the
    softmax is recomputed in backward; 0: ``F.cross_entropy`` on the whole micro-batch at
    tp = 1 (one chunk at tp > 1). See docs/gpu.md."""

    def __post_init__(self) -> None:
        check_choices(self, "train.")
        if self.loss_chunk < 0:
            raise ConfigError(f"train.loss_chunk must be >= 0 tokens, got {self.loss_chunk}.")
        check_positive(
            "train.",
            steps=self.steps,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            seq_len=self.seq_len,
            lr=self.lr,
            base_batch=self.base_batch,
            eval_batches=self.eval_batches,
        )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ConfigError("train.warmup_steps and train.eval_every must not be negative.")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("train.weight_decay and train.grad_clip must not be negative.")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {beta}.")
        if self.checkpoint_every < 0:
            raise ConfigError(
                f"train.checkpoint_every must not be negative, got {self.checkpoint_every}."
            )
        if self.keep_checkpoints < 1 or self.straggler_factor < 0 or 0 < self.straggler_factor <= 1:
            raise ConfigError(
                f"train.keep_checkpoints must be >= 1 (got {self.keep_checkpoints}) and "
                f"train.straggler_factor 0 (off) or > 1 (got {self.straggler_factor})."
            )
        needs_dir = self.checkpoint_every > 0 or self.resume in ("latest", "auto")
        if needs_dir and not self.checkpoint_dir:
            raise ConfigError(
                "train.checkpoint_every and train.resume = 'latest'/'auto' need "
                "train.checkpoint_dir (the folder checkpoints are written to / read from)."
            )
        if self.resume and self.init_from:
            raise ConfigError(
                "train.resume and train.init_from both set: resume continues a run (weights, "
                "optimizer, step), init_from starts a new one from weights; choose one."
            )

    def effective_lr(self) -> float:
        """Peak learning rate with the linear scaling rule applied when enabled."""
        if self.scale_lr:
            return self.lr * self.global_batch / self.base_batch
        return self.lr


@dataclass
class PrecisionConfig:
    """Mixed precision: parameter/compute dtype, gradient-reduction dtype, loss scaling."""

    dtype: DType = "fp32"
    """Dtype of the parameters and of the compute ('fp32', 'bf16', 'fp16'); with bf16 or
    fp16 the optimizer keeps fp32 master weights (sharded under ZeRO)."""
    reduce_dtype: ReduceDType = "auto"
    """Dtype gradients are reduced in across ranks ('auto': the parameter dtype)."""
    loss_scale: float = 65536.0
    """fp16 only: initial dynamic loss scale (2^16)."""
    loss_scale_window: int = 2000
    """fp16 only: double the loss scale after this many steps without overflow (K); an
    overflow halves it and skips the step."""
    nonfinite: NonFinite = "error"
    """A non-finite loss or gradient norm under fp32/bf16: 'error' stops the run with an
    error naming the step, 'skip' skips the step with a warning (weights, optimizer state
    and schedule untouched). fp16 overflows are always skipped by the loss scaler."""
    float8: bool = False
    """Compute the blocks' linear layers in float8 through torchao (not the output head;
    tensor-parallel layers too): CUDA with compute capability 8.9+ and the `float8` extra
    only, refused elsewhere. See docs/gpu.md."""

    def __post_init__(self) -> None:
        check_choices(self, "precision.")
        check_positive(
            "precision.", loss_scale=self.loss_scale, loss_scale_window=self.loss_scale_window
        )


@dataclass
class DataConfig:
    """Where the tokens come from."""

    source: str = "stdlib"
    """'stdlib' (the running interpreter's standard-library sources, always present),
    a text file, a folder of text files, a pre-tokenized .bin/.npy token file, a folder
    made by `plait data prepare`, or a mixture of such folders 'DIR_A:0.7,DIR_B:0.3'."""
    tokenizer: str = "byte"
    """'byte' (built in, 256 symbols), 'tiktoken:<encoding>' (needs tiktoken) or
    'hf:<path>' (a Hugging Face tokenizer.json, or a model folder holding one)."""
    token_dtype: TokenDType = "uint16"
    """Element type of a raw pre-tokenized .bin file."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of text (0: no limit)."""
    val_fraction: float = 0.05
    """Fraction of the tokens held out (at the end) for the validation loss; of a
    prepared folder (``plait data prepare``), the fraction of its documents held out
    (chosen by a hash of the document number)."""
    val: str | None = None
    """A prepared folder whose documents are the validation set (instead of the held-out
    documents of data.source, which then all train)."""
    prefetch: int = 2
    """Batches a background thread per rank reads ahead (pinned memory on CUDA); 0 reads
    each batch when its step starts."""
    mask_documents: bool = False
    """Block-causal attention within documents: a token attends only to earlier tokens
    of its own document, a new document starting after each end-of-document token (the
    tokenizer's: id 0, the NUL byte, for 'byte'; tiktoken's end-of-text token).
    Built-in model only (sdpa, blockwise, ring and all-to-all attention), not with
    parallel.pp > 1; rotary positions stay the window's. See docs/context-parallel.md."""

    def __post_init__(self) -> None:
        check_choices(self, "data.")
        if not self.source:
            raise ConfigError("data.source must not be empty.")
        if self.tokenizer != "byte" and not self.tokenizer.startswith(("tiktoken:", "hf:")):
            raise ConfigError(
                "data.tokenizer must be 'byte' or 'tiktoken:<encoding>' (or 'hf:<path>'), got "
                f"{self.tokenizer!r}."
            )
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch must not be negative, got {self.prefetch}.")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes must not be negative, got {self.max_bytes}.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}.")


@dataclass
class LogConfig:
    """What a run reports and where."""

    dir: str = "runs/last"
    """The run's output folder: `plait train` writes its metrics there
    (``metrics.jsonl``) and, when checkpointing is asked for without a folder, its
    checkpoints (``checkpoints/``); W&B offline runs and a local MLflow store go there too."""
    metrics: str | None = None
    """Write one JSON line of metrics per step to this path (`plait train` default:
    ``<log.dir>/metrics.jsonl``; the library's Trainer writes none unless set)."""
    tensorboard: str | None = None
    """Write TensorBoard event files (scalars per step) into this folder."""
    wandb: WandbMode = "off"
    """Weights & Biases: 'off', 'offline' (files under ``<log.dir>/wandb``, no network;
    upload later with `wandb sync`) or 'online' (needs the wandb package)."""
    project: str = "plait"
    """The W&B project and MLflow experiment the run is recorded under."""
    mlflow: str | None = None
    """MLflow tracking URI, or 'local' for a SQLite store ``<log.dir>/mlflow.db`` (no
    server, no network; needs the mlflow package)."""
    log_every: int = 10
    """Print a plain log line every this many steps (when no progress bar is shown)."""
    progress: Progress = "auto"
    """'bar' (live progress bar), 'lines' (plain log lines), 'none', or 'auto' (bar on a
    terminal, lines otherwise)."""
    peak_tflops: float | None = None
    """Peak dense FLOP/s per device (in TFLOP/s) for the MFU estimate (default: measured
    with a short matmul on CPU, the device's datasheet bf16 figure on CUDA)."""
    timeline: str | None = None
    """Pipeline runs (parallel.pp > 1): draw the last training step's measured timeline
    (ranks as rows, forward/backward/weight-gradient actions, bubble in the title) into
    this PNG file, the picture `plait pipeline draw` makes of a simulated schedule."""
    sample_every: int = 0
    """Every this many steps, rank 0 prints a short greedy continuation of
    ``log.sample_prompt`` by the model being trained (all ranks decode it; 0: never)."""
    sample_prompt: str = "def "
    """The text the ``log.sample_every`` samples continue."""
    sample_tokens: int = 32
    """Tokens each ``log.sample_every`` sample generates."""
    profile: str | None = None
    """'START-END': record a torch.profiler trace of optimizer steps START..END (1-based,
    inclusive) on every rank into ``<log.dir>/profile/rank<r>.json`` (Chrome/Perfetto
    JSON). See docs/gpu.md."""
    memory_snapshot: bool = False
    """CUDA only: record the allocator's history and write a memory snapshot per rank,
    ``<log.dir>/memory/rank<r>.pickle``, at the step of peak memory (refused on CPU)."""

    def __post_init__(self) -> None:
        check_choices(self, "log.")
        if self.profile is not None:
            parse_step_window(self.profile)
        check_positive("log.", log_every=self.log_every, peak_tflops=self.peak_tflops)
        check_positive("log.", sample_tokens=self.sample_tokens)
        if self.sample_every < 0:
            raise ConfigError(
                f"log.sample_every must be 0 (off) or positive, got {self.sample_every}."
            )
        if not self.sample_prompt:
            raise ConfigError("log.sample_prompt must not be empty.")
        if self.timeline is not None and not self.timeline.lower().endswith(".png"):
            raise ConfigError(f"log.timeline must name a .png file, got {self.timeline!r}.")
        if not self.dir:
            raise ConfigError("log.dir must name a folder (the run's output folder).")


@dataclass
class LaunchConfig:
    """How processes are started on this machine."""

    nproc: int = 2
    """Local processes to start (ignored under torchrun, which sets the world itself)."""
    device: Device = "auto"
    """'cpu', 'cuda' (one GPU per local rank) or 'auto' (cuda when available)."""
    threads: int | None = None
    """Intra-op CPU threads per process (default: cores / local processes)."""
    check_memory: bool = True
    """Before starting, ask the planner (plait.plan) for this layout's per-rank memory and
    refuse one predicted not to fit the device (GPU memory, or this host's RAM shared by
    its ranks); false starts anyway."""
    backend: LaunchBackend = "local"
    """Who starts the ranks: 'local' (plait's launcher on this machine, or the world of
    the torchrun that started this process), 'torchrun' (only as a rank of torchrun;
    refused otherwise) or 'ray' (each rank a Ray actor in a placement group; needs
    `pip install 'plait[ray]'`; alias --ray)."""
    ray_address: str | None = None
    """Ray cluster to join: 'auto' (the one running on this machine) or HOST:PORT; unset:
    start a private local Ray instance for this run (temporary files under
    /tmp/plait-ray-<id>, removed after a successful run)."""
    max_restarts: int = 0
    """launch.backend = 'ray': restart every rank after a rank dies or fails (a killed
    process, a crash, a hang cut by parallel.timeout_s), at most this many times; each
    restart resumes from the checkpoint that train.checkpoint_dir's `latest` names.
    (Under torchrun use its own --max-restarts.)"""
    host_memory_gb: float | None = None
    """Host memory (GiB) the ranks on this machine may use together, for naming a rank
    the kernel killed as out of memory when neither the memory cgroup nor /proc/meminfo
    tells the limit a scheduler enforces; unset: detected from those."""

    def __post_init__(self) -> None:
        check_choices(self, "launch.")
        check_positive(
            "launch.", nproc=self.nproc, threads=self.threads, host_memory_gb=self.host_memory_gb
        )
        if self.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts must not be negative, got {self.max_restarts}.")
        if self.ray_address is not None and self.backend != "ray":
            raise ConfigError(
                "launch.ray_address is set but launch.backend is not 'ray'; add --ray "
                "(--launch.backend ray) or leave the address out."
            )


@dataclass
class Config:
    """A whole run: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The built-in transformer's shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation and evaluation."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision and loss scaling."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus and tokenizer."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics and progress."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Local process start-up."""

    def validate(self, world_size: int) -> None:
        """Check the sections against each other for a world of ``world_size`` ranks.

        Raises :class:`ConfigError` with one paragraph saying what is wrong and what
        would work. Runs before any process starts and needs no torch; each rule is a
        function of :mod:`plait.config_checks`. A run also needs the parallel layer's
        checks (tensor-parallel divisibility, the pipeline schedule, the device's
        dtypes): :func:`plait.parallel.checks.validate_run` runs this and then those,
        once per process.
        """
        p, t, m = self.parallel, self.train, self.model
        dp = p.resolved_dp(world_size)
        check_world(dp, p.tp, p.pp, p.cp, world_size)
        if p.cp > 1:
            check_cp_sequence(t.seq_len, p.cp, p.cp_attention)
            if p.cp_attention == "ulysses":
                check_ulysses_heads(m.n_heads, p.tp, p.cp)
            if p.sequence_parallel:
                check_sp_under_cp(t.seq_len, p.cp, p.tp, p.cp_attention)
        if p.pp > 1:
            m_pp = self.pipeline_microbatches(world_size)
            check_pipeline(
                m.n_layers,
                p.pp,
                p.chunks,
                p.pipeline_schedule,
                m_pp,
                t.global_batch,
                dp,
                t.micro_batch,
            )
        # ZeRO shards over dp x cp (the ranks that hold the same parameters)
        check_shard_size(p.zero_shard_size, p.zero, dp * p.cp)
        check_offload(p.offload, p.zero)
        check_compression(p.compression, p.zero, self.precision.dtype, self.precision.reduce_dtype)
        check_batch(t.global_batch, dp, self.micro_batch(world_size))
        check_seq_len(t.seq_len, m.max_seq_len)
        check_tokenizer_vocab(self.data.tokenizer, m.vocab_size)
        check_expert_parallel(
            p.ep,
            dp,
            p.cp,
            m.moe_experts,
            p.zero,
            p.compression,
            p.pp,
            p.tp,
            self.precision.dtype,
            self.precision.reduce_dtype,
        )
        if self.log.sample_every:
            check_generation_layout(
                p.pp, p.cp, p.tp, p.sequence_parallel, m.family, m.factory, "log.sample_every"
            )
            prompt = len(self.log.sample_prompt.encode("utf-8"))
            check_sample_length(prompt, self.log.sample_tokens, m.max_seq_len)
        if self.data.mask_documents:
            check_document_mask(p.pp, m.family, m.factory)

    def micro_batch(self, world_size: int) -> int:
        """Per-rank micro-batch (sequences) with the default applied (pp > 1: the per-rank
        batch divided into the pipeline micro-batches)."""
        if self.train.micro_batch is not None:
            return self.train.micro_batch
        dp = self.parallel.resolved_dp(world_size)
        if self.parallel.pp > 1:
            return max(1, self.train.global_batch // dp // self.pipeline_microbatches(world_size))
        return max(1, self.train.global_batch // dp)

    def pipeline_microbatches(self, world_size: int) -> int:
        """Pipeline micro-batches per step and dp rank (see ``parallel.microbatches``)."""
        p = self.parallel
        if p.microbatches is not None:
            return p.microbatches
        if self.train.micro_batch is not None:
            dp = p.resolved_dp(world_size)
            return max(1, self.train.global_batch // (dp * self.train.micro_batch))
        return 2 * p.pp

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step: global_batch / (dp · micro_batch)."""
        dp = self.parallel.resolved_dp(world_size)
        return self.train.global_batch // (dp * self.micro_batch(world_size))
