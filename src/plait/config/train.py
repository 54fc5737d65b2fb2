"""The train section (``[train]``): batch, schedule, optimizer, evaluation and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import (
    Auto,
    LrDecayShape,
    LrSchedule,
    OptimizerName,
    Recompute,
    check_choices,
)
from plait.config.rules.activation_offload import check_offload_blocks
from plait.config.rules.choices import check_positive
from plait.config.rules.elastic import check_interval
from plait.config.rules.schedule import check_lr_schedule
from plait.errors import ConfigError


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
    """The schedule decays to lr · min_lr_ratio (cosine, linear, wsd)."""
    warmup_steps: int = 20
    """Linear warm-up steps before the schedule's decay."""
    lr_schedule: LrSchedule = "cosine"
    """After warm-up: 'cosine' or 'linear' decay to lr · min_lr_ratio at the last step,
    'constant' (the peak), or 'wsd' (warm-up, stable at the peak, then decay over the
    last train.lr_decay_fraction of the steps; see docs/training.md)."""
    lr_decay_fraction: float = 0.2
    """wsd: the fraction of train.steps spent decaying, at the end of the run (0, 1]."""
    lr_decay_shape: LrDecayShape = "1-sqrt"
    """wsd: the decay's shape, 'linear', 'cosine' or '1-sqrt' (1 - sqrt(progress))."""
    scale_lr: bool = False
    """Linear scaling rule: multiply lr by global_batch / base_batch (reported at start)."""
    base_batch: int = 16
    """Reference global batch for the linear scaling rule."""
    optimizer: OptimizerName = "adamw"
    """'adamw'; 'muon' (Muon on the 2-D hidden matrices, AdamW at train.lr on the
    embeddings, output head, norms and biases; keys optim.muon_*); 'adafactor'
    (torch.optim.Adafactor on every parameter, at train.lr). See docs/optimizers.md."""
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
    """Global batches averaged for one validation loss (a validation set smaller than one
    global batch is evaluated whole instead)."""
    recompute: Recompute = "none"
    """Activation recomputation: 'none', 'selective' (recompute only the attention core
    of each block in backward), 'full' (recompute each whole block)."""
    activation_offload: bool = False
    """Move what each transformer block saves for backward to host memory during forward
    (page-locked, copied on a side stream on CUDA) and back before the block's backward,
    overlapped with compute; composes with recompute, every parallelism and compile. See
    docs/training.md."""
    activation_offload_blocks: int = 0
    """With activation_offload: offload only the first N blocks of each rank's model (of
    its pipeline stage); 0: every block."""
    checkpoint_dir: str | None = None
    """Folder of sharded checkpoints (one step_<n> folder each and a `latest` pointer);
    must be visible to every rank (one node or a shared filesystem)."""
    checkpoint_every: int | Auto = 0
    """Save every this many optimizer steps (0: only at the end of the run and on
    SIGTERM/SIGINT); needs checkpoint_dir. 'auto': Young's interval sqrt(2 C M) from the
    measured cost C of a save and launch.mtbf_hours M (docs/reliability.md)."""
    memory_checkpoint_every: int | Auto = 0
    """Every this many steps each rank copies its checkpoint pieces into its own and a
    buddy rank's host memory (another node's when there is one; counted by plait.comm),
    so that a job that loses ranks resumes from memory instead of disk (0: off; 'auto':
    Young's interval from the measured cost of a copy; needs two ranks or more)."""
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
        check_lr_schedule(self.lr_schedule, self.steps, self.warmup_steps, self.lr_decay_fraction)
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("train.weight_decay and train.grad_clip must not be negative.")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {beta}.")
        check_offload_blocks(self.activation_offload, self.activation_offload_blocks)
        check_interval("train.checkpoint_every", self.checkpoint_every)
        check_interval("train.memory_checkpoint_every", self.memory_checkpoint_every)
        if self.keep_checkpoints < 1 or self.straggler_factor < 0 or 0 < self.straggler_factor <= 1:
            raise ConfigError(
                f"train.keep_checkpoints must be >= 1 (got {self.keep_checkpoints}) and "
                f"train.straggler_factor 0 (off) or > 1 (got {self.straggler_factor})."
            )
        needs_dir = self.checkpoint_every != 0 or self.resume in ("latest", "auto")
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
