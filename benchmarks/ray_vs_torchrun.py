"""Ray vs ``--nproc`` / torchrun: start-up to the first step, steady step time, recovery.

Each launcher runs the same ``plait train`` (dp = world, one torch thread per rank, a
small model: dim 64, 2 layers, sequences of 64 tokens, global batch 16) in a fresh
process, at 2 and 4 ranks:

* ``nproc``: ``python -m plait train --nproc N`` (plait's launcher: torch's elastic agent);
* ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N -m plait
  train``;
* ``ray``: ``python -m plait train --ray --nproc N`` (a private local Ray instance: its
  ``ray.init`` is part of the start-up).

A watcher thread stamps the moment each step's metrics row appears. *Start-up* is
launch to the first step's row; *step* is the median of the ranks' own step times after
the first (``step_seconds``); ratios are against ``nproc`` in the same script run.
*Recovery*: rank 1 SIGKILLs itself on entering step 7 of the first attempt (checkpoints
every 2 steps), under ``torchrun --max-restarts 1`` (``tests/train/fault_entry.py``) and
under ``--ray --launch.max_restarts 1`` (Ray started with ``tests/launch/ray_faults.py``
as its worker setup hook); recovery is the time from the row of step 6 (the kill follows
at once) to the row of step 7 after the resume, minus one steady step. ``--nproc`` has no
restarts (``launch.max_restarts`` is for Ray; torchrun brings its own). A reference row
times Ray Train's ``TorchTrainer`` with 2 workers running an empty function (ray.init
excluded), the alternative this backend was measured against.

Run from the repository root::

    python benchmarks/ray_vs_torchrun.py                       # print the table
    python benchmarks/ray_vs_torchrun.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plait.bench.step_stamps import watch_rows  # noqa: E402  (after the path)

RUN = [
    *["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"],
    *["--model.max_seq_len", "64", "--seq-len", "64", "--global-batch", "16"],
    *["--data.max_bytes", "300000", "--train.eval_every", "0", "--train.eval_batches", "1"],
    *["--progress", "none", "--log.peak_tflops", "1", "--launch.threads", "1"],
]
STEPS, KILL_STEP = 12, 7
RAY_WITH_HOOK = (
    "import json, logging, os, shutil, sys\n"
    "import ray\n"
    "from plait.launch.ray_session import short_temp_dir\n"
    "d = short_temp_dir()\n"
    "ray.init(num_cpus=max(4, os.cpu_count()), _temp_dir=str(d),\n"
    "         include_dashboard=False, logging_level=logging.WARNING,\n"
    "         runtime_env={'worker_process_setup_hook': 'tests.launch.ray_faults.install',\n"
    "                      'env_vars': {'PLAIT_TEST_KILL': sys.argv[1],\n"
    "                                   'PYTHONPATH': os.environ['PYTHONPATH']}})\n"
    "from plait.cli import main\n"
    "code = main(sys.argv[2:])\n"
    "ray.shutdown()\n"
    "shutil.rmtree(d, ignore_errors=True)\n"
    "sys.exit(code)\n"
)


def _run(cmd: list[str], tmp: Path, env: dict[str, str]) -> tuple[float, dict[int, float], list]:
    metrics = tmp / "m.jsonl"
    stamps: dict[int, float] = {}
    done = threading.Event()
    w = threading.Thread(target=watch_rows, args=(metrics, stamps, done), daemon=True)
    w.start()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False)
    time.sleep(0.05)
    done.set()
    w.join()
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return t0, stamps, rows


def _cmd(launcher: str, world: int, extra: list[str], steps: int = STEPS) -> list[str]:
    flags = [*RUN, "--steps", str(steps), "--metrics", "m.jsonl", *extra]
    py = sys.executable
    if launcher == "nproc":
        return [py, "-m", "plait", "train", "--nproc", str(world), *flags]
    if launcher == "ray":
        return [py, "-m", "plait", "train", "--ray", "--nproc", str(world), *flags]
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            "-m", "plait", "train", *flags]  # fmt: skip


def measure(launcher: str, world: int, env: dict[str, str], steps: int = STEPS) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as d:
        t0, stamps, rows = _run(_cmd(launcher, world, [], steps), Path(d), env)
    steps = [r["step_seconds"] for r in rows[1:]]
    return {"startup": stamps[1] - t0, "step": statistics.median(steps)}


def recovery(launcher: str, world: int, env: dict[str, str], step_s: float) -> float:
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as d:
        tmp = Path(d)
        ck = ["--train.checkpoint_every", "2", "--train.checkpoint_dir", "ck"]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(world), "--max-restarts", "1",
                   "--monitor-interval", "0.1", str(ROOT / "tests/train/fault_entry.py"),
                   "1", str(KILL_STEP), *RUN, "--steps", str(STEPS), "--metrics", "m.jsonl",
                   *ck]  # fmt: skip
        else:
            control = tmp / "kill.json"
            control.write_text(json.dumps({"rank": 1, "step": KILL_STEP}))
            cmd = [sys.executable, "-c", RAY_WITH_HOOK, str(control), "train", "--ray",
                   "--nproc", str(world), "--launch.max_restarts", "1", *RUN, "--steps",
                   str(STEPS), "--metrics", "m.jsonl", *ck]  # fmt: skip
        _, stamps, rows = _run(cmd, tmp, env)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return stamps[KILL_STEP] - stamps[KILL_STEP - 1] - step_s


def torchtrainer_startup(env: dict[str, str]) -> float:
    code = (
        "import logging, os, shutil, time, ray\n"
        "from ray.train import RunConfig, ScalingConfig\n"
        "from ray.train.torch import TorchTrainer\n"
        "from plait.launch.ray_session import short_temp_dir\n"
        "d = short_temp_dir()\n"
        "ray.init(num_cpus=max(4, os.cpu_count()), _temp_dir=str(d), include_dashboard=False,"
        " logging_level=logging.WARNING)\n"
        "def f(config):\n    pass\n"
        "t = time.perf_counter()\n"
        "TorchTrainer(f, scaling_config=ScalingConfig(num_workers=2, resources_per_worker="
        "{'CPU': 1}, placement_strategy='PACK'), run_config=RunConfig(storage_path=str(d) + "
        "'/train', name='bench')).fit()\n"
        "print('SECONDS', time.perf_counter() - t)\n"
        "ray.shutdown()\n"
        "shutil.rmtree(d, ignore_errors=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise SystemExit(f"TorchTrainer reference failed:\n{r.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    from plait.bench.results import command_line, environment, load_average, write_section

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the table into this RESULTS.md")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--no-torchtrainer", action="store_true", help="skip the reference row")
    p.add_argument("--launchers", nargs="+", default=["nproc", "torchrun", "ray"])
    p.add_argument("--steps", type=int, default=STEPS, help="steps of a start-up/step run")
    p.add_argument("--no-recovery", action="store_true", help="skip the killed-rank runs")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = p.parse_args(argv)
    if args.tiny:  # --nproc vs torchrun at 2 ranks, 3 steps; Ray's runs are the tests'
        args.worlds, args.launchers, args.steps = [2], ["nproc", "torchrun"], 3
        args.no_recovery = args.no_torchtrainer = True
    path = os.pathsep.join(
        x for x in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x
    )
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               RAY_AUTH_MODE="disabled")  # fmt: skip
    load0, t_start = load_average(), time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        base: dict[str, float] = {}
        for launcher in args.launchers:
            m = measure(launcher, world, env, args.steps)
            base = base or m
            restarts = launcher != "nproc" and not args.no_recovery
            rec = recovery(launcher, world, env, m["step"]) if restarts else None
            rows.append({"launcher": launcher, "world": world, **m, "recovery": rec,
                         "r_start": m["startup"] / base["startup"],
                         "r_step": m["step"] / base["step"]})  # fmt: skip
            print(rows[-1], flush=True)
    tt = None if args.no_torchtrainer else torchtrainer_startup(env)
    lines = [
        "## Ray vs --nproc / torchrun: start-up, step time, recovery (issue 17)",
        "",
        "| launcher | ranks | start-up to step 1 s | x nproc | steady step ms | x nproc "
        "| recovery s (kill to first step after resume) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rec = "not measured" if r["recovery"] is None else f"{r['recovery']:.1f}"
        if r["launcher"] == "nproc":
            rec = "no restarts"
        lines.append(
            f"| {r['launcher']} | {r['world']} | {r['startup']:.1f} | {r['r_start']:.2f} | "
            f"{1000 * r['step']:.1f} | {r['r_step']:.2f} | {rec} |"
        )
    if tt is not None:
        lines.append(
            f"| Ray Train TorchTrainer, empty function (reference) | 2 | {tt:.1f} (fit() only, "
            "ray.init excluded) | | | | |"
        )
    lines += [
        "",
        f"- {environment()}; {os.cpu_count()} cores; gloo on loopback; one torch thread per rank.",
        f"- Command: `{command_line(__file__)}` ({time.perf_counter() - t_start:.0f} s).",
        f"- Load average (1 min) {load0:.1f} at the start and {load_average():.1f} at the end "
        "on 2 cores shared with other jobs: absolute times are noisy; the ratios compare "
        "launchers within one run.",
        "- Model: dim 64, 2 layers, 4 heads, sequences of 64, global batch 16, dp = ranks, "
        f"{args.steps} steps; start-up includes imports, rendezvous, building the model and data "
        "and the first step (and `ray.init` of a private local instance for ray).",
        f"- Recovery: rank 1 SIGKILLs itself entering step {KILL_STEP} (checkpoint every 2 "
        "steps: resume from step 6); time from step 6's metrics row to step 7's after the "
        "resume, minus one steady step: failure detection, teardown, restart of every rank, "
        "rendezvous, checkpoint load.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_section(args.out, "ray_vs_torchrun", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
