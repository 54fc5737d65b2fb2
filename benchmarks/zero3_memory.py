"""ZeRO-3 memory per rank, before and after issue 44: generation and the training step.

On ``--ranks`` gloo ranks (dp, ZeRO-3) the built-in transformer is built on the meta
device (each rank allocates only its shards) and measured, every figure the most over
the ranks:

* **generation** — greedy tokens after a 16-token prompt with the key/value cache.
  ``before``: every unit gathered for the whole decode (``ZeroDataParallel.gathered()``,
  what ``plait generate`` and ``log.sample_every`` did); ``after``: each unit gathered,
  used and freed in turn per fed token, without prefetch
  (:class:`~plait.parallel.zero.unit_by_unit.UnitByUnit`). The bytes the decode adds
  above the shards are counted from the tensors (:class:`plait.testing.LiveBytes`); the
  tokens of the two must be equal.
* **step** — one training step (SGD, one sequence per rank). ``before``: every
  reduce-scatter output kept to the end of backward (``GradientReducer.fold_outputs =
  False``, the reducer as it was); ``after``: each output added into the gradient shard
  as soon as it is waited for. Columns: the step's tensor peak above the shards
  (``LiveBytes``), ZeRO-3's counted transient (most gathered parameter + full-gradient
  buffer bytes at once) against the planner's ZeRO-3 buffer term for the same layout,
  and the process's resident-set peak during the step above its size before it (the
  peak restarted through ``/proc/self/clear_refs``; allocator and gloo buffers
  included).

Run from the repository root::

    python benchmarks/zero3_memory.py                       # print the tables
    python benchmarks/zero3_memory.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the body by module name
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from plait.bench.results import command_line, environment, load_average, write_section  # noqa: E402

BODY = "benchmarks.zero3_memory:bench_body"
PROMPT = [(7 * i + 3) % 200 for i in range(16)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _build(model_kw: dict[str, Any], mesh: Any) -> Any:
    from plait.config import ModelConfig
    from plait.model import Transformer
    from plait.parallel.parallelize import parallelize

    with torch.device("meta"):
        model = Transformer(ModelConfig(**model_kw), seed=0)
    return parallelize(model, mesh, zero=3)


def _generation(model_kw: dict[str, Any], mesh: Any, new: int, whole: bool) -> dict[str, Any]:
    """The decode's added tensor bytes, ``whole``: every unit gathered throughout."""
    from plait.model.generate import SampleSettings, generate, make_decoder
    from plait.testing import LiveBytes
    from plait.train.sample import inner_model, sample_tokens

    settings = SampleSettings(max_new_tokens=new)
    with LiveBytes() as counter:
        pm = _build(model_kw, mesh)
        zero = pm.zero
        before = counter.live()
        counter.reset_peak()
        if whole:
            pm.eval()
            with zero.gathered():
                inner = inner_model(pm)
                decoder = make_decoder(inner, len(PROMPT) + new)
                tokens = generate(decoder, PROMPT, settings, mesh.device)
        else:
            tokens = sample_tokens(pm, PROMPT, settings).tokens
        added = counter.peak - before
    return {
        "tokens": tokens,
        "added": added,
        "shards": before,
        "largest": max(u.padded for u in zero.units) * 4,
        "model": sum(u.numel for u in zero.units) * 4,
    }


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _step(model_kw: dict[str, Any], mesh: Any, seq: int, fold: bool) -> dict[str, Any]:
    """One step's peaks; ``fold``: reduce-scatter outputs added as they arrive."""
    from plait.optim import Optimizer
    from plait.testing import LiveBytes
    from plait.train.memory import host_peak_bytes, reset_host_peak

    with LiveBytes() as counter:
        pm = _build(model_kw, mesh)
        zero = pm.zero
        zero.reducer.fold_outputs = fold
        opt = Optimizer(pm, torch.optim.SGD(pm.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, model_kw["vocab_size"], (1, seq), generator=g)
        before = counter.live()
        counter.reset_peak()
        zero.reset_peak_gathered()
        rss0 = _rss()
        resets = reset_host_peak()
        pm.step(x, x)
        opt.step()
        opt.zero_grad()
        rss = host_peak_bytes() - rss0 if resets else -1
        added = counter.peak - before
    return {
        "added": added,
        "transient": zero.peak_gathered_bytes + zero.peak_grad_buffer_bytes,
        "rss": rss,
    }


def bench_body(ctx: Any, model_kw: dict[str, Any], new: int, seq: int) -> dict[str, Any]:
    """Every row's figures on this rank."""
    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=ctx.world_size)
    return {
        "gen before": _generation(model_kw, mesh, new, whole=True),
        "gen after": _generation(model_kw, mesh, new, whole=False),
        "step before": _step(model_kw, mesh, seq, fold=False),
        "step after": _step(model_kw, mesh, seq, fold=True),
    }


