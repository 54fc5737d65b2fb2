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
* for **memory** when the worst rank does not fit the usable device memory, even with
  activation offloading (``Space.activation_offload``: a layout that does not fit is
  tried again with every block's saved activations on the host; one that fits is not,
  since offloading only adds copy time).

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

from dataclasses import dataclass, replace

from plait.config.rules.layout import check_world
from plait.errors import ConfigError
from plait.plan.estimate import Estimate
from plait.plan.evaluate import layout_estimate, layout_memory
from plait.plan.explain import explain
from plait.plan.layout import Layout
from plait.plan.query import Query
from plait.plan.space import Rejections, Space, candidates, count_layouts, mesh_problem
from plait.plan.text import gib

MAX_EVALUATIONS = 150_000
"""Most layouts a search walks; a larger space (counted first, :func:`count_layouts`) is
refused at once with a message, which bounds the search's time."""


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
    usable = q.hardware.memory_bytes * (1 - q.headroom)
    for group in candidates(q, space, rej):
        fixed: float | None = None  # the group's step time that ZeRO does not change
        for layout in group:
            mem = layout_memory(q, layout)
            if mem.total > usable and space.activation_offload:  # the saved activations
                offloaded = replace(layout, activation_offload=True)  # on the host instead
                off_mem = layout_memory(q, offloaded)
                if off_mem.total <= usable:
                    layout, mem = offloaded, off_mem
            if mem.total > usable:
                rej.add(
                    "memory",
                    f"{layout.describe()}: {gib(mem.total)} per rank > {gib(usable)} usable",
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
    return SearchResult(q, best, evaluated, rej, explain(q, best, rej))


def brute_force(q: Query, space: Space | None = None) -> list[Estimate]:
    """Every valid layout of ``space`` that fits, evaluated without pruning, fastest first."""
    space = space or Space()
    out = []
    for group in candidates(q, space, Rejections()):
        for layout in group:
            e = layout_estimate(q, layout)
            if not e.fits and space.activation_offload:  # as search: offload what does not fit
                e = layout_estimate(q, replace(layout, activation_offload=True))
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


def simplest(q: Query) -> Layout:
    """Plain data parallelism over every device, one micro-batch per replica and step."""
    dp = q.devices
    per = max(1, q.global_batch // dp)
    return replace(Layout(dp=dp), micro_batch=per)
