"""ZeRO-Offload: tokens/s, MFU, host/device peak, CPU step time, before and after (issue 30).

Three parts:

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

3. **The planner's host-step time against measured steps** (``--model-check``): on 1
   and 2 gloo ranks (ZeRO-2, one torch thread per rank) each rank calibrates the parts
   of :mod:`plait.plan.offload_time` on its own shards (fused AdamW parameters/s, the
   host-to-host copy's bytes/s standing in for the link, the norm's seconds; thread CPU
   time) and predicts the training step as the measured forward + backward of a run
   without offload plus the offloaded step: eager (no clipping; the host steps under
   backward) and two-pass (clipping engaged: the norm, then per unit copy ->
   unscale/clip -> step, the copy back inside the worker's step on a CPU-only run).
   The machine is shared and loaded, so the comparison is in **process CPU time**
   (every thread's, which on a CPU run is the same work without the overlap:
   ``TwoPass.busy``); wall times (the overlapped prediction, ``TwoPass.total`` /
   ``eager_exposed``) are printed beside it and are only as good as the load allows.
   Under pp2 (``parallelize``, ZeRO-2, clipping) each stage's ``opt.step()`` (its units
   land and step after the schedule) is compared with the flow over its own shards.

The small CPU case (default) runs here; the issue's 7B case on one H100 is
``--device cuda --dim 4096 --layers 32 --heads 32 --vocab 32000 --ffn 11008 --seq 2048
--batch 1 --accum 16 --dtype bf16 --recompute full --peak-tflops 989`` (it needs "Start
big"'s meta build to keep the host peak down; this script builds the model on the host).

    python benchmarks/offload.py                      # print the tables
    python benchmarks/offload.py --out benchmarks/RESULTS.md
    python benchmarks/offload.py --model-check     # only the planner-vs-measured table
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
if str(ROOT) not in sys.path:  # the pool's workers resolve the model check's body by name
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from plait import comm, init_mesh  # noqa: E402
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
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if res.returncode or line is None:  # recorded with its reason; the other variants run
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        out = {"variant": variant, "error": f"exit {res.returncode}: {last}"}
    else:
        out = dict(json.loads(line[len("RESULT ") :]))
    print(f"# {variant}: {out.get('error') or 'done'}", flush=True)  # as each one ends
    return out


# ----------------------------------------------------------------------------- model check

CHECK_BODY = "benchmarks.offload:check_body"
CHECK_CLIP = 1e-3  # engaged on every step: the two-pass path scales on the host


def _cpu_rate(fn: Any, work: float, reps: int = 3) -> float:
    """``work`` per second of ``fn()``, by this thread's CPU time (median of ``reps``)."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        c0 = time.thread_time()
        fn()
        times.append(time.thread_time() - c0)
    return work / max(sorted(times)[len(times) // 2], 1e-9)


def _calibrate(shards: list[int]) -> dict[str, float]:
    """The model's inputs on this rank's shards: fused AdamW parameters/s, the host copy's
    bytes/s (the CPU run's "link"), the norm's seconds (thread CPU time)."""
    ps = [torch.nn.Parameter(torch.randn(n)) for n in shards]
    for p in ps:
        p.grad = torch.full_like(p, 1e-3)
    adam = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True)
    total = sum(shards)
    dst = [torch.empty(n) for n in shards]
    src = [p.grad for p in ps if p.grad is not None]

    def copy() -> None:
        for d, g in zip(dst, src, strict=True):
            d.copy_(g)

    def norm() -> None:
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in src]))

    return {
        "rate": _cpu_rate(adam.step, total),
        "link": _cpu_rate(copy, 4 * total),
        "norm_s": 1.0 / _cpu_rate(norm, 1.0),
    }


