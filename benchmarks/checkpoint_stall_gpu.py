"""Checkpoint stall per save on one CUDA device: synchronous vs ``train.async_checkpoint``.

One process, one GPU, a transformer of about ``--dim``/``--layers`` size in fp32 with
AdamW state (so a save writes 12 bytes per parameter). For each save: the *stall* is the
time the training thread is held (sync: the whole save; async: the copy to host memory
and one agreement), and for async also the time of the training step run while the
writer works (against a step with no writer). It then checks on the GPU that a run
saving asynchronously resumes bit-exactly through the rank-local loader (weights read
into CUDA tensors through the bounded buffer).

Run from the repository root on a CUDA machine::

    python benchmarks/checkpoint_stall_gpu.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _config(dim: int, layers: int, root: str | None = None, **train: object) -> object:
    from plait.config import Config, DataConfig, LogConfig, ModelConfig, TrainConfig

    t = TrainConfig(steps=4, global_batch=8, seq_len=128, eval_every=0, eval_batches=1)
    for k, v in train.items():
        setattr(t, k, v)
    if root is not None:
        t.checkpoint_dir = root
    return Config(
        model=ModelConfig(dim=dim, n_layers=layers, n_heads=16, max_seq_len=128),
        train=t,
        data=DataConfig(max_bytes=400_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )


def stalls(dim: int, layers: int, saves: int) -> None:
    from plait import init_mesh
    from plait.checkpoint import AsyncSaver, save_checkpoint
    from plait.train.trainer import Trainer

    mesh = init_mesh(device=DEVICE)
    tr = Trainer(_config(dim, layers), mesh, show_progress=False)  # type: ignore[arg-type]
    tr.train_step(0)
    params = sum(p.numel() for p in tr.base.parameters())
    root = Path(tempfile.mkdtemp(prefix="plait-stall-"))
    trusted: set[str] = set()

    def step(k: int) -> float:
        _sync()
        t0 = time.perf_counter()
        tr.train_step(k)
        _sync()
        return time.perf_counter() - t0

    plain = [step(k) for k in range(1, 4)]
    sync, asyn, during = [], [], []
    saver = AsyncSaver(mesh, root / "async", keep=1)
    for k in range(1, saves + 1):
        _sync()
        t0 = time.perf_counter()
        save_checkpoint(tr.state, root / "sync", k, keep=1, trusted=trusted)
        sync.append(time.perf_counter() - t0)
        _sync()
        t0 = time.perf_counter()
        saver.save(tr.state, k, None, (), trusted)
        asyn.append(time.perf_counter() - t0)
        during.append(step(3 + k))  # a training step while the writer runs
        saver.wait()
    ms = lambda v: statistics.median(v) * 1000  # noqa: E731
    gb = params * 12 / 1e9
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{name}: {params / 1e6:.0f} M params, {gb:.2f} GB per save")
    print("| save | stall per save ms | step ms while writing (plain step ms) |")
    print("|---|---|---|")
    print(f"| sync | {ms(sync):.0f} | - ({ms(plain):.0f}) |")
    print(f"| async | {ms(asyn):.0f} | {ms(during):.0f} ({ms(plain):.0f}) |")


def resume_check(dim: int = 256, layers: int = 2) -> None:
    from plait import init_mesh
    from plait.checkpoint import step_dirname
    from plait.train.trainer import Trainer

    root = tempfile.mkdtemp(prefix="plait-async-")
    kw = {"async_checkpoint": True, "checkpoint_every": 2}
    full = Trainer(_config(dim, layers, root, **kw), init_mesh(device=DEVICE), False)  # type: ignore[arg-type]
    losses = full.run().losses
    ck = str(Path(root) / step_dirname(2))
    again = Trainer(
        _config(dim, layers, root, resume=ck, **kw), init_mesh(device=DEVICE), False  # type: ignore[arg-type]
    )
    assert again.start_step == 2
    rest = again.run().losses
    exact = rest == losses[2:]
    close = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(rest, losses[2:], strict=True))
    print(f"async resume on {DEVICE}: bit-exact {exact}, within rtol 1e-5 {close} "
          f"(resumed {rest}, uninterrupted {losses[2:]})")
    assert close


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = p.parse_args()
    if args.tiny:  # runs on the CPU too (--device cpu)
        args.dim, args.layers, args.saves = 32, 1, 1
    global DEVICE
    DEVICE = args.device
    resume_check(*((32, 1) if args.tiny else ()))
    stalls(args.dim, args.layers, args.saves)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
