"""Does compressed training converge? ``plait train --nproc 2 --dp 2`` on the built-in
corpus (the default model, AdamW, the default learning-rate schedule) with each
compression method, at 60 and at 500 steps.

Per method and run length: the mean loss of the last 5 steps as a ratio to the
uncompressed run of the same length, and the dp bytes per step averaged over the whole
run (plait's comm counters, as the metrics JSONL records them) as a ratio to the
uncompressed run's: top-k's sparsity warm-up sends more in its first steps, and this
average includes them. Every run is a separate ``plait train`` process pair with the
same seed, so the runs see the same batches from the same initial weights. Top-k runs
with Adam's moments before the sparsification (``parallel.compression_adam = before``,
the default) and after it (error feedback on the raw gradient), picking per tensor (the
default) or with one top-k over each bucket (``parallel.compression_topk_scope``), with
or without the residual's signs (``parallel.compression_topk_sign_every``).

Run from the repository root::

    python benchmarks/compression_convergence.py                  # print the table
    python benchmarks/compression_convergence.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from plait.bench.results import command_line, environment, load_average, write_section  # noqa: E402

TINY_FLAGS = [
    *["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2"],
    *["--model.max_seq_len", "16", "--seq-len", "16", "--global-batch", "4"],
    *["--data.max_bytes", "100000", "--train.eval_every", "0", "--log.peak_tflops", "1"],
]
"""``--tiny``: the ``plait train`` flags of a seconds-long run (the test suite's)."""

WARMUP_FRACTION = 0.1
"""Top-k's sparsity warm-up as a fraction of the run (DGC: 4 of 90 epochs, about 5 %)."""


def methods(steps: int) -> dict[str, list[str]]:
    """Label -> the ``plait train`` flags of each method, for a run of ``steps``."""
    warm = max(1, round(WARMUP_FRACTION * steps))
    out: dict[str, list[str]] = {"none": []}
    if steps <= 100:  # bf16 is a rounding, not a delay: its short-run figure says it all
        out["bf16"] = ["--parallel.compression", "bf16"]
    after = ["--parallel.compression_adam", "after"]
    bucket = ["--parallel.compression", "topk", "--parallel.compression_topk_scope", "bucket"]
    return out | {
        "powersgd r4": ["--parallel.compression", "powersgd"],
        "topk 1%, Adam after": ["--parallel.compression", "topk", *after],
        f"topk 1%, Adam after, warm-up {steps}": [
            "--parallel.compression",
            "topk",
            "--parallel.compression_warmup_steps",
            str(steps),
            *after,
        ],
        "topk 1%, Adam before": ["--parallel.compression", "topk"],
        f"topk 1%, Adam before, warm-up {warm}": [
            "--parallel.compression",
            "topk",
            "--parallel.compression_warmup_steps",
            str(warm),
        ],
        f"topk 1%, Adam before, warm-up {steps}": [
            "--parallel.compression",
            "topk",
            "--parallel.compression_warmup_steps",
            str(steps),
        ],
        "topk 1%, Adam before, per bucket": [*bucket],
        f"topk 1%, Adam before, per bucket, warm-up {warm}": [
            *bucket,
            "--parallel.compression_warmup_steps",
            str(warm),
        ],
        "topk 1%, Adam before, per bucket, signs x1 every step": [
            *bucket,
            "--parallel.compression_topk_sign_every",
            "1",
            "--parallel.compression_topk_sign_scale",
            "1",
        ],
        "topk 1%, Adam before, per bucket, signs x1.5 every step": [
            *bucket,
            "--parallel.compression_topk_sign_every",
            "1",
            "--parallel.compression_topk_sign_scale",
            "1.5",
        ],
        "topk 1%, Adam before, per bucket, signs x1.8 every step": [
            *bucket,
            "--parallel.compression_topk_sign_every",
            "1",
            "--parallel.compression_topk_sign_scale",
            "1.8",
        ],
        "topk 1%, Adam before, per bucket, signs x2 every step": [
            *bucket,
            "--parallel.compression_topk_sign_every",
            "1",
            "--parallel.compression_topk_sign_scale",
            "2",
        ],
        "topk 0.5%, Adam before, per bucket, signs x1.8 every step": [
            *bucket,
            "--parallel.compression_ratio",
            "0.005",
            "--parallel.compression_topk_sign_every",
            "1",
            "--parallel.compression_topk_sign_scale",
            "1.8",
        ],
        "topk 0.5%, Adam before, per bucket, signs x1 every step": [
            *bucket,
            "--parallel.compression_ratio",
            "0.005",
            "--parallel.compression_topk_sign_every",
            "1",
            "--parallel.compression_topk_sign_scale",
            "1",
        ],
    }


def run(steps: int, flags: list[str], folder: Path) -> tuple[float, float]:
    """(mean loss of the last 5 steps, mean dp bytes per step) of one run."""
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "plait",
        "train",
        "--nproc",
        "2",
        "--dp",
        "2",
        "--steps",
        str(steps),
    ]
    cmd += ["--metrics", str(metrics), "--train.checkpoint_dir", str(folder / "ckpt"), *flags]
    subprocess.run(cmd, check=True, capture_output=True, cwd=folder)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if r.get("loss") is not None and "comm_bytes" in r]
    losses = [float(r["loss"]) for r in rows][-5:]
    return sum(losses) / len(losses), sum(float(r["comm_bytes"]) for r in rows) / len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[60, 500])
    ap.add_argument("--out", type=Path, help="record the table in this markdown file")
    ap.add_argument(
        "--only", nargs="+", default=None, help="run only the methods whose label contains one"
    )
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = ap.parse_args()
    extra = TINY_FLAGS if a.tiny else []
    if a.tiny:  # the uncompressed run and one compressed one, 2 steps
        a.steps, a.only = [2], ["powersgd"]
    load0 = load_average()
    results: dict[int, dict[str, tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for steps in a.steps:
            results[steps] = {}
            for label, flags in methods(steps).items():
                if a.only and label != "none" and not any(o in label for o in a.only):
                    continue
                results[steps][label] = run(steps, [*flags, *extra], Path(tmp))
                print(f"  {steps} steps, {label}: {results[steps][label]}", file=sys.stderr)
    lines = [
        "| steps | method | loss (last 5) | loss / none | bytes per step / none |",
        "|---|---|---|---|---|",
    ]
    for steps, res in results.items():
        base_loss, base_bytes = res["none"]
        for label, (loss, nbytes) in res.items():
            lines.append(
                f"| {steps} | {label} | {loss:.4f} | {loss / base_loss:.3f} | "
                f"{nbytes / base_bytes:.4f} |"
            )
    head = (
        f"Measured by `{command_line(__file__)}`: `plait train --nproc 2 --dp 2` on the "
        "built-in corpus, mean loss of the last 5 steps, dp bytes per step averaged over "
        f"the run; load average {load0:.1f} -> {load_average():.1f}; {environment()}."
    )
    text = head + "\n\n" + "\n".join(lines)
    print(text)
    if a.out:
        write_section(
            a.out, "compression_convergence", "## Compression convergence\n\n" + text + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
