"""Layout search: enumerate, reject with reasons, rank by predicted step time, explain.

Given a model, a cluster and a global batch, :func:`search` walks every combination of
dp·tp·pp·cp = devices, micro-batch size, pipeline schedule (and v), sequence
parallelism, recomputation, ZeRO stage and hybrid factor F. A layout is rejected

* for **topology** when tensor parallelism would leave a node (its all-reduces are on
  the critical path of every block) or would straddle node boundaries;
* for **divisibility** when heads, key/value heads or the MLP width are not divisible
  by tp, the sequence by 2·cp (load-balanced causal ring attention), the global batch
  by dp·micro-batch, the layers by pp (or pp·v interleaved, whose micro-batch count must
  also be a multiple of pp);
* for **memory** when the worst rank does not fit the usable device memory.

For a mixture-of-experts model (``Query.moe``) every layout is also tried at each
expert-parallel degree ep that divides dp·cp and the expert count, with the MoE model's
memory and time (:mod:`plait.plan.moe_estimate`: experts per rank E/ep, their ZeRO
shards over dp·cp/ep ranks, the all-to-alls), each ep its own group for the pruning.

The survivors are ranked by predicted step time (ties: less memory). The walk prunes
with a sound bound: the part of the step time no ZeRO choice changes (compute, tensor/
context/pipeline traffic, bubble): once a group's fixed part cannot beat the k-th best
found so far, its remaining ZeRO variants are skipped.
:func:`brute_force` evaluates the same space without pruning, for tests.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from plait.config import PP_GRAD_REDUCES, RECOMPUTES, ZERO_STAGES, PlannedSchedule, Recompute
from plait.config.rules.layout import check_world
from plait.errors import ConfigError
from plait.plan.estimate import Estimate, estimate
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout, Precision, Runtime
from plait.plan.memory import MemoryBreakdown, memory_per_rank
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.moe_estimate import ep_choices, moe_estimate, moe_memory
from plait.plan.offload import offload_count, offload_layouts

MAX_DEVICES = 1 << 24
"""Most devices a search plans for (16,777,216; bounds the layouts it walks)."""
MAX_EVALUATIONS = 150_000
"""Most layouts a search walks; a larger space (counted first, :func:`count_layouts`) is
refused at once with a message, which bounds the search's time."""


