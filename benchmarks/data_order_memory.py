"""Per-rank memory of the data order, before and after issue 44, at 2 M, 20 M and 200 M
windows.

*Before*: the sampler drew each epoch's order with ``torch.randperm`` over every window
(kept as the ``"randperm"`` order for runs started with it) and a mixture built its whole
blend (every source's windows merged by time: :func:`plait.data.blending.merged_blend`).
*After*: the Feistel permutation evaluated for a rank's slice of a step, and the blend
evaluated per window (:class:`plait.data.blending.Blend`). Each cell is measured in a
fresh process: its peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``)
minus its resident memory before, while it computes one rank's indices of one step
(``--batch`` windows of a global batch of 8 ranks) at a step deep into the first epoch,
and maps them through a two-source blend (weights 0.7 / 0.3). The whole merge needs some
70 bytes a window at its peak; beyond ``--merge-max`` windows it is not run (it would take
the machine's memory) and the cell gives the measured bytes per window at the largest
size run times the size, marked "extrapolated". Time: milliseconds per rank-step, after.
Each process first runs the same code on 10,000 windows, so that first-call costs
(numpy's lazy set-up) are not counted as the order's.

    python benchmarks/data_order_memory.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from plait.bench.results import command_line, environment, load_average, write_section

RANKS = 8
CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from plait.data.blending import Blend, merged_blend
    from plait.data.order import FeistelOrder, RandpermOrder

    WEIGHTS = [0.7, 0.3]
    kind, blend, n, batch, ranks = sys.argv[1], sys.argv[2] == "1", *map(int, sys.argv[3:6])

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def work(n, batch):
        step = n // (batch * ranks) // 2  # rank 3's slice, half-way through epoch 0
        first = step * batch * ranks + 3 * batch
        pos = np.arange(first, first + batch)
        if kind == "before":
            return merged_blend(WEIGHTS, n) if blend else RandpermOrder(n, 0)(pos)
        idx = FeistelOrder(n, 0)(pos)
        return Blend(WEIGHTS, n).locate(idx) if blend else idx

    work(10_000, 64)  # first-call costs (numpy's lazy set-up) are not the order's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    base, t0 = status("VmRSS"), time.perf_counter()
    work(n, batch)
    print(json.dumps([status("VmHWM") - base, time.perf_counter() - t0]))
    """
)


def measure(kind: str, blend: bool, n: int, batch: int) -> tuple[int, float]:
    """``(peak bytes above the start, seconds)`` of one cell, in a fresh process."""
    argv = [kind, "1" if blend else "0", str(n), str(batch), str(RANKS)]
    r = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True
    )
    peak, seconds = json.loads(r.stdout.strip().splitlines()[-1])
    return int(peak), float(seconds)


def mib(n: float) -> str:
    """Bytes as MiB (KiB under one MiB; a page is 4 KiB)."""
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2_000_000, 20_000_000, 200_000_000])
    p.add_argument("--batch", type=int, default=512, help="windows of one rank per step")
    p.add_argument("--merge-max", type=int, default=20_000_000)
    p.add_argument("--out", type=Path, default=None, help="record the section in this file")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = p.parse_args()
    if a.tiny:
        a.sizes, a.batch, a.merge_max = [20_000, 200_000], 64, 20_000
    rows = []
    for component, blend in (("sampler permutation", False), ("mixture blend (2 sources)", True)):
        per_window = 0.0
        for n in a.sizes:
            if blend and n > a.merge_max:
                old, note = per_window * n, " (extrapolated)"
            else:
                old, note = float(measure("before", blend, n, a.batch)[0]), ""
                per_window = old / n
            new, secs = measure("after", blend, n, a.batch)
            rows.append((component, n, f"{mib(old)}{note}", mib(new), secs * 1e3))
    lines = [
        "## Data order: per-rank memory before and after (issue 44)",
        "",
        f"`{command_line(__file__)}`: one rank's {a.batch} windows of a step (global batch "
        f"of {RANKS} ranks) half-way through the first epoch, mapped through a two-source "
        f"blend for the blend rows; peak resident bytes above the start in a fresh process; "
        f"{environment()}; load average {load_average():.1f}.",
        "",
        "| component | windows | before (whole index) | after (per position) "
        "| after: ms per rank-step |",
        "|---|---:|---:|---:|---:|",
        *(f"| {c} | {n:,} | {o} | {w} | {ms:.2f} |" for c, n, o, w, ms in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if a.out is not None:
        write_section(a.out, "data_order_memory", text)


if __name__ == "__main__":
    main()
