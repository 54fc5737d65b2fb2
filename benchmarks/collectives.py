"""All-reduce algorithms on point-to-point messages vs the library all-reduce and the
alpha-beta model: the recorded run of ``plait bench comm``.

Every algorithm of :mod:`plait.collectives.algorithms` and gloo's own all-reduce at world sizes
2, 4 and 8, fp32 messages of 4 B to 64 MiB (x8 steps); median time (slowest rank),
algorithm and bus bandwidth; alpha and beta fitted per algorithm on
``time = steps·alpha + critical_bytes·beta`` with the prediction error beside every
measurement; a log-log plot. Repetitions: ``--reps`` (15) up to 64 KiB, then 10, 5 and 2
(no warm-up above 8 MiB) so the default run stays under ~5 minutes on 2 cores. It also
prints the steps and bytes of every algorithm at N = 2, 4, 8 measured from the comm
counters (the asymptotics in docs/collectives.md).

Run from the repository root::

    python benchmarks/collectives.py            # writes benchmarks/COLLECTIVES.md + .png
                                                # and its section of benchmarks/RESULTS.md
    python benchmarks/collectives.py --help     # every option of `plait bench comm`
    python benchmarks/collectives.py --tiny     # 2 ranks, 4 B to 4 KiB, 1 rep; prints only
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    """Run ``plait bench comm`` with the recorded outputs as defaults (``--tiny``: the
    test suite's smallest run, which writes nothing)."""
    from plait.bench.comm import main as bench

    args = list(sys.argv[1:] if argv is None else argv)
    if "--tiny" in args:
        args.remove("--tiny")
        return bench(["--worlds", "2", "--max-bytes", "4K", "--reps", "1", *args])
    if "--md" not in args:
        args += ["--md", os.path.relpath(HERE / "COLLECTIVES.md")]
    if "--plot" not in args:
        args += ["--plot", os.path.relpath(HERE / "collectives.png")]
    if "--results" not in args:
        args += ["--results", os.path.relpath(HERE / "RESULTS.md")]
    return bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
