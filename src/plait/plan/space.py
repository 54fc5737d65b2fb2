"""The layouts a search walks: the space of choices, the candidates, why others are out.

:func:`candidates` enumerates every dp·tp·pp·cp = devices, micro-batch size, pipeline
schedule (and v), sequence parallelism, recomputation, ZeRO stage and hybrid factor F
(and, for a mixture-of-experts model, every expert-parallel degree ep), in groups that
differ only in ZeRO stage and F; :func:`mesh_problem` says why degrees cannot work
(topology or divisibility) and :class:`Rejections` keeps the reasons;
:func:`count_layouts` counts the space without building it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from plait.config import PP_GRAD_REDUCES, RECOMPUTES, ZERO_STAGES, PlannedSchedule, Recompute
from plait.plan.layout import Layout
from plait.plan.moe_estimate import ep_choices
from plait.plan.offload import offload_count, offload_layouts
from plait.plan.query import Query


@dataclass(frozen=True)
class Space:
    """Which values each layout dimension may take (None: every divisor)."""

    tp: tuple[int, ...] | None = None
    """Tensor-parallel degrees."""
    pp: tuple[int, ...] | None = None
    """Pipeline degrees."""
    cp: tuple[int, ...] | None = None
    """Context-parallel degrees."""
    zero: tuple[int, ...] = ZERO_STAGES
    """ZeRO stages."""
    hybrid: bool = True
    """Try hybrid sharding factors F between 1 and dp (node-sized and smaller)."""
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes."""
    recompute: tuple[Recompute, ...] = RECOMPUTES
    """Recomputation policies."""
    chunks: tuple[int, ...] = (2, 4)
    """v values tried for the interleaved schedule."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence parallelism off/on (on only with tp > 1)."""
    offload: tuple[str, ...] = ("none",)
    """ZeRO-Offload kinds tried besides none (``plait plan --search --offload``)."""
    activation_offload: bool = True
    """Try activation offloading (every block's saved activations on the host) for a
    layout that does not fit without it (on a layout that fits it only adds copy time)."""


@dataclass
class Rejections:
    """Rejected candidates by reason, with a few examples each."""

    counts: dict[str, int] = field(default_factory=dict)
    """Candidates rejected per reason kind."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    """Up to three messages per reason kind."""

    def add(self, kind: str, message: str, count: int = 1) -> None:
        """Record ``count`` candidates rejected for ``kind``."""
        self.counts[kind] = self.counts.get(kind, 0) + count
        ex = self.examples.setdefault(kind, [])
        if len(ex) < 3:
            ex.append(message)


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(divisors_of(n))


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order (cached)."""
    return list(_divisors(n))


