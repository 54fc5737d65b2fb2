"""Text and JSON forms of the planner's answers (what ``plait plan`` prints)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from plait.plan.estimate import Estimate
from plait.plan.explain import COMPONENTS
from plait.plan.search import SearchResult
from plait.plan.text import seconds

SCHEMA_VERSION = 1
"""Version of the JSON documents; bumped when a key changes meaning or disappears."""

MEMORY_ROWS = (
    ("params", "weights"),
    ("grads", "gradients"),
    ("master", "fp32 master weights"),
    ("optimizer", "optimizer state"),
    ("activations", "activations (blocks)"),
    ("embedding_head", "activations (embedding, head, loss)"),
    ("buffers", "buffers (buckets, gathered units, p2p)"),
)


def header(e: Estimate, devices: int) -> str:
    """One line: model, devices, precision, runtime, sequence."""
    return (
        f"{e.model.name} ({e.model.param_count() / 1e9:.3g} B parameters) on {devices} x "
        f"{e.hardware.name}, {e.precision.name}, runtime {e.runtime.name}, "
        f"sequence {e.seq_len}"
    )


def format_estimate(e: Estimate) -> str:
    """Memory and step-time breakdown of one layout."""
    m, t = e.memory, e.time
    lines = [
        header(e, e.layout.world),
        f"layout {e.layout.describe()}: global batch {e.layout.global_batch} sequences "
        f"= {e.tokens_per_step:,} tokens per step",
        "",
        f"memory per rank (pipeline stage {m.stage}, {m.in_flight:g} micro-batch(es) in flight)",
    ]
    for key, label in MEMORY_ROWS:
        lines.append(f"  {label:<42} {getattr(m, key) / 2**30:>10.2f} GiB")
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines.append(
        f"  {'total':<42} {m.total / 2**30:>10.2f} GiB  of {e.usable_bytes / 2**30:.2f} "
        f"usable: {verdict}"
    )
    if m.host_activations:  # activation offload: the offloaded blocks' saved tensors
        host = m.host_activations / 2**30
        lines.append(f"  {'host: offloaded activations':<42} {host:>10.2f} GiB")
    lines += ["", "step time"]
    for key, label in COMPONENTS.items():
        v = getattr(t, key)
        if key == "ep_comm" and e.moe is None:
            continue  # a dense model has no all-to-alls
        lines.append(f"  {label:<42} {seconds(v):>12}  {100 * v / t.total:5.1f}%")
    lines.append(f"  {'total':<42} {seconds(t.total):>12}")
    lines.append(f"  (data-parallel/ZeRO traffic before overlap: {seconds(t.dp_comm_total)})")
    lines += [
        "",
        f"throughput {e.tokens_per_s:,.0f} tokens/s; MFU {100 * e.mfu:.1f}% "
        f"(HFU {100 * e.hfu:.1f}%, counting recomputation) of "
        f"{e.hardware.peak_flops / 1e12:.4g} TFLOP/s per device",
    ]
    return "\n".join(lines)


def format_search(r: SearchResult) -> str:
    """The top layouts as a table, the rejections and the explanation."""
    q = r.query
    lines = [
        f"{q.model.name} ({q.model.param_count() / 1e9:.3g} B parameters) on {q.devices} x "
        f"{q.hardware.name}, global batch {q.global_batch} x {q.seq_len} tokens, "
        f"{q.precision.name}, runtime {q.runtime.name}",
        f"evaluated {r.evaluated} layouts; rejected "
        + (", ".join(f"{n} for {k}" for k, n in sorted(r.rejections.counts.items())) or "none"),
        "",
    ]
    if r.ranked:
        ep = q.moe is not None  # a mixture-of-experts model: ep is a searched column
        lines.append(
            f"{'#':>2}  {'layout':<52} {'ep':>3} " * ep
            + f"{'#':>2}  {'layout':<52} " * (not ep)
            + f"{'step':>10} {'tokens/s':>12} {'MFU':>6} {'GiB/rank':>9}"
        )
        for i, e in enumerate(r.ranked, 1):
            cols = f"{i:>2}  {e.layout.describe():<52} " + (f"{e.layout.ep:>3} " if ep else "")
            lines.append(
                f"{cols}{seconds(e.time.total):>10} "
                f"{e.tokens_per_s:>12,.0f} {100 * e.mfu:>5.1f}% {e.memory.total / 2**30:>9.1f}"
            )
        lines.append("")
    for kind, examples in sorted(r.rejections.examples.items()):
        lines.append(f"rejected for {kind}, e.g.: {examples[0]}")
    lines += ["", r.explanation]
    return "\n".join(lines)


def estimate_json(e: Estimate) -> dict[str, Any]:
    """The JSON document of ``plait plan --json`` for one layout."""
    return {"schema": SCHEMA_VERSION, "kind": "estimate", **e.as_dict()}


def search_json(r: SearchResult) -> dict[str, Any]:
    """The JSON document of ``plait plan --search --json``."""
    q = r.query
    return {
        "schema": SCHEMA_VERSION,
        "kind": "search",
        "query": {
            "model": asdict(q.model) | {"params": q.model.param_count()},
            "hardware": q.hardware.name,
            "devices": q.devices,
            "global_batch": q.global_batch,
            "seq_len": q.seq_len,
            "precision": q.precision.name,
            "runtime": q.runtime.name,
            "headroom": q.headroom,
            "moe": asdict(q.moe) if q.moe is not None else None,
        },
        "evaluated": r.evaluated,
        "rejected": dict(sorted(r.rejections.counts.items())),
        "rejected_examples": {k: list(v) for k, v in sorted(r.rejections.examples.items())},
        "top": [e.as_dict() for e in r.ranked],
        "explanation": r.explanation,
    }
