"""ZeRO-Offload and ZeRO-Infinity in the planner: where the bytes live, what the step costs.

**Memory.** With ``offload = optimizer`` the fp32 masters and the optimizer state of a
rank's shards leave the device (:func:`device_state`); the host holds, per rank, what
the runtime (:mod:`plait.parallel.zero.offload`) allocates (:func:`offload_memory`):

* the fp32 master shards (a copy even when the weights are fp32): ``4·S``;
* the optimizer state of the non-padding elements plus the per-tensor scalars (as on
  the device without offload);
* the fp32 gradient landing buffers of the device-to-host copies: a ring of
  :data:`~plait.config.rules.features.OFFLOAD_RING_BUFFERS` buffers the size of the largest
  unit's shard, reused unit after unit (:func:`landing_bytes`; ``4·S``, one per unit,
  with the one-step-delayed update);
* ``offload = params`` (ZeRO-3): the parameter shards too, ``p·S``; the device keeps
  only the gathered units (the buffers the memory model already counts).

With CUDA the landing buffers, the masters and (``params``) the parameter shards are
page-locked (``pinned``). With ``offload_dir`` (the NVMe tier) Adam's m and v (and with
``params`` the masters) are files instead of host memory (``disk``; the step scalars
stay in memory). ``S`` is the rank's padded shard (:mod:`plait.plan.units`).

**Time** is :mod:`plait.plan.offload_time`'s (re-exported here): the eager path (each
unit's CPU step starts as soon as its gradients land, under backward) and the two-pass
path of a clipped or fp16-scaled step (the norm first, then per unit copy -> unscale/clip
-> step, the next unit's copy overlapping this one's step); ``params`` adds the
parameter shards' trips to the device per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.config import Config
from plait.config.rules.features import OFFLOAD_RING_BUFFERS, check_offload_dir
from plait.plan.layout import Layout, Precision
from plait.plan.modelspec import ModelSpec
from plait.plan.offload_time import DEFAULT_CPU_ADAM as DEFAULT_CPU_ADAM
from plait.plan.offload_time import HOST_LINKS as HOST_LINKS
from plait.plan.offload_time import cpu_adam_rate, host_link
from plait.plan.offload_time import offload_step_time as offload_step_time
from plait.plan.units import local_pieces, shard_numel, stage_units, zero_state_bytes

if TYPE_CHECKING:
    from plait.plan.estimate import Estimate


@dataclass(frozen=True)
class OffloadMemory:
    """Bytes of one rank by where they live."""

    device: float
    """Training state left on the device: weights (unless ``params``) and gradients."""
    host: float
    """Host memory: masters, optimizer state, gradient buffers (and parameter shards)."""
    pinned: float
    """The page-locked part of ``host`` (CUDA runs; 0 on the CPU)."""
    disk: float
    """The NVMe tier's files (``offload_dir``)."""


def device_state(
    weights: float, master: float, optimizer: float, offload: str
) -> tuple[float, float, float]:
    """``(weights, master, optimizer)`` bytes left on the device under ``offload``."""
    if offload == "none":
        return weights, master, optimizer
    return (0.0 if offload == "params" else weights), 0.0, 0.0


def offload_memory(
    spec: ModelSpec,
    layout: Layout,
    precision: Precision,
    stage: int = 0,
    shard_rank: int = 0,
    cuda: bool = True,
) -> OffloadMemory:
    """Where rank ``shard_rank`` of pipeline stage ``stage`` keeps its state (see the
    module docstring); all on the device without offload."""
    units = stage_units(spec, layout.tp, layout.pp, stage)
    f = layout.shard_factor
    z = max(layout.zero, 1)
    weights, grads, master, optimizer = zero_state_bytes(units, z, f, shard_rank % f, precision)
    if layout.offload == "none":
        return OffloadMemory(weights + grads + master + optimizer, 0.0, 0.0, 0.0)
    s = sum(shard_numel(u, f) for u in units)  # the padded shard elements
    valid = sum(local_pieces(u, f, shard_rank % f)[1] for u in units)
    scalars = optimizer - valid * precision.optimizer_bytes  # per-tensor scalars
    fp32 = 4 * s
    ring = landing_bytes([shard_numel(u, f) for u in units], layout.offload_delay)
    params = layout.offload == "params"
    shard_weights = s * precision.param_bytes if params else 0.0
    if layout.offload_nvme:
        # the runtime's files hold m and v for the whole padded shard
        disk = s * precision.optimizer_bytes + (fp32 if params else 0.0)
        host = scalars + ring + (0.0 if params else fp32) + shard_weights
    else:
        disk = 0.0
        host = optimizer + fp32 + ring + shard_weights
    pinned = (
        (ring + (0.0 if layout.offload_nvme and params else fp32) + shard_weights) if cuda else 0.0
    )
    device = grads + (0.0 if params else weights)
    return OffloadMemory(float(device), float(host), float(pinned), float(disk))