def check_body(ctx: Any, kw: dict[str, Any], steps: int) -> dict[str, Any]:
    """On every rank: forward + backward without offload, then ZeRO-2 offload eager and
    two-pass; per variant the mean wall and process CPU seconds of a step (and of the
    ``opt.step()`` call alone); the calibration of this rank's shards."""
    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=ctx.world_size)
    cfg = ModelConfig(**kw["model"])
    g = torch.Generator().manual_seed(0)
    batch, seq = kw["batch"], kw["seq"]
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    out: dict[str, Any] = {}
    for variant in ("none", "eager", "two-pass"):
        model = Transformer(cfg, seed=0)
        offload = "none" if variant == "none" else "optimizer"
        zdp = ZeroDataParallel(model, mesh, 2, offload=offload)
        clip = CHECK_CLIP if variant == "two-pass" else 0.0
        opt = Optimizer(zdp, torch.optim.AdamW(model.parameters(), lr=1e-4), max_norm=clip)
        host = opt.sharded.host if opt.sharded is not None else None
        rows = []
        for step in range(steps + 1):
            comm.barrier(mesh.axis("dp"))  # the ranks start each step together
            t0, c0 = time.perf_counter(), time.process_time()
            loss = lm_loss(zdp(x), x)
            loss.backward()
            t1, c1 = time.perf_counter(), time.process_time()
            report = opt.step()
            t2, c2 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            zdp.wait_params()  # the post-step all-gathers (dp traffic, not the host step)
            t3, c3 = time.perf_counter(), time.process_time()
            if step:  # the first is a warm-up
                rows.append(
                    (t1 - t0, c1 - c0, t2 - t1, c2 - c1, t3 - t2, c3 - c2, report.grad_norm)
                )
        keys = ("fb_wall", "fb_cpu", "opt_wall", "opt_cpu", "ag_wall", "ag_cpu", "norm")
        medians = [sorted(r[i] for r in rows)[len(rows) // 2] for i in range(len(keys))]
        out[variant] = dict(zip(keys, medians, strict=True))
        if host is not None:
            out["eager_flag" if variant == "eager" else "two_pass_flag"] = host.eager
            shards = [s.master.numel() for s in host.masters.slots]
            out["shards"] = shards
            host.close()
    out["calibration"] = _calibrate(out["shards"])
    out["params"] = sum(p.numel() for p in Transformer(cfg, seed=0).parameters())
    return out


CHECK_PP_BODY = "benchmarks.offload:check_pp_body"


def check_pp_body(ctx: Any, kw: dict[str, Any], steps: int) -> dict[str, Any]:
    """pp2 (ZeRO-2, offload, clipping engaged) through ``parallelize``: each pipeline
    rank's ``opt.step()`` (its stage's units land and step after the schedule), median
    wall and process CPU seconds, and the calibration of its own shards."""
    from plait.config import Config, ParallelConfig, TrainConfig
    from plait.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    mesh = ctx.mesh(dp=1, pp=2)
    m = kw["model"]
    cfg = Config(
        model=ModelConfig(**m),
        parallel=ParallelConfig(pp=2, zero=2, offload="optimizer", microbatches=2),
        train=TrainConfig(global_batch=2, seq_len=kw["seq"], grad_clip=CHECK_CLIP),
    )
    model = Transformer(cfg.model, seed=0)
    pm = parallelize(model, mesh, cfg)
    opt = Optimizer(pm, torch.optim.AdamW(model.parameters(), lr=1e-4), max_norm=CHECK_CLIP)
    host = opt.sharded.host if opt.sharded is not None else None
    assert host is not None and not host.eager
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, m["vocab_size"], (2, kw["seq"]), generator=g)
    rows = []
    for step in range(steps + 1):
        comm.barrier(mesh.axis("pp"))
        pm.step(x, x)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        t1, c1 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        if step:
            rows.append((t1 - t0, c1 - c0))
    shards = [s.master.numel() for s in host.masters.slots]
    host.close()
    mid = len(rows) // 2
    return {
        "stage": mesh.index("pp"),
        "shards": shards,
        "opt_wall": sorted(r[0] for r in rows)[mid],
        "opt_cpu": sorted(r[1] for r in rows)[mid],
        "calibration": _calibrate(shards),
    }


def _predict(r: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """``variant -> (predicted step CPU s, predicted step wall s)`` from the calibration
    and the run without offload, with :mod:`plait.plan.offload_time`."""
    from plait.plan.layout import PRECISIONS
    from plait.plan.offload_time import eager_exposed, two_pass_timeline

    c, shards, base = r["calibration"], r["shards"], r["none"]
    flow = {
        scaled: two_pass_timeline(
            shards, c["rate"], c["link"], 4, 4, c["norm_s"], scaled=scaled, copy_back_on_worker=True
        )
        for scaled in (False, True)
    }
    exposed = eager_exposed(shards, c["rate"], c["link"], PRECISIONS["fp32"], base["fb_wall"])
    cpu0, wall0 = base["fb_cpu"] + base["ag_cpu"], base["fb_wall"] + base["ag_wall"]
    return {
        "eager": (cpu0 + flow[False].busy, wall0 + c["norm_s"] + exposed),
        "two-pass": (cpu0 + flow[True].busy, wall0 + flow[True].total),
        "two-pass step": (flow[True].busy, flow[True].total),
    }


def _measured(m: dict[str, float], alone: bool) -> tuple[float, float]:
    """(CPU s, wall s) of a whole step, or of the ``opt.step()`` call ``alone``."""
    if alone:
        return m["opt_cpu"], m["opt_wall"]
    return (
        m["fb_cpu"] + m["opt_cpu"] + m["ag_cpu"],
        m["fb_wall"] + m["opt_wall"] + m["ag_wall"],
    )


def model_check(a: argparse.Namespace) -> list[str]:
    """The planner-vs-measured table (part 3) at 1 and 2 data-parallel ranks, and per
    stage of pp2."""
    from plait.testing import WorkerPool

    kw = {
        "model": {"vocab_size": a.check_vocab, "dim": a.check_dim, "n_layers": a.check_layers,
                  "n_heads": 8, "max_seq_len": a.check_seq},
        "batch": 1, "seq": a.check_seq,
    }  # fmt: skip
    lines = [
        f"Planner vs measured, ZeRO-2 offload (optimizer), one torch thread per rank, model "
        f"dim {a.check_dim} x {a.check_layers} layers, vocabulary {a.check_vocab}, batch 1 x "
        f"{a.check_seq}, median of {a.check_steps} steps after one warm-up; rank 0's figures "
        "(pp2: each stage's, 2 micro-batches); "
        "a step is forward + backward + opt.step() + the post-step all-gathers, predicted as "
        "those of the run without offload plus the modelled host step. "
        "CPU = process CPU time (all threads); the machine is shared and loaded, so CPU "
        "time is the comparison and wall time is shown only beside it:",
        "",
        "| ranks | path | params/rank (M) | AdamW M/s | copy GB/s | predicted CPU s | "
        "measured CPU s | measured / predicted | predicted wall s | measured wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world in (1, 2):
        with WorkerPool(world) as pool:
            r = pool.run(CHECK_BODY, kw, a.check_steps, timeout_s=1800)[0]
        assert r["eager_flag"] and not r["two_pass_flag"]  # the paths the rows name
        pred, c = _predict(r), r["calibration"]
        share = sum(r["shards"]) / 1e6
        for path, key in (("eager (clip 0)", "eager"), ("two-pass (clipped)", "two-pass"),
                          ("two-pass: opt.step() alone", "two-pass step")):  # fmt: skip
            alone = key == "two-pass step"
            cpu, wall = _measured(r["two-pass" if alone else key], alone)
            p_cpu, p_wall = pred[key]
            lines.append(
                f"| {world} | {path} | {share:.1f} | {c['rate'] / 1e6:,.0f} | "
                f"{c['link'] / 1e9:.1f} | {p_cpu:.3f} | {cpu:.3f} | {cpu / p_cpu:.2f} | "
                f"{p_wall:.3f} | {wall:.3f} |"
            )
    from plait.plan.offload_time import two_pass_timeline

    with WorkerPool(2) as pool:  # pp2: each stage's host step, after the schedule
        stages = pool.run(CHECK_PP_BODY, kw, a.check_steps, timeout_s=1800)
    for r in sorted(stages, key=lambda r: r["stage"]):
        c = r["calibration"]
        flow = two_pass_timeline(
            r["shards"], c["rate"], c["link"], 4, 4, c["norm_s"], copy_back_on_worker=True
        )
        lines.append(
            f"| pp2, stage {r['stage']} | two-pass: opt.step() alone | "
            f"{sum(r['shards']) / 1e6:.1f} | {c['rate'] / 1e6:,.0f} | {c['link'] / 1e9:.1f} | "
            f"{flow.busy:.3f} | {r['opt_cpu']:.3f} | {r['opt_cpu'] / flow.busy:.2f} | "
            f"{flow.total:.3f} | {r['opt_wall']:.3f} |"
        )
    return lines


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
    p.add_argument("--model-check", action="store_true", help="only part 3's table")
    p.add_argument("--check-dim", type=int, default=768)
    p.add_argument("--check-layers", type=int, default=4)
    p.add_argument("--check-vocab", type=int, default=16384)
    p.add_argument("--check-seq", type=int, default=32)
    p.add_argument("--check-steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = p.parse_args()
    if a.tiny:
        a.dim, a.layers, a.heads, a.vocab, a.seq, a.batch = 32, 1, 2, 64, 16, 1
        a.steps, a.warmup = 1, 0
        a.adam_numel, a.variants = 1 << 12, "before,after"  # each variant is a child process
        a.check_dim, a.check_layers, a.check_vocab, a.check_seq, a.check_steps = 32, 2, 64, 8, 1
    if a.child:
        print("RESULT " + json.dumps(run(a.child, a)))
        return
    load0 = os.getloadavg()[0]
    if a.model_check:
        title = "ZeRO-Offload: the planner's host step vs measured (issue 30)"
        _emit(a, load0, model_check(a), "offload-model", title)
        return
    title = f"Host AdamW over 8 flat fp32 buffers, {a.adam_numel:,} parameters (median of 5):"
    lines = [title, "", *adam_table(a.adam_numel), ""]
    rows = [_in_child(v) for v in a.variants.split(",")]  # a process each: its own peak
    n = next((r["params"] for r in rows if "params" in r), 0)
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
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} |" + " |" * 8)
            continue
        dev = "-" if r["device_peak"] is None else f"{r['device_peak'] / 2**30:.2f}"
        lines.append(
            f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | {r['mfu']:.2%} | "
            f"{r['cpu_step_s']:.3f} | {r['host_peak'] / 2**30:.2f} | {dev} | "
            f"{r.get('host_state', 0) / 2**20:.1f} | {r.get('landing', 0) / 2**20:.1f} | "
            f"{r['loss']:.4f} |"
        )
    lines += ["", *model_check(a)]
    _emit(a, load0, lines, "offload", "ZeRO-Offload (issue 30)")


def _args() -> str:
    """The command line's flags without ``--out PATH`` (for the header)."""
    argv = sys.argv[1:]
    if "--out" in argv:
        i = argv.index("--out")
        argv = argv[:i] + argv[i + 2 :]
    return "".join(f" {x}" for x in argv)


def _emit(a: argparse.Namespace, load0: float, lines: list[str], tag: str, title: str) -> None:
    """Print the tables under a header line; with ``--out`` append them as a section."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"Measured by `python benchmarks/offload.py{_args()}`; {platform.node()} "
        f"({os.cpu_count()} cores, {torch.get_num_threads()} torch threads), load average "
        f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; Date: {stamp}; torch {torch.__version__}; "
        f"Python {platform.python_version()}."
    )
    text = "\n".join([head, "", *lines])
    print(text)
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(f"\n<!-- {tag}:begin -->\n## {title}\n\n{text}\n\n<!-- {tag}:end -->\n")


if __name__ == "__main__":
    main()