@dataclass(frozen=True)
class Query:
    """What to plan for."""

    model: ModelSpec
    """The model."""
    hardware: Hardware
    """The device kind."""
    devices: int
    """Devices in the job."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    precision: Precision
    """Precision policy."""
    runtime: Runtime
    """Runtime traits."""
    headroom: float = 0.05
    """Fraction of device memory kept free."""
    moe: MoESpec | None = None
    """The mixture-of-experts part of the model (None: dense): the search then also tries
    every expert-parallel degree ep that divides dp·cp and the experts."""

    def __post_init__(self) -> None:
        for key in ("devices", "global_batch", "seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}.")
        if self.devices > MAX_DEVICES:
            raise ConfigError(
                f"devices {self.devices:,} is more than the planner searches ({MAX_DEVICES:,}); "
                "plan a slice of the cluster (the per-rank figures do not change with dp)."
            )
        if not 0.0 <= self.headroom < 1.0:
            raise ConfigError(f"headroom must be in [0, 1), got {self.headroom}.")


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


def _fixed_part(e: Estimate) -> float:
    """Step time no ZeRO stage or F changes (a lower bound for the whole group)."""
    t = e.time
    return t.compute + t.recompute + t.tp_comm + t.cp_comm + t.pp_comm + t.bubble


def _key(e: Estimate) -> tuple[float, float]:
    return (e.time.total, e.memory.total)


@dataclass
class SearchResult:
    """The ranked layouts, what was rejected and why, and the explanation."""

    query: Query
    """What was asked."""
    ranked: list[Estimate]
    """The best layouts, fastest first (at most ``top``)."""
    evaluated: int
    """Layouts whose memory and time were computed."""
    rejections: Rejections
    """Rejected candidates by reason."""
    explanation: str = ""
    """One paragraph on why the first layout wins."""


def search(q: Query, space: Space | None = None, top: int = 5) -> SearchResult:
    """The ``top`` fastest layouts that fit, with rejections and an explanation."""
    from plait.plan.explain import explain

    if top <= 0:
        raise ConfigError(f"top must be positive, got {top}.")
    space = space or Space()
    rej = Rejections()
    best: list[Estimate] = []
    evaluated = 0
    size = count_layouts(q, space)
    if size > MAX_EVALUATIONS:
        raise ConfigError(
            f"the layout search space has {size:,} layouts, more than the {MAX_EVALUATIONS:,} "
            f"a search walks; narrow it: fewer devices than {q.devices:,}, or a global batch "
            f"with fewer divisors than {q.global_batch:,}."
        )
    for group in candidates(q, space, rej):
        fixed: float | None = None  # the group's step time that ZeRO does not change
        for layout in group:
            mem = layout_memory(q, layout)
            usable = q.hardware.memory_bytes * (1 - q.headroom)
            if mem.total > usable:
                rej.add(
                    "memory",
                    f"{layout.describe()}: {mem.total / 2**30:.1f} GiB per rank > "
                    f"{usable / 2**30:.1f} GiB usable",
                )
                continue
            if fixed is not None and len(best) >= top and fixed >= best[-1].time.total:
                continue  # cannot enter the top k whatever its ZeRO traffic
            e = layout_estimate(q, layout)
            evaluated += 1
            fixed = _fixed_part(e)
            best.append(e)
            best.sort(key=_key)
            del best[top:]
    result = SearchResult(q, best, evaluated, rej)
    result.explanation = explain(result)
    return result


def brute_force(q: Query, space: Space | None = None) -> list[Estimate]:
    """Every valid layout of ``space`` that fits, evaluated without pruning, fastest first."""
    space = space or Space()
    out = []
    for group in candidates(q, space, Rejections()):
        for layout in group:
            e = layout_estimate(q, layout)
            if e.fits:
                out.append(e)
    out.sort(key=_key)
    return out


def with_layout(q: Query, layout: Layout) -> Estimate:
    """The estimate of one layout for ``q`` (after the same validity checks as the search)."""
    check_world(layout.dp, layout.tp, layout.pp, layout.cp, q.devices, devices=True)
    if layout.global_batch != q.global_batch:
        raise ConfigError(
            f"dp x micro-batch x micro-batches = {layout.dp} x {layout.micro_batch} x "
            f"{layout.microbatches} = {layout.global_batch} is not the global batch "
            f"{q.global_batch}."
        )
    problem = mesh_problem(q, layout.tp, layout.pp, layout.cp)
    if problem and problem[0] == "divisibility":
        raise ConfigError(f"layout {layout.describe()}: {problem[1]}.")
    if q.moe is not None and q.moe.experts % layout.ep:
        raise ConfigError(f"ep={layout.ep} does not divide the {q.moe.experts} experts.")
    return layout_estimate(q, layout)


def layout_memory(q: Query, layout: Layout) -> MemoryBreakdown:
    """The worst rank's memory of ``layout`` for ``q`` (the MoE model's when ``q.moe``)."""
    if q.moe is not None:
        return moe_memory(q.model, q.moe, layout, q.precision, q.runtime, q.seq_len)
    return memory_per_rank(q.model, layout, q.precision, q.runtime, q.seq_len)


def layout_estimate(q: Query, layout: Layout) -> Estimate:
    """The estimate of ``layout`` for ``q`` (the MoE model's when ``q.moe``)."""
    args = (layout, q.hardware, q.precision, q.runtime, q.seq_len, q.headroom)
    if q.moe is not None:
        return moe_estimate(q.model, q.moe, *args)
    return estimate(q.model, *args)


def simplest(q: Query) -> Layout:
    """Plain data parallelism over every device, one micro-batch per replica and step."""
    dp = q.devices
    per = max(1, q.global_batch // dp)
    return replace(Layout(dp=dp), micro_batch=per)
