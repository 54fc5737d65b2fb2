"""The log section (``[log]``): what a run reports and where."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import Progress, WandbMode, check_choices
from plait.config.rules.choices import check_positive
from plait.config.rules.features import parse_step_window
from plait.errors import ConfigError


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
