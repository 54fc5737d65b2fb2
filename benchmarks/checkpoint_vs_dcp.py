"""plait checkpoints against torch.distributed.checkpoint (DCP): save and load time, bytes.

Two layouts on the same gloo ranks (a :class:`plait.testing.WorkerPool`), fp32, AdamW
after one training step (so the optimizer state exists), one torch thread per rank:

* ``dp`` — plait: a :class:`~plait.train.trainer.Trainer` at zero 0 (rank 0 writes the
  one replica); DCP: the same one-device model and AdamW on every rank, saved with
  ``dcp.save`` (its planner de-duplicates the replicated tensors).
* ``zero3`` — plait: a Trainer at zero 3 (each rank writes its flat shard and its
  optimizer state); DCP: FSDP2 ``fully_shard`` on every block, embedding, head and root,
  ``get_state_dict`` / ``dcp.save`` (each rank writes its DTensor shards).

A *save* is what a training run pays at a checkpoint: plait's :func:`save_checkpoint`
(pieces, safetensors, fsync, sha256, metadata, rename, ``latest``) against ``dcp.save``
(FileSystemWriter, fsync on). A *load* is what a resume reads once the model exists:
plait: verify the checksums, read the full weights (they go into the one-device model
before it is sharded) and this rank's optimizer state; DCP: ``dcp.load`` into the state
dict and ``set_state_dict``. Reps alternate plait / DCP (order reversed every round) with
a barrier before each; a rep's time is the slowest rank's; the table shows medians.

Run from the repository root::

    python benchmarks/checkpoint_vs_dcp.py            # print the table
    python benchmarks/checkpoint_vs_dcp.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the body by module name
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from plait.bench.results import load_average, write_section  # noqa: E402


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    return _status("VmRSS")


def _peak() -> int:
    return _status("VmHWM")


def _reset_peak() -> None:
    """Reset the peak resident size (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def bench_body(ctx: Any, layout: str, dim: int, layers: int, reps: int, tmp: str) -> Any:
    """Every rank: one step under plait and under the torch reference, then timed reps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from plait import comm
    from plait.checkpoint import (
        AsyncSaver,
        CheckpointReader,
        restore_training_state,
        save_checkpoint,
        verify_collective,
    )
    from plait.config import (
        Config,
        DataConfig,
        LogConfig,
        ModelConfig,
        ParallelConfig,
        TrainConfig,
    )
    from plait.model.transformer import Transformer, lm_loss
    from plait.train.trainer import Trainer

    torch.set_num_threads(1)
    mesh = ctx.mesh()
    g = mesh.world()
    model_cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=4, max_seq_len=64)
    cfg = Config(
        model=model_cfg,
        parallel=ParallelConfig(zero=3 if layout == "zero3" else 0),
        train=TrainConfig(steps=1, global_batch=8, seq_len=64, eval_every=0, eval_batches=1),
        data=DataConfig(max_bytes=200_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )
    tr = Trainer(cfg, mesh, show_progress=False)
    tr.train_step(0)
    ref = Transformer(model_cfg, seed=0)
    if layout == "zero3":
        dmesh = DeviceMesh.from_group(mesh.axis("dp").pg, "cpu")
        for m in [ref.tok_embeddings, *ref.layers, ref.output]:
            fully_shard(m, mesh=dmesh)
        fully_shard(ref, mesh=dmesh)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x, y = tr.train_set.batch(tr.sampler.micro_batches(0, tr.micro_batch)[0])
    lm_loss(ref(x), y).backward()
    opt.step()
    root = Path(tmp)
    times: dict[str, list[float]] = {
        "plait save": [],
        "dcp save": [],
        "plait load": [],
        "dcp load": [],
        "sync stall": [],
        "async stall": [],
    }
    peaks: dict[str, list[float]] = {"plait load": [], "dcp load": []}
    cpu: dict[str, list[float]] = {name: [] for name in times}

    def timed(name: str, fn: Any) -> None:
        comm.barrier(g)
        rss0 = _rss()
        _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
        if name in peaks:
            peaks[name].append(_peak() - rss0)

    trusted: set[str] = set()  # as in training: folders this run wrote are not re-hashed

    def plait_save(k: int) -> None:
        save_checkpoint(tr.state, root / "plait", k, keep=1, trusted=trusted)

    def dcp_save(k: int) -> None:
        msd, osd = get_state_dict(ref, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp" / str(k)))

    def plait_load(k: int) -> None:
        folder = root / "plait" / f"step_{k:08d}"
        # what a resume does: checksums once per file per host, then each rank's pieces
        reader = CheckpointReader(folder, verify=False)
        verify_collective(folder, reader.meta, mesh)
        restore_training_state(tr.state, reader)

    def dcp_load(k: int) -> None:
        msd, osd = get_state_dict(ref, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(root / "dcp" / str(k)))
        set_state_dict(ref, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    saver = AsyncSaver(mesh, root / "async", keep=1)

    def stalls(k: int) -> None:
        """The training thread's stall per save: sync (the whole save) vs async (wait
        for nothing in flight, one agreement, the copy to host memory)."""
        timed("sync stall", lambda: save_checkpoint(tr.state, root / "sync", k, 1, trusted=trusted))
        timed("async stall", lambda: saver.save(tr.state, k, None, (), trusted))
        saver.wait()  # untimed: the writer's work, off the training thread

    for k in range(1, reps + 2):  # rep 1 warms up (file cache, imports) and is dropped
        order = [("plait", plait_save, plait_load), ("dcp", dcp_save, dcp_load)]
        if k % 2:
            order.reverse()
        for name, save, load in order:
            timed(f"{name} save", lambda s=save, k=k: s(k))
            timed(f"{name} load", lambda ld=load, k=k: ld(k))
        stalls(k)
        if ctx.rank == 0 and k > 1:
            shutil.rmtree(root / "dcp" / str(k - 1), ignore_errors=True)
    dist.barrier()
    out: dict[str, Any] = {name: v[1:] for name, v in times.items()}
    out["cpu"] = {name: v[1:] for name, v in cpu.items()}
    out["peaks"] = {name: max(v[1:]) for name, v in peaks.items()}
    out["state bytes"] = sum(
        (p.end - p.start) * 4 * 3 for p in tr.optimizer.local_pieces()
    )  # this rank's fp32 values + AdamW moments
    if ctx.rank == 0:
        out["plait bytes"] = _dir_bytes(root / "plait" / f"step_{reps + 1:08d}")
        out["dcp bytes"] = _dir_bytes(root / "dcp" / str(reps + 1))
    return out


def _table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| layout | plait save ms | DCP save ms | ratio (cpu) | plait load ms | DCP load ms "
        "| ratio (cpu) | plait MB | DCP MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, r in rows:
        ps, ds, pl, dl = (r[k] for k in ("plait save", "dcp save", "plait load", "dcp load"))
        c = r["cpu"]
        lines.append(
            f"| {layout} | {ps:.0f} | {ds:.0f} | {ps / ds:.2f} "
            f"({c['plait save'] / c['dcp save']:.2f}) | {pl:.0f} | {dl:.0f} | "
            f"{pl / dl:.2f} ({c['plait load'] / c['dcp load']:.2f}) | "
            f"{r['plait bytes'] / 1e6:.1f} | {r['dcp bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def _memory_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| layout | state per rank MB | plait load peak extra MB | DCP load peak extra MB "
        "| sync save stall ms | async save stall ms |",
        "|---|---|---|---|---|---|",
    ]
    for layout, r in rows:
        stall = f"{r['async stall']:.0f}" if r["async stall"] == r["async stall"] else "-"
        lines.append(
            f"| {layout} | {r['state bytes'] / 1e6:.1f} | {r['peak plait'] / 1e6:.1f} | "
            f"{r['peak dcp'] / 1e6:.1f} | {r['sync stall']:.0f} | {stall} |"
        )
    return "\n".join(lines)


def _run(world: int, args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    from plait.testing.pool import WorkerPool

    rows = []
    keys = ("plait save", "dcp save", "plait load", "dcp load", "sync stall", "async stall")
    with WorkerPool(world, comm_timeout_s=600) as pool:
        for layout in ("dp", "zero3"):
            tmp = tempfile.mkdtemp(prefix="plait-ckbench-")
            try:
                res = pool.run(
                    "benchmarks.checkpoint_vs_dcp:bench_body",
                    layout,
                    args.dim,
                    args.layers,
                    args.reps,
                    tmp,
                    timeout_s=1800,
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

            def med(series: list[list[float]]) -> float:
                if not series[0]:
                    return float("nan")
                return statistics.median(max(r[i] for r in series) for i in range(args.reps))

            slowest: dict[str, Any] = {k: med([r[k] for r in res]) * 1000 for k in keys}
            slowest["cpu"] = {k: med([r["cpu"][k] for r in res]) * 1000 for k in keys[:4]}
            slowest["plait bytes"] = res[0]["plait bytes"]
            slowest["dcp bytes"] = res[0]["dcp bytes"]
            slowest["peak plait"] = max(r["peaks"]["plait load"] for r in res)
            slowest["peak dcp"] = max(r["peaks"]["dcp load"] for r in res)
            slowest["state bytes"] = max(r["state bytes"] for r in res)
            rows.append((f"{layout} x{world}", slowest))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="rewrite this benchmark's section")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = p.parse_args(argv)
    if args.tiny:
        args.world, args.dim, args.layers, args.reps = [2], 32, 1, 1

    from plait.arch import param_count
    from plait.config import ModelConfig

    params = param_count(ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4))
    load0 = load_average()
    rows = [row for world in args.world for row in _run(world, args)]
    load1 = load_average()
    table = _table(rows)
    memory = _memory_table(rows)
    print(table)
    print()
    print(memory)
    if args.out is not None:
        section = (
            "## Checkpoints vs torch.distributed.checkpoint (issues 7, 19)\n\n"
            f"plait's sharded checkpoint against DCP (`dcp.save`/`dcp.load`, FSDP2 for "
            f"zero3) on the same gloo ranks: {params / 1e6:.2f} M parameters + AdamW state "
            f"(fp32), median of {args.reps} reps, slowest rank; ratio = plait / DCP "
            f"(< 1: plait faster), wall time with the CPU-time ratio in brackets. Written by "
            f"`python benchmarks/checkpoint_vs_dcp.py --out benchmarks/RESULTS.md` on "
            f"{datetime.date.today()}, CPU, {' and '.join(map(str, args.world))} ranks, "
            f"taken UNDER LOAD (other engineers' jobs on the 2 cores; load average "
            f"{load0:.1f} before, {load1:.1f} after).\n\n{table}\n\n"
            "A plait save hashes every file (sha256) and renames the folder into place "
            "before replacing `latest`; a plait load checks each file's sha256 once per "
            "host (the host's ranks split the files) and then reads exactly the byte "
            "ranges of the rank's own pieces (weights and optimizer state), which DCP "
            "does not checksum.\n\n"
            "Memory and stalls: *state per rank* is the rank's own fp32 values and AdamW "
            "moments; *load peak extra* is the peak resident size during the load minus "
            "the resident size before it (Linux `VmHWM`, reset through "
            "`/proc/self/clear_refs`), largest rank, largest rep; *stall* is how long "
            "the training thread is held per save: synchronous (the whole save) vs "
            "`train.async_checkpoint` (one agreement and the copy to host memory; the "
            "writer thread does the rest while training continues).\n\n"
            f"{memory}"
        )
        write_section(args.out, "checkpoint_vs_dcp", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
