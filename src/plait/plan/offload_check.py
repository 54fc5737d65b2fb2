"""ZeRO-Offload before a run and in the report: what ``plait train`` refuses before
starting (a host without room for the offloaded bytes, an NVMe folder too small), and
the lines ``plait plan`` prints for an offloaded layout. The bytes are
:mod:`plait.plan.offload`'s, the time :mod:`plait.plan.offload_time`'s."""

from __future__ import annotations

from plait.config import Config
from plait.config.rules.features import check_offload_dir
from plait.errors import ConfigError
from plait.plan.estimate import Estimate
from plait.plan.fit import plan_inputs
from plait.plan.offload import host_bytes, nvme_bytes, offload_memory
from plait.plan.offload_time import cpu_adam_rate, host_link
from plait.plan.text import gib, gib_or_mib


def format_offload(e: Estimate) -> str:
    """Where the offloaded layout keeps its bytes, per rank, and the host step's cost."""
    m = offload_memory(e.model, e.layout, e.precision, e.memory.stage)
    t = e.time.optimizer
    if e.layout.pp > 1:
        path = "pp: every stage after the schedule"
    elif e.layout.offload_two_pass:
        path = "two-pass: after the norm (clipping, fp16)"
    else:
        path = "eager: under backward"
    return "\n".join(
        [
            f"offload ({e.layout.offload}{', NVMe tier' if e.layout.offload_nvme else ''}) "
            "per rank:",
            f"  device state {gib(m.device)}, host {gib(m.host)} (pinned {gib(m.pinned)}), "
            f"disk {gib(m.disk)}",
            f"  host AdamW {cpu_adam_rate(e.hardware) / 1e9:.2f} G params/s, host link "
            f"{host_link(e.hardware) / 1e9:.0f} GB/s; exposed step cost {t:.3f} s ({path})",
        ]
    )


def refuse_bad_offload_dir(cfg: Config, world_size: int, ranks_per_host: int) -> None:
    """What ``plait train`` runs before starting with ``parallel.offload_dir``: refuse
    (:class:`~plait.errors.ConfigError`, exit code 2) a folder that is not writable or
    has less free space than the files of the host's ranks need (the worst rank's
    :func:`nvme_bytes` times the ranks per host)."""
    folder = cfg.parallel.offload_dir
    if folder is None:
        return
    spec, layout, precision, _ = plan_inputs(cfg, world_size)
    need = nvme_bytes(spec, layout, precision) * min(ranks_per_host, world_size)
    check_offload_dir(folder, int(need))


def refuse_host_overflow(
    cfg: Config, world_size: int, ranks_per_host: int, limit: tuple[int, str]
) -> None:
    """What ``plait train`` runs before starting with offload: refuse
    (:class:`~plait.errors.ConfigError`, exit code 2) when the host's ranks would hold
    more offloaded bytes (the worst rank's :func:`host_bytes` times the ranks per host)
    than ``limit`` (``(bytes, where from)``: :func:`plait.launch.oom.host_memory_limit`)."""
    if cfg.parallel.offload == "none":
        return
    spec, layout, precision, _ = plan_inputs(cfg, world_size)
    ranks = min(ranks_per_host, world_size)
    per_rank = host_bytes(spec, layout, precision)
    have, source = limit
    if have <= 0 or per_rank * ranks <= have:
        return
    tier = "" if layout.offload_nvme else "set parallel.offload_dir (the NVMe tier), "
    raise ConfigError(
        f"parallel.offload={layout.offload}: the host needs {gib_or_mib(per_rank * ranks)} "
        f"({ranks} rank(s) x {gib_or_mib(per_rank)}: fp32 masters, optimizer state, landing "
        "buffers) "
        f"but has {gib_or_mib(have)} ({source}); {tier}use more hosts, or set "
        "launch.check_memory=false."
    )
