"""The alpha-beta (Hockney) model fitted to measured collective times, tables and plot.

Model of one algorithm: ``time = steps·alpha + critical_bytes·beta`` with ``steps`` and
``critical_bytes`` from the closed forms of :mod:`plait.collectives.costs` (the library's own
all-reduce is modelled as a ring: gloo's default CPU algorithm is a ring). The fit is a
least-squares fit of the *relative* error (each equation divided by the measured time),
so microsecond and second measurements weigh alike; a coefficient that would come out
negative is fixed at 0 and the other refitted (non-negative least squares in 2-D).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.collectives import costs

LIBRARY = "library"


@dataclass(frozen=True)
class Measurement:
    """Median time of one algorithm at one world size and message size."""

    algorithm: str
    world: int
    nbytes: int
    seconds: float
    reps: int

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth: S / time (bytes/s)."""
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bus bandwidth (nccl-tests convention for all-reduce): algbw · 2(N-1)/N."""
        return self.algbw * 2 * (self.world - 1) / self.world


@dataclass(frozen=True)
class Fit:
    """Fitted latency and inverse bandwidth of one algorithm."""

    algorithm: str
    alpha: float
    """Seconds per step."""
    beta: float
    """Seconds per byte on the critical path."""
    errors: tuple[float, ...]
    """Relative prediction error of every measurement, in input order."""

    @property
    def median_abs_error(self) -> float:
        """Median of |relative error|."""
        return statistics.median(abs(e) for e in self.errors) if self.errors else 0.0

    @property
    def max_abs_error(self) -> float:
        """Largest |relative error|."""
        return max((abs(e) for e in self.errors), default=0.0)


def model_terms(algorithm: str, world: int, nbytes: int) -> tuple[int, int]:
    """(steps, critical-path bytes) of an fp32 all-reduce of ``nbytes``."""
    name = "ring" if algorithm == LIBRARY else algorithm
    c = costs.formula(name, world, nbytes // 4, 4)
    return c.steps, c.critical_bytes


def fit(algorithm: str, ms: list[Measurement]) -> Fit:
    """Least-squares alpha and beta of ``algorithm`` over ``ms`` (relative error)."""
    terms = np.array([model_terms(algorithm, m.world, m.nbytes) for m in ms], dtype=float)
    t = np.array([m.seconds for m in ms])
    a = terms / t[:, None]  # (M, 2): rows scaled by 1/t, target 1
    b = np.ones(len(ms))
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    if coef.min() < 0:  # 2-D NNLS: fix the negative one at 0, refit the other alone
        best = None
        for keep in (0, 1):
            col = a[:, keep]
            v = max(0.0, float(col @ b / (col @ col)))
            c = np.zeros(2)
            c[keep] = v
            err = float(np.sum((a @ c - b) ** 2))
            if best is None or err < best[0]:
                best = (err, c)
        assert best is not None
        coef = best[1]
    pred = terms @ coef
    return Fit(algorithm, float(coef[0]), float(coef[1]), tuple((pred - t) / t))


def human_bytes(n: float) -> str:
    """4 B, 32 KiB, 64 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError


def fit_all(ms: list[Measurement]) -> tuple[dict[str, Fit], dict[tuple[str, int], Fit]]:
    """Fits per algorithm (over every world size) and per (algorithm, world size)."""
    names = list(dict.fromkeys(m.algorithm for m in ms))
    worlds = sorted({m.world for m in ms})
    per = {n: fit(n, [m for m in ms if m.algorithm == n]) for n in names}
    per_world = {
        (n, w): fit(n, [m for m in ms if m.algorithm == n and m.world == w])
        for n in names
        for w in worlds
    }
    return per, per_world


