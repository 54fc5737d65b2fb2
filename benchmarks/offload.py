"""ZeRO-Offload: tokens/s, MFU, host/device peak, CPU step time, before and after (issue 30).

Two parts:

1. **The host AdamW** (:func:`plait.bench.cpu_adam.measure_cpu_adam`): parameters per
   second of one AdamW step over flat fp32 buffers with torch's fused CPU kernel,
   ``foreach`` and the per-parameter loop, with 1 and all intra-op threads.
2. **A training run** of the built-in transformer under ZeRO with ``offload =
   optimizer`` on one rank, in this process: ``after`` is plait as it is (fused CPU
   AdamW; gradients copied to the host unit by unit during backward; each unit's CPU
   step started by a worker thread as soon as its gradient lands, with no clipping);
   ``before`` reproduces the pre-issue path (the user's optimizer rebuilt as it was,
   i.e. AdamW's per-parameter loop on CPU tensors; every gradient copied and stepped
   after backward) by switching those two off; ``clipped`` is ``after`` with gradient
   clipping (the two-pass step: the norm from the device's shards, then each unit lands in
   the ring of landing buffers and steps); ``none`` is no offload. Reported: tokens/s, MFU
   (6·N·tokens FLOPs over the device's peak, given by ``--peak-tflops``), the process's
   host peak (``VmHWM``), the device allocator's peak (CUDA only), and the CPU step time
   (the sum of the per-unit host steps, from the recorded events) per optimizer step.

The small CPU case (default) runs here; the issue's 7B case on one H100 is
``--device cuda --dim 4096 --layers 32 --heads 32 --vocab 32000 --ffn 11008 --seq 2048
--batch 1 --accum 16 --dtype bf16 --recompute full --peak-tflops 989`` (it needs "Start
big"'s meta build to keep the host peak down; this script builds the model on the host).

    python benchmarks/offload.py                      # print the tables
    python benchmarks/offload.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from plait import init_mesh  # noqa: E402
from plait.bench.cpu_adam import measure_cpu_adam  # noqa: E402
from plait.config import ModelConfig  # noqa: E402
from plait.model import Transformer, lm_loss  # noqa: E402
from plait.optim import Optimizer  # noqa: E402
from plait.parallel.recompute import apply_recompute  # noqa: E402
from plait.parallel.zero import ZeroDataParallel  # noqa: E402
from plait.parallel.zero import optim as zero_optim  # noqa: E402
from plait.train.memory import host_peak_bytes, peak_memory, reset_peak_memory  # noqa: E402


def adam_table(numel: int) -> list[str]:
    """Rows of the host AdamW table."""
    threads = sorted({1, torch.get_num_threads()})
    rows = ["| threads | fused (M params/s) | foreach | loop |", "|---|---|---|---|"]
    for t in threads:
        r = measure_cpu_adam(numel=numel, threads=t)
        cells = [f"{r[v] / 1e6:,.0f}" if v in r else "-" for v in ("fused", "foreach", "loop")]
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    return rows


def run(variant: str, a: argparse.Namespace) -> dict[str, Any]:
    """One training run of ``variant`` (after / before / none)."""
    device = torch.device(a.device)
    cfg = ModelConfig(
        vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads,
        ffn_dim=a.ffn, max_seq_len=a.seq,
    )  # fmt: skip
    model = Transformer(cfg, seed=0).to(device)
    if a.recompute != "none":
        apply_recompute(model, a.recompute)
    n = sum(p.numel() for p in model.parameters())
    offload = "none" if variant == "none" else "optimizer"
    restore = zero_optim.host_optimizer
    if variant == "before":  # the optimizer rebuilt as it was: AdamW's loop on CPU tensors
        zero_optim.host_optimizer = zero_optim.rebuild  # type: ignore[assignment]
    try:
        zdp = ZeroDataParallel(
            model, init_mesh(device=a.device), a.zero, param_dtype=a.dtype, offload=offload
        )  # type: ignore[arg-type]
        clip = 1.0 if variant == "clipped" else 0.0  # clipped: the two-pass step after the norm
        opt = Optimizer(
            zdp, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1), max_norm=clip
        )
    finally:
        zero_optim.host_optimizer = restore
    host = opt.sharded.host if opt.sharded is not None else None
    if host is not None and variant in ("before", "fused"):  # no overlap: all after backward
        host.eager = False
        zdp.reducer.settle_early = False
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    times, cpu_steps, losses = [], [], []
    reset_peak_memory(device)
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        for k in range(a.accum):
            with zdp.no_sync() if k < a.accum - 1 else _null():
                loss = lm_loss(zdp(x).float(), x)
                (loss / a.accum).backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            if host is not None:
                starts = {nm: t for k2, nm, t in host.events if k2 == "step_start"}
                ends = {nm: t for k2, nm, t in host.events if k2 == "step_end"}
                cpu_steps.append(sum(ends[nm] - starts[nm] for nm in ends if nm in starts))
    landing = state = 0
    if host is not None:
        landing = _nbytes(host.grads)
        state = _nbytes(opt.master_tensors()) + _nbytes(
            [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        )
        host.close()
    step_s = sum(times) / len(times)
    tokens = a.batch * a.seq * a.accum
    dev_peak = peak_memory(device)
    return {
        "variant": variant,
        "params": n,
        "step_s": step_s,
        "tokens_s": tokens / step_s,
        "mfu": 6 * n * tokens / step_s / (a.peak_tflops * 1e12),
        "host_peak": host_peak_bytes(),
        "device_peak": dev_peak,
        "landing": landing,
        "host_state": state,
        "cpu_step_s": sum(cpu_steps) / len(cpu_steps) if cpu_steps else 0.0,
        "loss": losses[-1],
    }


def _nbytes(ts: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``ts``."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}
    return sum(seen.values())


def _in_child(variant: str) -> dict[str, Any]:
    """``run(variant)`` in a fresh process (the host peak is per process)."""
    argv = [a for a in sys.argv[1:] if not a.startswith("--out")]
    if "--out" in sys.argv:
        i = sys.argv.index("--out")
        argv = sys.argv[1:i] + sys.argv[i + 2 :]
    res = subprocess.run(
        [sys.executable, __file__, *argv, "--child", variant],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT ") :]))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--recompute", default="none")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=0.1, help="MFU denominator per device")
    p.add_argument("--adam-numel", type=int, default=1 << 22)
    p.add_argument("--variants", default="none,before,fused,after")
    p.add_argument("--out", help="append the section to this RESULTS.md")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one variant, JSON out
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(run(a.child, a)))
        return
    load0 = os.getloadavg()[0]
    title = f"Host AdamW over 8 flat fp32 buffers, {a.adam_numel:,} parameters (median of 5):"
    lines = [title, "", *adam_table(a.adam_numel), ""]
    rows = [_in_child(v) for v in a.variants.split(",")]  # a process each: its own peak
    n = rows[0]["params"]
    lines += [
        f"Training: {n / 1e6:.1f} M parameters, ZeRO-{a.zero}, {a.dtype}, batch {a.batch} x "
        f"{a.seq} x accumulation {a.accum}, {a.device}, mean of {a.steps} steps after "
        f"{a.warmup} warm-up:",
        "",
        "| variant | step (s) | tokens/s | MFU | CPU step (s) | host peak (GiB) "
        "| device peak (GiB) | masters + state (MiB) | landing buffers (MiB) | loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dev = "-" if r["device_peak"] is None else f"{r['device_peak'] / 2**30:.2f}"
        lines.append(
            f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | {r['mfu']:.2%} | "
            f"{r['cpu_step_s']:.3f} | {r['host_peak'] / 2**30:.2f} | {dev} | "
            f"{r.get('host_state', 0) / 2**20:.1f} | {r.get('landing', 0) / 2**20:.1f} | "
            f"{r['loss']:.4f} |"
        )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"Measured by `python benchmarks/offload.py`; {platform.node()} "
        f"({os.cpu_count()} cores, {torch.get_num_threads()} torch threads), load average "
        f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; Date: {stamp}; torch {torch.__version__}; "
        f"Python {platform.python_version()}."
    )
    text = "\n".join([head, "", *lines])
    print(text)
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(
                "\n<!-- offload:begin -->\n## ZeRO-Offload (issue 30)\n\n"
                f"{text}\n\n<!-- offload:end -->\n"
            )


if __name__ == "__main__":
    main()
