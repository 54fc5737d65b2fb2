"""The planner's predictions for the rows ``benchmarks/gpu_all.py`` measures.

``plait plan --json`` (pure arithmetic) for the 0.89 B step of ``gpu_step.py`` (plait's
eager step: bf16-mixed, one device, seq 2048 x batch 4) and the 7B ZeRO-2 + optimizer
offload run of ``offload.py`` (global batch 16 as 1 x 16 accumulation, full
recomputation), against the hardware profile ``--profile`` (what ``plait bench
calibrate --device cuda`` wrote in the same run; the built-in preset when the file is
missing). One JSON object a line: the row, predicted memory, step time, tokens/s, MFU.
Compare them with the measured rows in ``table.md`` (the planner's GPU target: +-15 %).

    python benchmarks/gpu_plan_rows.py --profile gpu_out/calibration.toml
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from plait.cli.plan import plan_main  # noqa: E402

SHAPE_089B = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--kv-heads", "8"]
SHAPE_089B += ["--ffn", "5632", "--vocab", "32000"]
SHAPE_7B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "11008"]
SHAPE_7B += ["--vocab", "32000"]
PREDICTIONS = {
    "step_plait_eager": [
        *SHAPE_089B,
        "--seq-len",
        "2048",
        "--global-batch",
        "4",
        "--micro-batch",
        "4",
        "--precision",
        "bf16-mixed",
    ],
    "offload_7b": [
        *SHAPE_7B,
        "--seq-len",
        "2048",
        "--global-batch",
        "16",
        "--micro-batch",
        "1",
        "--zero",
        "2",
        "--offload",
        "optimizer",
        "--recompute",
        "full",
        "--precision",
        "bf16-mixed",
    ],
}


def predict(args: list[str]) -> dict[str, Any]:
    """``plait plan --json ARGS`` on one device, parsed."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = plan_main([*args, "--devices", "1", "--json"])
    if code:
        raise SystemExit(f"gpu_plan_rows: plait plan {' '.join(args)} exited {code}")
    return json.loads(buf.getvalue())  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=None, help="hardware profile (TOML) to predict with")
    p.add_argument("--jsonl", default=None, help="append one JSON object a row here")
    a = p.parse_args()
    hw = ["--hardware", a.profile] if a.profile and Path(a.profile).exists() else []
    print("| row | hardware | memory GiB | step s | tokens/s | MFU |")
    print("|---|---|---:|---:|---:|---:|")
    for name, args in PREDICTIONS.items():
        got = predict([*args, *hw])
        mem, step = float(got["memory_bytes"]["total"]), float(got["time_s"]["total"])
        row = {
            "row": name,
            "hardware": got["hardware"],
            "memory_bytes": mem,
            "step_s": step,
            "tokens_per_s": got["tokens_per_s"],
            "mfu": got["mfu"],
        }
        print(
            f"| {name} | {got['hardware']} | {mem / 2**30:.1f} | {step:.3f} | "
            f"{float(got['tokens_per_s']):,.0f} | {100 * float(got['mfu']):.1f} % |",
            flush=True,
        )
        if a.jsonl:
            with open(a.jsonl, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
