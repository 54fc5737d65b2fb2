"""Words for the search's choice: one paragraph on why the first layout wins."""

from __future__ import annotations

from plait.plan.estimate import Estimate, StepTime
from plait.plan.query import Query
from plait.plan.space import Rejections
from plait.plan.text import gib, seconds

COMPONENTS: dict[str, str] = {
    "compute": "compute",
    "recompute": "recomputation",
    "tp_comm": "tensor-parallel all-reduces",
    "cp_comm": "context-parallel ring / all-to-all",
    "pp_comm": "pipeline sends",
    "bubble": "the pipeline bubble",
    "dp_comm": "exposed data-parallel/ZeRO traffic",
    "optimizer": "the optimizer step",
    "other": "gradient copies and accumulation",
    "ep_comm": "expert-parallel all-to-alls",
}
"""Step-time components and how the explanation names them."""


def _parts(t: StepTime) -> dict[str, float]:
    return {k: getattr(t, k) for k in COMPONENTS}


def _differences(a: Estimate, b: Estimate) -> list[str]:
    """What differs between two layouts, e.g. ``tp 2 -> 4``."""
    out = []
    la, lb = a.layout, b.layout
    for key in ("dp", "tp", "pp", "cp", "zero", "micro_batch", "recompute", "schedule"):
        va, vb = getattr(la, key), getattr(lb, key)
        if va != vb:
            out.append(f"{key.replace('_', '-')} {va} -> {vb}")
    if la.shard_factor != lb.shard_factor:
        out.append(f"F {la.shard_factor} -> {lb.shard_factor}")
    if la.ep != lb.ep:
        out.append(f"ep {la.ep} -> {lb.ep}")
    if la.sequence_parallel != lb.sequence_parallel:
        out.append("sequence parallelism " + ("on" if lb.sequence_parallel else "off"))
    return out


def explain(q: Query, ranked: list[Estimate], rej: Rejections) -> str:
    """One paragraph on a search for ``q``: the winner's shape (``ranked``: fastest
    first), its costs, the runner-up, what was rejected (``rej``)."""
    if not ranked:
        reasons = ", ".join(f"{n} for {k}" for k, n in sorted(rej.counts.items()))
        first = next(iter(rej.examples.get("memory", [])), "")
        hint = f" (e.g. {first})" if first else ""
        return (
            f"No layout of {q.model.name} on {q.devices} x {q.hardware.name} works: "
            f"candidates were rejected {reasons or 'for lack of any candidate'}{hint}. "
            "More devices, a smaller global batch per device, or a lower-precision "
            "optimizer state would be needed."
        )
    best = ranked[0]
    t = best.time
    parts = _parts(t)
    overhead = sorted(((v, k) for k, v in parts.items() if k != "compute" and v > 0), reverse=True)[
        :2
    ]
    over_txt = " and ".join(f"{COMPONENTS[k]} ({seconds(v)})" for v, k in overhead) or "none"
    text = (
        f"{best.layout.describe()} is predicted fastest: {seconds(t.total)} per step, "
        f"{best.tokens_per_s:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%. It fits with "
        f"{gib(best.memory.total)} of {gib(best.usable_bytes)} usable per device "
        f"({gib(best.memory.state)} state, "
        f"{gib(best.memory.activations + best.memory.embedding_head)} activations). "
        f"Compute is {100 * t.compute / t.total:.0f}% of the step; the largest overheads "
        f"are {over_txt}."
    )
    if len(ranked) > 1:
        second = ranked[1]
        diffs = _differences(best, second)
        delta = {k: v - parts[k] for k, v in _parts(second.time).items()}
        worst = max(delta, key=lambda k: delta[k])
        text += (
            f" The runner-up ({', '.join(diffs) or 'an equivalent layout'}) is "
            f"{100 * (second.time.total / t.total - 1):.1f}% slower, mostly from "
            f"{COMPONENTS[worst]} (+{seconds(delta[worst])})."
        )
    plain = [e for e in ranked if e.layout.tp == e.layout.pp == e.layout.cp == 1]
    if best.layout.tp * best.layout.pp * best.layout.cp > 1 and not plain:
        text += " No pure data-parallel layout made the top list"
        mem = [m for m in rej.examples.get("memory", []) if " tp1 pp1 cp1 " in m]
        text += f" (e.g. {mem[0]})." if mem else "."
    if rej.counts:
        summary = ", ".join(f"{n} for {k}" for k, n in sorted(rej.counts.items()))
        text += f" Rejected: {summary}."
    return text