def landing_bytes(shard_numels: list[int], delay: bool) -> int:
    """Bytes of the fp32 gradient landing buffers of a rank whose units' shards have
    ``shard_numels`` elements: a ring of
    :data:`~plait.config.rules.features.OFFLOAD_RING_BUFFERS` buffers of the largest
    shard (fewer with fewer units); with the one-step-delayed update (``delay``) one
    buffer per unit (the gradients outlive the next backward)."""
    if delay:
        return 4 * sum(shard_numels)
    return 4 * min(OFFLOAD_RING_BUFFERS, len(shard_numels)) * max(shard_numels, default=0)


def nvme_bytes(spec: ModelSpec, layout: Layout, precision: Precision) -> float:
    """The NVMe tier's bytes on the worst rank (what ``offload_dir`` must hold per rank)."""
    worst = 0.0
    for stage in sorted({0, layout.pp - 1}):
        worst = max(worst, offload_memory(spec, layout, precision, stage).disk)
    return worst


def _kinds_for(zero: int, kinds: tuple[str, ...]) -> list[str]:
    """The offload kinds a ZeRO stage can use (``params`` needs stage 3)."""
    return [k for k in kinds if k != "none" and (k != "params" or zero == 3)]


def offload_layouts(base: Layout, group: list[Layout], kinds: tuple[str, ...]) -> list[Layout]:
    """The offloaded variants ``plait plan --search --offload`` adds to a search group:
    each ZeRO layout of ``group`` with every kind of ``kinds``; a group without ZeRO on
    one data-parallel rank (one device: nothing to shard, yet offload pays) gets ZeRO
    1-3 of ``base`` with offload."""
    from dataclasses import replace

    zeroed = [x for x in group if x.zero >= 1]
    if not zeroed and base.dp == 1 and base.pp == 1:
        zeroed = [replace(base, zero=z) for z in (1, 2, 3)]
    return [replace(x, offload=k) for x in zeroed for k in _kinds_for(x.zero, kinds)]  # type: ignore[arg-type]


def offload_count(variants: dict[int, int], dp: int, pp: int, kinds: tuple[str, ...]) -> int:
    """How many layouts :func:`offload_layouts` adds, from the group's variants per ZeRO
    stage (``{stage: count}``), without building them."""
    if any(z >= 1 for z in variants):
        return sum(n * len(_kinds_for(z, kinds)) for z, n in variants.items() if z >= 1)
    if dp == 1 and pp == 1:
        return sum(len(_kinds_for(z, kinds)) for z in (1, 2, 3))
    return 0


def format_offload(e: Estimate) -> str:
    """Where the offloaded layout keeps its bytes, per rank, and the host step's cost."""
    from plait.plan.explain import gib

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
    from plait.plan.fit import plan_inputs

    folder = cfg.parallel.offload_dir
    if folder is None:
        return
    spec, layout, precision, _ = plan_inputs(cfg, world_size)
    need = nvme_bytes(spec, layout, precision) * min(ranks_per_host, world_size)
    check_offload_dir(folder, int(need))


def host_bytes(spec: ModelSpec, layout: Layout, precision: Precision) -> float:
    """Host bytes of the worst rank under offload (:func:`offload_memory`'s ``host``;
    the first and last pipeline stage, the first and last shard rank)."""
    f = layout.shard_factor
    return max(
        offload_memory(spec, layout, precision, stage, shard_rank).host
        for stage in sorted({0, layout.pp - 1})
        for shard_rank in sorted({0, f - 1})
    )


def refuse_host_overflow(
    cfg: Config, world_size: int, ranks_per_host: int, limit: tuple[int, str]
) -> None:
    """What ``plait train`` runs before starting with offload: refuse
    (:class:`~plait.errors.ConfigError`, exit code 2) when the host's ranks would hold
    more offloaded bytes (the worst rank's :func:`host_bytes` times the ranks per host)
    than ``limit`` (``(bytes, where from)``: :func:`plait.launch.oom.host_memory_limit`)."""
    from plait.errors import ConfigError
    from plait.plan.fit import plan_inputs

    def gib(n: float) -> str:
        return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"

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
        f"parallel.offload={layout.offload}: the host needs {gib(per_rank * ranks)} "
        f"({ranks} rank(s) x {gib(per_rank)}: fp32 masters, optimizer state, landing buffers) "
        f"but has {gib(have)} ({source}); {tier}use more hosts, or set "
        "launch.check_memory=false."
    )
