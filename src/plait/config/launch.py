"""The launch section (``[launch]``): how processes are started on this machine."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import Device, LaunchBackend, check_choices
from plait.config.rules.choices import check_positive
from plait.errors import ConfigError


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
