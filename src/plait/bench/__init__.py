"""Benchmarks run from the command line: ``plait bench <name> [options]``.

=========  ==============================================================================
comm       all-reduce algorithms on point-to-point messages and the library all-reduce,
           with the alpha-beta model fitted to the measurements (:mod:`plait.bench.comm`)
calibrate  this machine's matmul/attention/element-wise rates and the collectives' alpha
           and beta, written as a hardware profile for ``plait plan --hardware PATH``
           (:mod:`plait.bench.calibrate`)
=========  ==============================================================================
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "comm": ("plait.bench.comm:main", "collective algorithms vs the alpha-beta model"),
    "calibrate": (
        "plait.cli.plan:calibrate_main",
        "measure alpha-beta and compute rates; write a profile for `plait plan --hardware`",
    ),
}


def main(argv: list[str]) -> int:
    """``plait bench <name> ...``: run one benchmark; returns the exit code."""
    if not argv or argv[0] not in BENCHMARKS:
        lines = [f"  {n:8s} {h}" for n, (_, h) in BENCHMARKS.items()]
        print("usage: plait bench {" + ",".join(BENCHMARKS) + "} [options]", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, _, func = BENCHMARKS[argv[0]][0].partition(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
