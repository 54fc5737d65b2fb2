"""``plait bench comm``: argument handling, the measuring body on real gloo ranks (its
traffic table equals the closed forms) and one tiny end-to-end run writing the markdown
and the PNG. Timings are never asserted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from plait.bench import comm as bench
from plait.bench.alphabeta import LIBRARY
from plait.cli import main as plait_main
from plait.collectives import algorithms as algo
from plait.collectives import costs
from plait.errors import ConfigError
from plait.testing import WorkerPool

Pools = Callable[[int], WorkerPool]


def test_parse_bytes_and_plan() -> None:
    assert [bench._parse_bytes(t) for t in ("4", "32K", "64M", "64MiB", "1g")] == [
        4,
        32 * 2**10,
        64 * 2**20,
        64 * 2**20,
        2**30,
    ]
    with pytest.raises(ConfigError, match="byte size"):
        bench._parse_bytes("lots")
    assert bench.plan(4, 15) == (2, 15)
    assert bench.plan(2**20, 15) == (1, 10)
    assert bench.plan(64 * 2**20, 15) == (0, 2)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--worlds", "1"], "each >= 2"),
        (["--worlds", "two"], "comma-separated integers"),
        (["--algorithms", "ring,butterfly"], "['butterfly']"),
        (["--factor", "1"], "factor 1"),
        (["--max-bytes", "2"], "4 <= --min-bytes"),
        (["--timeout", "0"], "--timeout must be positive"),
    ],
)
def test_bad_arguments_exit_2_before_any_process(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plait_main(["bench", "comm", *args]) == 2
    assert needle in capsys.readouterr().err


def test_bench_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert plait_main(["bench"]) == 2
    assert plait_main(["bench", "--help"]) == 0
    assert "comm" in capsys.readouterr().err


@pytest.mark.parametrize("world", [2, 4])
def test_body_measures_and_counts(pools: Pools, world: int) -> None:
    names = [*algo.ALL_REDUCE, LIBRARY]
    res = pools(world).run("plait.bench.comm:bench_body", names, [4, 4096], 2)
    for r in res:
        assert set(r["times"]) == {f"{n}/{s}" for n in names for s in (4, 4096)}
        assert all(len(v) == 2 and min(v) > 0 for v in r["times"].values())
        assert set(r["traffic"]) == set(algo.ALL_REDUCE)  # the library has no counters
        for name, (cost, ok) in r["traffic"].items():
            assert ok, name
            assert cost == costs.formula(name, world, bench.PROBE_NUMEL, 4)
    table = costs.traffic_table([c for c, _ in res[0]["traffic"].values()])
    lg = world.bit_length() - 1
    assert f"| recursive_doubling | {world} | {lg} | {lg} | {lg} | {world * lg} |" in table
    assert f"| direct | {world} | 1 | {world - 1} | {world - 1} | {world * (world - 1)} |" in table


@pytest.mark.slow
def test_end_to_end_writes_table_plot_and_section(tmp_path: Path) -> None:
    md, png, results = tmp_path / "c.md", tmp_path / "c.png", tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Someone else's section\n\nkeep me\n")
    args = ["--worlds", "2", "--algorithms", "ring,tree,library", "--max-bytes", "256"]
    args += ["--reps", "1", "--md", str(md), "--plot", str(png), "--results", str(results)]
    assert bench.main(args) == 0
    text = md.read_text()
    assert "Taken under load" in text and "| ring | 2 | 2 | 1 | 1 | 2 | 1 |" in text
    assert "| 2 | 256 B | library | 1 |" in text and "| tree |" in text
    lib_row = [ln for ln in text.splitlines() if ln.startswith("| 2 | 4 B | library |")]
    assert len(lib_row) == 1 and lib_row[0].split("|")[6].strip() == "1.00"  # ÷ library
    assert png.read_bytes()[:4] == b"\x89PNG"
    first = results.read_text()
    assert first.startswith("# Benchmark results\n\n## Someone else's section\n\nkeep me\n")
    assert first.count("## Collective algorithms (issue 8)") == 1
    assert "| 2 | ring | " in first and "÷ library at 256 B" in first
    # a second run replaces the section instead of appending another
    bench._write_section(results, "- head\n\n", "new body", None)
    second = results.read_text()
    assert second.count("## Collective algorithms (issue 8)") == 1 and "new body" in second
    assert "keep me" in second and "| 2 | ring | " not in second
