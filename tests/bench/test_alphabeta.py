"""The alpha-beta fit, the tables and the plot of ``plait bench comm`` (pure: synthetic
measurements generated from known coefficients, no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.bench.alphabeta import (
    LIBRARY,
    Measurement,
    fit,
    fit_all,
    human_bytes,
    model_terms,
    plot,
    tables,
)
from plait.collectives import costs

SIZES = [4, 256, 16 * 2**10, 2**20, 64 * 2**20]


def _synthetic(name: str, alpha: float, beta: float, worlds: tuple[int, ...]) -> list[Measurement]:
    out = []
    for n in worlds:
        for s in SIZES:
            steps, crit = model_terms(name, n, s)
            out.append(Measurement(name, n, s, steps * alpha + crit * beta, 5))
    return out


@pytest.mark.parametrize("name", ["ring", "tree", "direct", "recursive_doubling", LIBRARY])
def test_fit_recovers_known_coefficients(name: str) -> None:
    ms = _synthetic(name, 250e-6, 0.8e-9, (2, 4, 8))
    f = fit(name, ms)
    assert f.alpha == pytest.approx(250e-6, rel=1e-9)
    assert f.beta == pytest.approx(0.8e-9, rel=1e-9)
    assert f.max_abs_error < 1e-9 and len(f.errors) == len(ms)


def test_model_terms_come_from_the_closed_forms() -> None:
    c = costs.formula("ring", 8, 2**18, 4)
    assert model_terms("ring", 8, 2**20) == (c.steps, c.critical_bytes) == (14, 14 * 2**17)
    assert model_terms(LIBRARY, 8, 2**20) == model_terms("ring", 8, 2**20)  # gloo: a ring


def test_negative_coefficient_is_clamped_to_zero() -> None:
    # times that fall with size cannot be explained by a positive beta: beta = 0
    ms = [Measurement("direct", 2, s, 1e-3 / (1 + i), 3) for i, s in enumerate(SIZES)]
    f = fit("direct", ms)
    assert f.beta == 0.0 and f.alpha > 0


def test_bandwidths() -> None:
    m = Measurement("ring", 4, 2**20, 2**20 / 1e9, 3)  # 1 GB/s
    assert m.algbw == pytest.approx(1e9)
    assert m.busbw == pytest.approx(1e9 * 2 * 3 / 4)
    assert [human_bytes(b) for b in (4, 2048, 64 * 2**20)] == ["4 B", "2 KiB", "64 MiB"]


def test_tables_and_plot(tmp_path: Path) -> None:
    ms = _synthetic("ring", 1e-3, 1e-9, (2, 4)) + _synthetic(LIBRARY, 2e-4, 2e-9, (2, 4))
    fits, per_world = fit_all(ms)
    assert set(fits) == {"ring", LIBRARY}
    assert set(per_world) == {(a, n) for a in ("ring", LIBRARY) for n in (2, 4)}
    text = tables(ms, fits, per_world, {"ring": True})
    assert "| ring | 1000.0 | 1.000 | 1.00 | 0 % | 0 % | yes |" in text  # exact data
    assert "| library | 200.0 | 2.000 | 0.50 | 0 % | 0 % | n/a |" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| 4 | 1 MiB | ring | 5 |")]
    assert len(rows) == 1 and rows[0].endswith("| +0 % |")
    # one measurement 25 % slower: the model no longer fits exactly
    bad = ms[3]
    ms[3] = Measurement(bad.algorithm, bad.world, bad.nbytes, bad.seconds * 1.25, bad.reps)
    fits, per_world = fit_all(ms)
    assert 0 < fits["ring"].max_abs_error < 0.25
    assert per_world[(LIBRARY, 2)].max_abs_error < 1e-9  # other fits untouched
    png = tmp_path / "p.png"
    plot(ms, fits, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
