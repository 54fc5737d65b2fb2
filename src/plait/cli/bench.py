"""``plait bench <name> [options]``: run one of the benchmarks of :mod:`plait.bench`.

=========  ==============================================================================
comm       all-reduce algorithms on point-to-point messages and the library all-reduce,
           with the alpha-beta model fitted to the measurements (:mod:`plait.bench.comm`)
calibrate  this machine's matmul/attention/element-wise rates and the collectives' alpha
           and beta, written as a hardware profile for ``plait plan --hardware PATH``
           (:mod:`plait.bench.calibrate`)
=========  ==============================================================================
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _comm(argv: Sequence[str]) -> int:
    from plait.bench.comm import main

    return int(main(list(argv)) or 0)


def _calibrate(argv: Sequence[str]) -> int:
    from plait.cli.plan import calibrate_main

    return int(calibrate_main(argv) or 0)


BENCHMARKS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "comm": (_comm, "collective algorithms vs the alpha-beta model"),
    "calibrate": (
        _calibrate,
        "measure alpha-beta and compute rates; write a profile for `plait plan --hardware`",
    ),
}
"""Benchmark name -> (its runner, one-line help)."""


def bench_main(argv: Sequence[str]) -> int:
    """``plait bench <name> ...``: run one benchmark; returns the exit code."""
    args = list(argv)
    if not args or args[0] not in BENCHMARKS:
        lines = [f"  {n:8s} {h}" for n, (_, h) in BENCHMARKS.items()]
        print("usage: plait bench {" + ",".join(BENCHMARKS) + "} [options]", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    run, _ = BENCHMARKS[args[0]]
    return run(args[1:])