def tables(
    ms: list[Measurement],
    fits: dict[str, Fit],
    fits_by_world: dict[tuple[str, int], Fit],
    traffic_ok: dict[str, bool],
) -> str:
    """Markdown: the fit per algorithm, the fit per algorithm and world size, then every
    measurement with both models' predictions beside it."""
    worlds = sorted({m.world for m in ms})
    lines = [
        "| algorithm | alpha (µs/step) | beta (ns/byte) | 1/beta (GB/s) | median abs error | "
        "max abs error | counters = formula |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, f in fits.items():
        inv = f"{1e-9 / f.beta:.2f}" if f.beta > 0 else "inf"
        ok = "n/a" if name == LIBRARY else ("yes" if traffic_ok.get(name, False) else "NO")
        lines.append(
            f"| {name} | {f.alpha * 1e6:.1f} | {f.beta * 1e9:.3f} | {inv} | "
            f"{f.median_abs_error * 100:.0f} % | {f.max_abs_error * 100:.0f} % | {ok} |"
        )
    head = " | ".join(f"N={w}: alpha µs, beta ns/B, median abs error" for w in worlds)
    lines += ["", f"| algorithm | {head} |", "|---|" + "---:|" * len(worlds)]
    for name in fits:
        cells = []
        for w in worlds:
            f = fits_by_world[(name, w)]
            cells.append(
                f"{f.alpha * 1e6:.0f}, {f.beta * 1e9:.2f}, {f.median_abs_error * 100:.0f} %"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| N | size | algorithm | reps | median ms | ÷ library | algbw GB/s | busbw GB/s | "
        "model ms | error | per-N model ms | per-N error |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lib = library_times(ms)
    for m in ms:
        f, fw = fits[m.algorithm], fits_by_world[(m.algorithm, m.world)]
        err = f.errors[[x for x in ms if x.algorithm == m.algorithm].index(m)]
        werr = fw.errors[
            [x for x in ms if x.algorithm == m.algorithm and x.world == m.world].index(m)
        ]
        lines.append(
            f"| {m.world} | {human_bytes(m.nbytes)} | {m.algorithm} | {m.reps} | "
            f"{m.seconds * 1e3:.3f} | {_ratio(m, lib)} | {m.algbw / 1e9:.4f} | "
            f"{m.busbw / 1e9:.4f} | "
            f"{m.seconds * (1 + err) * 1e3:.3f} | {err * 100:+.0f} % | "
            f"{m.seconds * (1 + werr) * 1e3:.3f} | {werr * 100:+.0f} % |"
        )
    return "\n".join(lines)


def library_times(ms: list[Measurement]) -> dict[tuple[int, int], float]:
    """(world, bytes) -> median seconds of the library all-reduce (the reference)."""
    return {(m.world, m.nbytes): m.seconds for m in ms if m.algorithm == LIBRARY}


def _ratio(m: Measurement, lib: dict[tuple[int, int], float]) -> str:
    ref = lib.get((m.world, m.nbytes))
    return f"{m.seconds / ref:.2f}" if ref else "-"


def summary_table(ms: list[Measurement], fits: dict[str, Fit]) -> str:
    """Markdown: per world size and algorithm, the median time at the smallest, the
    closest-to-1-MiB and the largest message with the model's error beside each, and the
    ratio to the library all-reduce at the smallest and largest."""
    sizes = sorted({m.nbytes for m in ms})
    picks = list(dict.fromkeys([sizes[0], min(sizes, key=lambda s: abs(s - 2**20)), sizes[-1]]))
    lib = library_times(ms)
    errs = {}
    for name, f in fits.items():
        mine = [m for m in ms if m.algorithm == name]
        errs.update(
            {(m.algorithm, m.world, m.nbytes): e for m, e in zip(mine, f.errors, strict=True)}
        )
    cols = " | ".join(f"{human_bytes(s)}: ms (model error)" for s in picks)
    lines = [
        f"| N | algorithm | {cols} | ÷ library at {human_bytes(picks[0])} | "
        f"÷ library at {human_bytes(picks[-1])} | busbw at {human_bytes(picks[-1])} GB/s |",
        "|---:|---|" + "---:|" * (len(picks) + 3),
    ]
    by_key = {(m.algorithm, m.world, m.nbytes): m for m in ms}
    for n in sorted({m.world for m in ms}):
        for name in fits:
            got = [by_key.get((name, n, s)) for s in picks]
            if any(m is None for m in got):
                continue
            cells = [
                f"{m.seconds * 1e3:.3f} ({errs[(name, n, m.nbytes)] * 100:+.0f} %)"
                for m in got
                if m is not None
            ]
            first, last = got[0], got[-1]
            assert first is not None and last is not None
            lines.append(
                f"| {n} | {name} | " + " | ".join(cells) + f" | {_ratio(first, lib)} | "
                f"{_ratio(last, lib)} | {last.busbw / 1e9:.3f} |"
            )
    return "\n".join(lines)


def plot(ms: list[Measurement], fits: dict[str, Fit], path: str | Path) -> None:
    """Time vs size, log-log, one panel per world size, one line per algorithm, the
    fitted model dashed in the same colour (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({m.world for m in ms})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4.2), sharey=True)
    axes = np.atleast_1d(axes)
    colours = plt.get_cmap("tab10")
    for ax, n in zip(axes, worlds, strict=True):
        for c, name in enumerate(fits):
            pts = sorted((m.nbytes, m.seconds) for m in ms if m.world == n and m.algorithm == name)
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1] for p in pts], "o-", ms=3, lw=1.2, color=colours(c), label=name)
            f = fits[name]
            model = [
                sum(v * k for v, k in zip(model_terms(name, n, s), (f.alpha, f.beta), strict=True))
                for s in x
            ]
            ax.plot(x, model, "--", lw=1, color=colours(c))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"all-reduce, N = {n} (gloo, CPU)")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("median time (s); dashed: alpha-beta fit")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
