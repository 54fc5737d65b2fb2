"""The launch section (``[launch]``): how processes are started on this machine."""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.choices import Device, LaunchBackend, check_choices
from plait.config.rules.choices import check_positive
from plait.config.rules.elastic import check_min_ranks, check_start_ranks, parse_layout_name
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
    min_ranks: int | None = None
    """Elastic run (`--nproc MIN:MAX` sets it to MIN and launch.nproc to MAX): when ranks
    die beyond the restart budget the job goes on with the survivors, replanned (the
    largest world >= MIN whose allowed layout divides train.global_batch; gradient
    accumulation keeps the global batch); unset: a lost rank ends the run."""
    start_ranks: int | None = None
    """Elastic run: ranks to start with (between launch.min_ranks and launch.nproc;
    default launch.nproc). The job grows to launch.nproc at the next step boundary after
    SIGUSR1 tells plait's launcher the ranks are back (it saves a checkpoint there and
    restarts on the larger layout; needs train.checkpoint_dir)."""
    layouts: tuple[str, ...] = ()
    """Elastic run: the layouts the job may take, e.g. 'tp2xdp2,dp3,dp2' (each one's
    world is the product of its degrees; axes dp, tp, pp, cp); empty: the starting
    layout's tp, pp and cp with any dp. See docs/reliability.md."""
    mtbf_hours: float = 24.0
    """Expected hours between failures of the whole job, for train.checkpoint_every =
    'auto' (Young's interval sqrt(2 C M))."""
    host_memory_gb: float | None = None
    """Host memory (GiB) the ranks on this machine may use together, for naming a rank
    the kernel killed as out of memory when neither the memory cgroup nor /proc/meminfo
    tells the limit a scheduler enforces; unset: detected from those."""

    def __post_init__(self) -> None:
        check_choices(self, "launch.")
        check_positive(
            "launch.",
            nproc=self.nproc,
            threads=self.threads,
            host_memory_gb=self.host_memory_gb,
            mtbf_hours=self.mtbf_hours,
        )
        check_min_ranks(self.min_ranks, self.nproc)
        check_start_ranks(self.start_ranks, self.min_ranks, self.nproc)
        for name in self.layouts:
            parse_layout_name(name)
        if self.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts must not be negative, got {self.max_restarts}.")
        if self.ray_address is not None and self.backend != "ray":
            raise ConfigError(
                "launch.ray_address is set but launch.backend is not 'ray'; add --ray "
                "(--launch.backend ray) or leave the address out."
            )
