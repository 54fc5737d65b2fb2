"""``plait bench <name> [options]``: run one of the benchmarks of :mod:`plait.bench`.

=========  ==============================================================================
comm       all-reduce algorithms on point-to-point messages and the library all-reduce,
           with the alpha-beta model fitted to the measurements (:mod:`plait.bench.comm`)
calibrate  this machine's matmul/attention/element-wise rates and the collectives' alpha
           and beta, written as a hardware profile for ``plait plan --hardware PATH``
           (:mod:`plait.bench.calibrate`); also ``plait calibrate``, an alias kept for
           scripts
=========  ==============================================================================

Each benchmark takes the arguments after its name and returns an exit code; bad input is
a :class:`~plait.errors.ConfigError` (one paragraph, exit code 2). The benchmarks import
torch only when they run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from plait.cli.common import EXIT_BAD_INPUT, EXIT_OK, Command, ConfigErrorParser
from plait.errors import ConfigError


def comm_main(argv: Sequence[str]) -> int:
    """``plait bench comm``: the collective algorithms against the alpha-beta model."""
    from plait.bench.comm import main

    return int(main(list(argv)) or EXIT_OK)


def _calibrate_parser() -> ConfigErrorParser:
    p = ConfigErrorParser(
        prog="plait bench calibrate",
        description=(
            "Measure matmul, attention and memory-bound rates and the alpha-beta cost of "
            "the collectives (gloo) across local processes, and write a hardware profile "
            "for `plait plan --hardware PATH`."
        ),
    )
    p.add_argument("--out", default="plait-hardware.toml", help="profile path (TOML)")
    p.add_argument("--nproc", type=int, default=2, help="local processes (ranks)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--memory-gb", type=float, help="device memory (default: RAM / cores)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks on this host (default); cuda: the first GPU's bf16 rates over "
        "its datasheet preset (plait.bench.device)",
    )
    return p


def _calibrate_cuda(out: str, quick: bool) -> int:
    """``plait bench calibrate --device cuda``: the GPU's rates, written as a profile."""
    from pathlib import Path

    from plait.bench.device import calibrate_cuda
    from plait.plan.profile_toml import dump_hardware

    hw, rates = calibrate_cuda(quick)
    Path(out).write_text(
        dump_hardware(hw, comment="written by plait bench calibrate --device cuda"),
        encoding="utf-8",
    )
    print(f"matmul: {', '.join(f'{int(s)}: {r / 1e12:.0f}' for s, r in hw.matmul.points)} TFLOP/s")
    att = ", ".join(f"s={int(s)}: {r / 1e12:.0f}" for s, r in hw.attention.points)
    print(f"attention: {att} TFLOP/s")
    print(
        f"element-wise: up to {hw.elementwise.peak / 1e9:.0f} GB/s; optimizer "
        f"{hw.optimizer_bandwidth / 1e9:.0f} GB/s; launch {rates.launch_s * 1e6:.1f} us; "
        f"tiny block {rates.tiny_block_s * 1e3:.2f} ms"
    )
    print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


def calibrate_main(argv: Sequence[str]) -> int:
    """``plait bench calibrate``: measure this machine and write a hardware profile."""
    from pathlib import Path

    from plait.bench.calibrate import calibrate
    from plait.plan.profile_toml import dump_hardware

    ns = _calibrate_parser().parse_args(list(argv))
    if ns.nproc < 2:
        raise ConfigError(f"--nproc must be at least 2 to measure collectives, got {ns.nproc}.")
    if ns.memory_gb is not None and ns.memory_gb <= 0:
        raise ConfigError(f"--memory-gb must be positive, got {ns.memory_gb}.")
    if ns.device == "cuda":
        return _calibrate_cuda(ns.out, ns.quick)
    mem = ns.memory_gb * 1e9 if ns.memory_gb else None
    hw, fits = calibrate(ns.nproc, quick=ns.quick, memory_bytes=mem)
    text = dump_hardware(hw, comment=f"written by plait bench calibrate --nproc {ns.nproc}")
    Path(ns.out).write_text(text, encoding="utf-8")
    print(f"matmul: {', '.join(f'{int(s)}: {r / 1e9:.1f}' for s, r in hw.matmul.points)} GFLOP/s")
    print(
        "attention: "
        + ", ".join(f"s={int(s)}: {r / 1e9:.1f}" for s, r in hw.attention.points)
        + " GFLOP/s"
    )
    print(
        f"element-wise: up to {hw.elementwise.peak / 1e9:.1f} GB/s; op overhead "
        f"{hw.op_overhead_s * 1e6:.1f} us; optimizer {hw.optimizer_bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"fixed costs: {hw.block_overhead_s * 1e3:.2f} ms per block (forward + backward), "
        f"{hw.ring_overhead_s * 1e3:.2f} ms per ring-attention layer"
    )
    from plait.plan.hardware import GRID_FIELDS

    for key in GRID_FIELDS:  # the block grids: measured / charged per shape
        if getattr(hw, key):
            pts = ", ".join(f"{int(d)}x{int(t)}: {r:.2f}" for d, t, r in getattr(hw, key))
            print(f"{key} (measured / charged, hidden x tokens): {pts}")
    for f in fits:
        print(f"{f.op:<15} alpha {f.alpha * 1e6:8.1f} us   B {f.bandwidth / 1e9:7.3f} GB/s")
    print(f"wrote {ns.out}", file=sys.stderr)
    return EXIT_OK


BENCHMARKS: dict[str, tuple[Command, str]] = {
    "comm": (comm_main, "collective algorithms vs the alpha-beta model"),
    "calibrate": (
        calibrate_main,
        "measure alpha-beta and compute rates; write a profile for `plait plan --hardware`",
    ),
}
"""Benchmark name -> (its command, one-line help)."""


def bench_main(argv: Sequence[str]) -> int:
    """``plait bench <name> ...``: run one benchmark; returns the exit code."""
    args = list(argv)
    if not args or args[0] not in BENCHMARKS:
        lines = [f"  {n:8s} {h}" for n, (_, h) in BENCHMARKS.items()]
        print("usage: plait bench {" + ",".join(BENCHMARKS) + "} [options]", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)
        return EXIT_OK if args[:1] in (["-h"], ["--help"]) else EXIT_BAD_INPUT
    run, _ = BENCHMARKS[args[0]]
    return run(args[1:])