def _planned(model_kw: dict[str, Any], ranks: int, seq: int) -> float:
    """The planner's ZeRO-3 buffer term (gathered units, gradient buffers), fp32."""
    from plait.config import ModelConfig
    from plait.plan import HARDWARE_PRESETS
    from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
    from plait.plan.memory import memory_per_rank
    from plait.plan.modelspec import ModelSpec
    from plait.plan.query import Query

    spec = ModelSpec.from_config(ModelConfig(**model_kw))
    lay = Layout(dp=ranks, zero=3)
    hw = HARDWARE_PRESETS["a100-80gb"]  # memory does not read the device
    q = Query.of_layout(spec, lay, hw, PRECISIONS["fp32"], RUNTIMES["plait"], seq, 0.0, None)
    return memory_per_rank(q, lay).buffers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64, help="tokens per rank in the step")
    ap.add_argument("--new", type=int, default=8, help="generated tokens")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.ranks, a.dim, a.layers, a.vocab, a.seq, a.new = 2, 32, 2, 256, 8, 2
    from plait.testing import WorkerPool

    model_kw = {
        "vocab_size": a.vocab,
        "dim": a.dim,
        "n_layers": a.layers,
        "n_heads": 4,
        "max_seq_len": max(a.seq, len(PROMPT) + a.new),
    }
    load0 = load_average()
    with WorkerPool(a.ranks) as pool:
        res = pool.run(BODY, model_kw, a.new, a.seq)
    load1 = load_average()

    def most(row: str, key: str) -> float:
        return float(max(r[row][key] for r in res))

    g0 = res[0]["gen before"]
    same = all(r["gen before"]["tokens"] == r["gen after"]["tokens"] for r in res)
    gen = [
        "| generation (ZeRO-3) | model MiB | shards MiB | largest unit MiB | "
        "decode adds MiB | tokens equal |",
        "|---|---|---|---|---|---|",
    ]
    for row, name in (
        ("gen before", "before: whole model gathered"),
        ("gen after", "after: unit by unit"),
    ):
        gen.append(
            f"| {name} | {_mib(g0['model'])} | {_mib(most(row, 'shards'))} | "
            f"{_mib(g0['largest'])} | {_mib(most(row, 'added'))} | {'yes' if same else 'NO'} |"
        )
    planned = _planned(model_kw, a.ranks, a.seq)
    step = [
        "| step (ZeRO-3) | tensor peak above shards MiB | counted transient MiB | "
        "planner transient MiB | RSS peak above start MiB |",
        "|---|---|---|---|---|",
    ]
    for row, name in (
        ("step before", "before: outputs kept"),
        ("step after", "after: outputs folded"),
    ):
        rss = most(row, "rss")
        step.append(
            f"| {name} | {_mib(most(row, 'added'))} | {_mib(most(row, 'transient'))} | "
            f"{_mib(planned)} | {_mib(rss) if rss >= 0 else 'n/a'} |"
        )
    notes = [
        f"{environment()}; {os.cpu_count()} cores, gloo, {a.ranks} ranks x 1 thread; load "
        f"average {load0:.1f} before, {load1:.1f} after.",
        f"Model: dim {a.dim}, {a.layers} layers, 4 heads, vocabulary {a.vocab}, fp32, built "
        f"on the meta device; ZeRO-3 dp{a.ranks}; generation: {len(PROMPT)}-token prompt, "
        f"{a.new} new tokens, KV cache; step: 1 x {a.seq} tokens per rank, SGD. Each figure "
        "is the largest over the ranks. The planner counts every gathered and gradient slot "
        "at the largest unit (here the embedding and the head): an upper bound; with a block "
        "the largest unit the two are equal (tests/parallel/test_materialize.py).",
        f"Command: `{command_line(__file__)}`",
    ]
    text = "\n".join(gen) + "\n\n" + "\n".join(step)
    print(text)
    print("\n".join(notes))
    if a.out is not None:
        section = "## ZeRO-3 generation and step memory per rank (issue 44)\n\n" + text + "\n\n"
        write_section(a.out, "zero3_memory", section + "\n".join(notes))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
