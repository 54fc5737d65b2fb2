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

**Time** is :mod:`plait.plan.offload_time`'s: the eager path (each
unit's CPU step starts as soon as its gradients land, under backward) and the two-pass
path of a clipped or fp16-scaled step (the norm first, then per unit copy -> unscale/clip
-> step, the next unit's copy overlapping this one's step); ``params`` adds the
parameter shards' trips to the device per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.config.rules.features import OFFLOAD_RING_BUFFERS
from plait.plan.layout import Layout, Precision
from plait.plan.modelspec import ModelSpec
from plait.plan.units import local_pieces, shard_numel, stage_units, zero_state_bytes


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


def host_bytes(spec: ModelSpec, layout: Layout, precision: Precision) -> float:
    """Host bytes of the worst rank under offload (:func:`offload_memory`'s ``host``;
    the first and last pipeline stage, the first and last shard rank)."""
    f = layout.shard_factor
    return max(
        offload_memory(spec, layout, precision, stage, shard_rank).host
        for stage in sorted({0, layout.pp - 1})
        for shard_rank in sorted({0, f - 1})
    )
