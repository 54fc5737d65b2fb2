"""plait's eager mixed-precision step against a plain PyTorch loop on the same model.

One process, one device, plait's built-in ``Transformer``, the same batch every step:

* **plain**: fp32 parameters, forward under ``torch.autocast(bf16)``, the fp32 loss,
  ``backward``, ``clip_grad_norm_`` (foreach) and ``torch.optim.AdamW(fused=True)``;
* **plait**: ``parallelize(model, mesh, precision="bf16")`` (bf16 parameters, fp32
  master weights held by the optimizer), :class:`plait.optim.Optimizer` around the
  trainer's AdamW (``make_optimizer``) with the same clipping: ``pm.step``,
  ``opt.step``, ``opt.zero_grad``;
* **plait, AdamW default kernel**: the same with ``torch.optim.AdamW``'s default kernel
  (what plait's trainer used before: on the CPU a Python loop over parameters).

Each is timed for ``--steps`` steps after ``--warmup`` steps; the table gives the median
wall and CPU time per step and plait's ratio (plain / plait: >= 1.00 means plait is no
slower). With
``--profile`` it also prints the top operators of a few plait steps
(``torch.profiler``, CPU time, self time). ``--dtype fp32`` compares the fp32 paths
(no autocast, no masters).

Run from the repository root::

    python benchmarks/eager_step.py                 # CPU, small model
    python benchmarks/eager_step.py --device cuda --dim 2048 --layers 16 --seq 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
    )
    return Transformer(cfg, seed=0).to(args.device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(
    steps: dict[str, Callable[[], float]], args: argparse.Namespace
) -> dict[str, tuple[float, float, float]]:
    """(median wall seconds, median CPU seconds of this process, last loss) per step of
    each loop after ``args.warmup`` untimed steps. The loops take turns step by step, so
    a change in the machine's load hits them alike; on a shared CPU the process's CPU
    time is the steadier measure."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    loss: dict[str, float] = {}
    for _ in range(args.steps):
        for name, step in steps.items():
            _sync(args.device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss[name] = step()
            _sync(args.device)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = statistics.median
    return {name: (med(wall[name]), med(cpu[name]), loss[name]) for name in steps}


def plain_step(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    """The plain loop's step (autocast when ``--dtype bf16``)."""
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    low = args.dtype == "bf16"
    dev = torch.device(args.device).type

    def step() -> float:
        with torch.autocast(dev, torch.bfloat16, enabled=low):
            logits = model(x)  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


def plait_step(
    args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, default_kernel: bool = False
) -> Callable[[], float]:
    """plait's step: ``parallelize`` on a one-rank mesh, the trainer's optimizer
    (``default_kernel``: torch's default AdamW kernel instead, as plait had before)."""
    from plait import init_mesh
    from plait.config import Config, TrainConfig
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize
    from plait.train.start import make_optimizer

    mesh = init_mesh(device=args.device)
    pm = parallelize(_model(args), mesh, precision=args.dtype)
    cfg = Config(train=TrainConfig(lr=1e-4, weight_decay=0.0, warmup_steps=0))
    inner = (
        torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.0)
        if default_kernel
        else make_optimizer(pm, cfg)
    )
    opt = Optimizer(pm, inner, max_norm=1.0)

    def step() -> float:
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    return step


def profile(step: Callable[[], float], rows: int) -> None:
    """Print the top operators (self CPU time) of 3 steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def optimizer_kernels(args: argparse.Namespace) -> None:
    """Print the CPU time of one AdamW step alone over the model's parameters (fp32,
    as the masters are) with torch's default kernel, ``foreach`` and ``fused``."""
    print("| AdamW kernel (optimizer step alone) | CPU (ms) | default / this |")
    print("|---|---:|---:|")
    base = 0.0
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [torch.nn.Parameter(p.detach().float()) for p in _model(args).parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)  # type: ignore[arg-type]
        times = []
        for i in range(args.warmup + args.steps):
            _sync(args.device)
            c0 = time.process_time()
            opt.step()
            _sync(args.device)
            if i >= args.warmup:
                times.append(time.process_time() - c0)
        sec = statistics.median(times)
        base = base or sec
        print(f"| {name} | {sec * 1e3:.2f} | {base / sec:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print plait's top operators")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op CPU threads (default 1: on a shared CPU, OpenMP threads that spin "
        "while waiting for a core make every timing erratic)",
    )
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args()
    if args.tiny:
        args.dim, args.layers, args.heads, args.vocab, args.seq, args.batch = 32, 1, 2, 64, 16, 1
        args.steps, args.warmup = 1, 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    steps = {
        "plain": plain_step(args, x, y),
        "plait": plait_step(args, x, y),
        "plait, AdamW default kernel": plait_step(args, x, y, default_kernel=True),
    }
    if args.profile:
        for name, s in steps.items():
            print(f"--- {name}: top operators of 3 steps")
            profile(s, 25)
    res = _time(steps, args)
    tokens = args.batch * args.seq
    print(
        f"device {args.device} ({args.threads} CPU threads), torch {torch.__version__}, "
        f"{args.dtype}, dim {args.dim}, "
        f"{args.layers} layers, seq {args.seq}, batch {args.batch}, median of {args.steps}"
    )
    print("| loop | step (ms) | tokens/s | CPU (ms) | loss | plain / this (wall, CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    base, base_cpu = res["plain"][0], res["plain"][1]
    for name, (sec, cpu, loss) in res.items():
        print(
            f"| {name} | {sec * 1e3:.1f} | {tokens / sec:,.0f} | {cpu * 1e3:.1f} | "
            f"{loss:.4f} | {base / sec:.2f}, {base_cpu / cpu:.2f} |"
        )
    print()
    optimizer_kernels(args)


if __name__ == "__main__":
    main()
