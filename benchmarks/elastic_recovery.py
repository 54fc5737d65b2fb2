"""Elastic recovery: a rank SIGKILLed for good, the job shrinks (``--nproc 3:4``).

The same ``plait train`` (dp4, small model: dim 64, 2 layers, sequences of 64, global
batch 12, one torch thread per rank) runs twice through plait's elastic launcher, with
rank 2 SIGKILLing itself on entering step KILL of the first world
(``tests/launch/elastic_entry.py``):

* ``memory``: copies in the ranks' host memory every 2 steps
  (``train.memory_checkpoint_every 2``), no disk checkpoint before the kill;
* ``disk``: a disk checkpoint every 2 steps (``train.checkpoint_every 2``), no copies.

Both resume on dp3 from step KILL - 1 (no step lost). A watcher stamps each step's
metrics row. *Detection*: from rank 0's last row before the kill to the launcher's
decision (the ``detected ... s after its last step`` of its one-line report: the agent
sees the death, stops the survivors, reports). *Recovery*: from the decision to the
first step after the resume (replan, assemble the copies or read the disk checkpoint,
start 3 ranks, rendezvous, build, load, reshard, one step), i.e. the gap between the two
rows minus detection minus one steady step. Ratios are memory against disk in one run.

Run from the repository root::

    python benchmarks/elastic_recovery.py
    python benchmarks/elastic_recovery.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from plait.bench.step_stamps import watch_rows

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "tests" / "launch" / "elastic_entry.py"
RUN = [
    *["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"],
    *["--model.max_seq_len", "64", "--seq-len", "64", "--global-batch", "12"],
    *["--data.max_bytes", "300000", "--train.eval_every", "0", "--train.eval_batches", "1"],
    *["--progress", "none", "--log.peak_tflops", "1", "--launch.threads", "1"],
]
SOURCES = {
    "memory": ["--train.memory_checkpoint_every", "2"],
    "disk": ["--train.checkpoint_every", "2", "--train.checkpoint_dir", "ck"],
}
DETECTED = re.compile(r"detected ([0-9.]+) s after its last step")


def measure(
    source: str, steps: int, kill: int, world: int, env: dict[str, str]
) -> dict[str, Any]:
    """One killed run of ``world`` ranks; its detection and recovery seconds and its line."""
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as d:
        tmp = Path(d)
        cmd = [sys.executable, str(ENTRY), "2", str(kill), "train", "--nproc",
               f"{world - 1}:{world}", *RUN, "--steps", str(steps), "--metrics", "m.jsonl",
               *SOURCES[source]]  # fmt: skip
        stamps: dict[int, float] = {}
        done = threading.Event()
        w = threading.Thread(target=watch_rows, args=(tmp / "m.jsonl", stamps, done), daemon=True)
        w.start()
        r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False)
        time.sleep(0.05)
        done.set()
        w.join()
        if r.returncode != 0:
            raise SystemExit(f"{source} run failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        rows = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("plait: elastic:"))
    want = "from the memory copies" if source == "memory" else "from the disk checkpoint"
    if want not in line or [row["step"] for row in rows] != list(range(1, steps + 1)):
        raise SystemExit(f"{source} run did not resume {want} or lost rows:\n{r.stdout[-2000:]}")
    m = DETECTED.search(line)
    detect = float(m.group(1)) if m else float("nan")
    step_s = statistics.median(row["step_seconds"] for row in rows[1:] or rows)
    gap = stamps[kill] - stamps[kill - 1]
    lost = int(re.search(r"\((\d+) step\(s\)", line).group(1))  # type: ignore[union-attr]
    return {"source": source, "detect": detect, "recover": gap - detect - step_s,
            "gap": gap, "step": step_s, "lost": lost, "line": line}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from plait.bench.results import command_line, environment, load_average, write_section

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the table into this RESULTS.md")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill", type=int, default=7, help="1-based step rank 2 dies entering")
    p.add_argument("--world", type=int, default=4, help="ranks at the start (one is lost)")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = p.parse_args(argv)
    if args.tiny:  # 3 -> 2 ranks, the kill right after the first copy / save
        args.steps, args.kill, args.world = 3, 3, 3
    path = os.pathsep.join(
        x for x in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x
    )
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    load0, t0 = load_average(), time.perf_counter()
    rows = [measure(s, args.steps, args.kill, args.world, env) for s in SOURCES]
    shrink = f"{args.world} -> {args.world - 1}"
    disk = rows[1]
    lines = [
        "## Elastic recovery: a rank lost for good, memory copies vs disk (issue 43)",
        "",
        "| recovery from | ranks | detection s | recovery s | x disk | steps lost | "
        "kill-to-next-step s | steady step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {shrink} | {r['detect']:.2f} | {r['recover']:.2f} | "
            f"{r['recover'] / disk['recover']:.2f} | {r['lost']} | {r['gap']:.2f} | "
            f"{1000 * r['step']:.1f} |"
        )
    lines += [
        "",
        f"- {environment()}; {os.cpu_count()} cores; gloo on loopback; one torch thread per rank.",
        f"- Command: `{command_line(__file__)}` ({time.perf_counter() - t0:.0f} s).",
        f"- Load average (1 min) {load0:.1f} at the start and {load_average():.1f} at the end "
        "on 2 cores shared with other jobs: absolute times are noisy.",
        f"- Model: dim 64, 2 layers, sequences of 64, global batch 12; dp{args.world}, then "
        f"dp{args.world - 1} (the shrink line gives the micro-batch and accumulation); "
        f"{args.steps} steps, rank 2 SIGKILLed entering step {args.kill}.",
        "- Detection: the launcher's own figure (rank 0's last metrics row to its decision). "
        "Recovery: the decision to the end of the first step after the resume, minus one "
        "steady step (new world's start, rendezvous, build, load and reshard, the step).",
        f"- memory: `{rows[0]['line']}`",
        f"- disk: `{disk['line']}`",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_section(args.out, "elastic_recovery", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