def divisors_of(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order (trial division up to sqrt(n):
    microseconds even for a billion devices)."""
    small: list[int] = []
    large: list[int] = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def mesh_problem(q: Query, tp: int, pp: int, cp: int) -> tuple[str, str] | None:
    """Why degrees (tp, pp, cp) cannot work, as ``(kind, message)``, or None."""
    s, g = q.model, q.hardware.devices_per_node
    if tp > g:
        return "topology", (
            f"tp={tp} exceeds a node of {g} devices: tensor-parallel all-reduces sit on the "
            "critical path of every block and would cross the inter-node link"
        )
    if q.devices > g and g % tp:
        return "topology", f"tp={tp} does not divide the node size {g}: groups would straddle nodes"
    if s.n_heads % tp or s.ffn_hidden % tp:
        return "divisibility", (
            f"tp={tp} does not divide the {s.n_heads} heads and MLP width {s.ffn_hidden}"
        )
    if s.n_kv_heads % tp and tp % s.n_kv_heads:
        return "divisibility", f"tp={tp} and the {s.n_kv_heads} key/value heads do not divide"
    if cp > 1 and q.seq_len % (2 * cp):
        return "divisibility", (
            f"sequence {q.seq_len} is not divisible by 2·cp={2 * cp} (load-balanced ring attention)"
        )
    if pp > s.n_layers:
        return "divisibility", f"pp={pp} exceeds the {s.n_layers} layers"
    dp = q.devices // (tp * pp * cp)
    if q.global_batch % dp:
        return "divisibility", f"global batch {q.global_batch} is not divisible by dp={dp}"
    return None


def _schedules(
    q: Query, space: Space, pp: int, m: int
) -> Iterator[tuple[PlannedSchedule, int, str]]:
    """(schedule, v, problem) for a pipeline of ``pp`` stages and ``m`` micro-batches."""
    if pp == 1:
        yield "1f1b", 1, ""
        return
    yield "1f1b", 1, ""
    yield "gpipe", 1, ""
    for v in space.chunks:
        bad = ""
        if q.model.n_layers % (pp * v):
            bad = f"interleaved v={v}: {q.model.n_layers} layers not divisible by pp·v={pp * v}"
        elif m % pp:
            bad = f"interleaved: {m} micro-batches not a multiple of pp={pp}"
        yield "interleaved", v, bad


def _shard_factors(q: Query, space: Space, dp: int, zero: int) -> list[int | None]:
    if zero == 0:
        return [None]
    out: list[int | None] = [None]
    if space.hybrid:
        g = q.hardware.devices_per_node
        out += [f for f in range(2, min(dp - 1, g) + 1) if dp % f == 0]  # 1 < F < dp, F <= g
    return out


def _pp_zero_choices(pp: int, v: int, zero: int) -> list[tuple[str, bool]]:
    """``(pp_grad_reduce, pp_reshard)`` worth trying: ZeRO-2/3 under pp
    reduce once per step or per micro-batch; ZeRO-3 with several chunks per rank may
    also re-gather per action (with one piece per rank it changes nothing)."""
    if pp == 1 or zero < 2:
        return [("step", False)]
    reshard = [False, True] if zero == 3 and v > 1 else [False]
    return [(g, r) for g in PP_GRAD_REDUCES for r in reshard]


def candidates(q: Query, space: Space, rej: Rejections) -> Iterator[list[Layout]]:
    """Groups of valid layouts that differ only in ZeRO stage and F."""
    n = q.devices
    pick = lambda opt, full: [d for d in full if opt is None or d in opt]  # noqa: E731
    for tp in pick(space.tp, divisors(n)):
        for pp in pick(space.pp, divisors(n // tp)):
            for cp in pick(space.cp, divisors(n // (tp * pp))):
                dp = n // (tp * pp * cp)
                problem = mesh_problem(q, tp, pp, cp)
                label = f"dp{dp} tp{tp} pp{pp} cp{cp}"
                if problem:
                    rej.add(problem[0], f"{label}: {problem[1]}")
                    continue
                per_replica = q.global_batch // dp
                for mb in space.micro_batch:
                    if per_replica % mb:
                        continue
                    m = per_replica // mb
                    for sched, v, bad in _schedules(q, space, pp, m):
                        if bad:
                            rej.add("divisibility", f"{label}: {bad}")
                            continue
                        sps = [x for x in space.sequence_parallel if tp > 1 or not x]
                        zeros = sorted((z for z in space.zero if dp > 1 or z == 0), reverse=True)
                        for sp, rc in itertools.product(sps, space.recompute):
                            base = Layout(dp, tp, pp, cp, 0, None, mb, m, rc, sched, v, sp)
                            group = [
                                replace(
                                    base,
                                    zero=z,
                                    zero_shard_size=f,
                                    pp_grad_reduce=g,  # type: ignore[arg-type]
                                    pp_reshard=r,
                                )
                                for z in zeros
                                for f in _shard_factors(q, space, dp, z)
                                for g, r in _pp_zero_choices(pp, v, z)
                            ]
                            group += offload_layouts(base, group, space.offload)
                            if group and q.moe is not None:  # one group per ep
                                for ep in ep_choices(q.moe, base):
                                    yield [replace(lay, ep=ep) for lay in group]
                            elif group:
                                yield group


def count_layouts(q: Query, space: Space) -> int:
    """How many layouts :func:`candidates` would yield, counted without building them
    (milliseconds: only the few thousand (tp, pp, cp) triples are walked)."""
    n, total = q.devices, 0
    pick = lambda opt, full: [d for d in full if opt is None or d in opt]  # noqa: E731
    for tp in pick(space.tp, divisors(n)):
        for pp in pick(space.pp, divisors(n // tp)):
            for cp in pick(space.cp, divisors(n // (tp * pp))):
                if mesh_problem(q, tp, pp, cp):
                    continue
                dp = n // (tp * pp * cp)
                per_replica = q.global_batch // dp
                zeros = [z for z in space.zero if dp > 1 or z == 0]
                sps = len([x for x in space.sequence_parallel if tp > 1 or not x])
                for mb in space.micro_batch:
                    if per_replica % mb:
                        continue
                    for _, v, bad in _schedules(q, space, pp, per_replica // mb):
                        if bad:
                            continue
                        variants = sum(
                            len(_shard_factors(q, space, dp, z)) * len(_pp_zero_choices(pp, v, z))
                            for z in zeros
                        )
                        per = {  # offloaded variants, per ZeRO stage
                            z: len(_shard_factors(q, space, dp, z))
                            * len(_pp_zero_choices(pp, v, z))
                            for z in zeros
                        }
                        variants += offload_count(per, dp, pp, space.offload)
                        eps = len(ep_choices(q.moe, Layout(dp=dp, cp=cp))) if q.moe else 1
                        total += sps * len(space.recompute) * variants * eps
    return total
