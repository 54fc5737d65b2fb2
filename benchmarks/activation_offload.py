"""Activation offloading (issue 44): step time and saved activations with and without it.

**Measured** (one CPU process, fp32, the built-in transformer): a forward and backward of
one micro-batch, median of ``--repeats`` after a warm-up, for no offload, every block
offloaded, the first half offloaded, and selective recomputation beside them. The saved
activations left on the device are the distinct storages autograd keeps outside the
offloaded blocks (saved-tensor hooks around the model,
:class:`plait.parallel.recompute.SavedActivations`; an offloaded block's own hooks take
its tensors); the host copies are the offload pool's peak. On the CPU the "device" *is*
the host: the copies cost time and move bytes into the pool, so the table shows the
mechanism's cost, not a saving (the GPU's copies overlap compute on a side stream).

**Planned** (``plait.plan``): Llama 3 8B at a 32k context on one H100 (bf16, micro-batch
1, selective recomputation, ZeRO-2 with the optimizer offloaded to the host): device
memory, host bytes and step time with and without offloading every block.

Run from the repository root::

    python benchmarks/activation_offload.py                          # print the tables
    python benchmarks/activation_offload.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from plait import init_mesh
from plait.bench.results import command_line, environment, load_average, write_section
from plait.config import ModelConfig
from plait.model import Transformer
from plait.parallel.parallelize import parallelize
from plait.parallel.recompute import SavedActivations

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "offload every block": {"activation_offload": True},
    "offload first half": {"activation_offload": True, "half": True},
    "selective recompute": {"recompute": "selective"},
}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def measure(cfg: ModelConfig, batch: int, seq: int, repeats: int) -> dict[str, dict[str, float]]:
    """Every variant: median step seconds, device-saved bytes, host-copy peak bytes (the
    variants take turns inside each repeat, so a busy machine slows them alike)."""
    models = {}
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        if kw.pop("half", False):
            kw["activation_offload_blocks"] = max(1, cfg.n_layers // 2)
        models[name] = parallelize(Transformer(cfg, seed=0), init_mesh(), **kw)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in models}
    saved: dict[str, int] = {}
    for k in range(repeats + 1):
        for name, pm in models.items():
            exclude = [*pm.parameters(), *pm.buffers()]
            t0 = time.perf_counter()
            with SavedActivations(exclude) as counter:
                out = pm(x)  # (batch, seq, vocab)
            out.float().pow(2).mean().backward()
            dt = time.perf_counter() - t0
            saved[name] = counter.bytes
            if k:  # the first is the warm-up
                times[name].append(dt)
            pm.zero_grad(set_to_none=True)
    return {
        name: {
            "step": statistics.median(times[name]),
            "saved": float(saved[name]),
            "host": float(pm.offload_pool.peak_bytes if pm.offload_pool is not None else 0),
        }
        for name, pm in models.items()
    }


def planned() -> list[str]:
    """The planner's rows: Llama 3 8B, 32k context, one H100 (ZeRO-2 with the optimizer
    offloaded: the bf16 weights and gradients on the device)."""
    from plait.plan import HARDWARE_PRESETS, MODEL_SPECS, PRECISIONS, RUNTIMES, Layout, estimate
    from plait.plan.query import Query

    rows = []
    for name, on in (("none", False), ("offload every block", True)):
        lay = Layout(zero=2, offload="optimizer", recompute="selective", activation_offload=on)
        hw = HARDWARE_PRESETS["h100-80gb"]
        q = Query.of_layout(
            MODEL_SPECS["llama3-8b"], lay, hw, PRECISIONS["bf16-mixed"], RUNTIMES["plait"],
            32768, 0.0, None,
        )  # fmt: skip
        e = estimate(q, lay)
        m = e.memory
        rows.append(
            f"| {name} | {m.activations / 2**30:.1f} | {m.host_activations / 2**30:.1f} | "
            f"{m.total / 2**30:.1f} | {'yes' if e.fits else 'no'} | {e.time.total:.2f} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.dim, a.layers, a.seq, a.batch, a.repeats = 32, 2, 16, 1, 1
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=1024, dim=a.dim, n_layers=a.layers, n_heads=4, max_seq_len=a.seq)
    load0 = load_average()
    res = measure(cfg, a.batch, a.seq, a.repeats)
    load1 = load_average()
    base = res["none"]["step"]
    rows = [
        "| variant (CPU) | step s | vs none | saved on device MiB | host copies MiB |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        rows.append(
            f"| {name} | {r['step']:.3f} | {r['step'] / base:.2f} | {_mib(r['saved'])} | "
            f"{_mib(r['host'])} |"
        )
    plan = [
        "| Llama 3 8B, 32k, 1 x H100 (planned) | device activations GiB | host GiB | "
        "device total GiB | fits 80 GB | step s |",
        "|---|---|---|---|---|---|",
        *planned(),
    ]
    notes = [
        f"{environment()}; 1 thread; load average {load0:.1f} before, {load1:.1f} after.",
        f"Measured: dim {a.dim}, {a.layers} layers, 4 heads, vocabulary 1024, fp32, "
        f"{a.batch} x {a.seq} tokens, median of {a.repeats} forward+backward after a warm-up, "
        "the variants taking turns.",
        "Planned: bf16 mixed precision, micro-batch 1, selective recomputation, ZeRO-2 with "
        "the optimizer on the host; `plait plan --model llama3-8b --hardware h100-80gb "
        "--devices 1 --seq 32768 --zero 2 --offload optimizer --recompute selective "
        "[--activation-offload]`.",
        f"Command: `{command_line(__file__)}`",
    ]
    text = "\n".join(rows) + "\n\n" + "\n".join(plan)
    print(text)
    print("\n".join(notes))
    if a.out is not None:
        section = "## Activation offloading (issue 44)\n\n" + text + "\n\n"
        write_section(a.out, "activation_offload", section + "\n".join(notes))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
