"""Every GPU figure of plait in two device calls: the rows of ``benchmarks/gpu_rows.py``.

On the GPU machine (torch 2.11, no package registry; carry ``wheels/``)::

    python benchmarks/gpu_all.py --call 1      # about 3.5 minutes of work
    python benchmarks/gpu_all.py --call 2      # about 3.5 minutes of work

Anywhere (a CPU): ``python benchmarks/gpu_all.py --dry`` runs every row in its smallest
form. ``bash benchmarks/gpu_all.sh ...`` is the same. Outputs go under ``$OUT`` (default
``gpu_out/``, ``gpu_out_dry/`` with ``--dry``):

* ``rows.jsonl``: one record per row, written as soon as the row ends (status ``ok``,
  ``failed`` with its error, or ``skipped`` with the reason), plus the ``env`` record;
* ``table.md``: the same as a table, rewritten after every row;
* ``<row>.txt``: the row's whole output; ``<row>.jsonl``: its figures, as measured;
* ``env.txt`` and ``schemas.txt`` (the private attention ops' schemas), at the start.

Before anything, in seconds: CUDA present, torch 2.11, torchao importable or its wheel
in ``wheels/`` built for this Python (installed ``--no-index --no-deps``); otherwise one
line and exit 2. Before each row: its predicted device and host peaks against the
machine's (skipped with the reason when they do not fit). A row already recorded in
``rows.jsonl`` is not run again (``--retry-failed`` reruns the failed ones), so a call
cut short costs only its missing rows. A failing row is recorded and the next one runs;
the exit code is the number of failed rows. On a GPU machine a GPU test that skips fails
the ``pytest_gpu`` row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT / "src"), str(ROOT)) if p not in sys.path]

from benchmarks.gpu_rows import (  # noqa: E402
    CALL_LIMIT_S,
    PREFLIGHT_BUDGET_S,
    ROWS,
    TOTAL_BUDGET_S,
    Row,
)

TORCH = "2.11"
MACHINES = {"h100": (80.0, 128.0), "h200": (141.0, 128.0)}
"""GPU machine -> (device GB, host GB): what ``--dry`` checks the GPU forms against."""
ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
)
"""The private aten ops :mod:`plait.model.attention_kernels` calls."""
DRY_LIMIT_FACTOR = 3
"""``--dry`` runs each row under 3 x its limit (a shared CPU, not the GPU it is sized for)."""


class Fatal(Exception):
    """A preflight failure: one line, exit 2."""


def _say(out: Path, text: str) -> None:
    print(text, flush=True)
    with open(out / "gpu_all.log", "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%H:%M:%S', time.gmtime())} {text}\n")


def host_gb() -> float:
    """This machine's memory (GB) from /proc/meminfo (0 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def check_wheels(wheels: Path) -> str:
    """torchao's version if importable, else its wheel in ``wheels`` that this Python can
    install (path); raises :class:`Fatal` when there is none."""
    try:
        import torchao  # type: ignore[import-not-found]

        return f"torchao {torchao.__version__} (installed)"
    except ImportError:
        pass
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    here = set(sys_tags())
    found = sorted(wheels.glob("torchao-*.whl")) if wheels.is_dir() else []
    fits = [w for w in found if parse_wheel_filename(w.name)[3] & here]
    if not fits:
        what = ", ".join(w.name for w in found) or "none"
        raise Fatal(
            f"no torchao wheel for Python {platform.python_version()} in {wheels} (found: "
            f"{what}); bring it as docs/gpu.md says (pip download torchao==0.18.0 --no-deps "
            "-d wheels/) and carry wheels/"
        )
    return str(fits[-1])


def preflight(a: argparse.Namespace) -> dict[str, Any]:
    """The checks that stop the run within seconds, then the environment record."""
    import torch

    cuda = torch.cuda.is_available()
    if not a.dry and not cuda:
        raise Fatal(
            f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}): nothing "
            "run; on a CPU use --dry"
        )
    if not a.dry and not torch.__version__.startswith(TORCH):
        raise Fatal(
            f"torch {torch.__version__}, not {TORCH}: the wheels and figures are for {TORCH}"
        )
    torchao = check_wheels(Path(a.wheels))
    env: dict[str, Any] = {
        "row": "env",
        "dry": a.dry,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": torchao,
        "host_gb": host_gb(),
        "node": platform.node(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env["device"] = props.name
        env["capability"] = f"{props.major}.{props.minor}"
        env["device_gb"] = props.total_memory / 1e9
    else:
        env["device_gb"], env["host_gb"] = MACHINES[a.machine]
        env["device"] = f"cpu (--dry; rows checked against the {a.machine}'s memory)"
    env["device_gb"] = a.device_gb or env["device_gb"]
    env["host_gb"] = a.host_gb or env["host_gb"]
    return env


def install_torchao(a: argparse.Namespace, env: dict[str, Any], out: Path) -> None:
    """pip install the carried wheel (no index, no dependencies: torch is never touched)."""
    if env["torchao"].startswith("torchao ") or a.dry:
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", env["torchao"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if r.returncode:
        raise Fatal(
            f"pip install {env['torchao']} failed: {(r.stderr.strip() or '?').splitlines()[-1]}"
        )
    env["torchao"] = f"{env['torchao']} (installed now)"


def schemas() -> str:
    """The schemas of the private attention ops, one a line (missing ones named)."""
    import torch

    lines = []
    for name in ATTENTION_OPS:
        op = getattr(torch.ops.aten, name, None)
        lines.append(str(op.default._schema) if op is not None else f"{name}: MISSING")
    return "\n".join(lines)


def done_rows(out: Path, dry: bool, retry_failed: bool) -> set[str]:
    """Rows already recorded in ``out`` by a run of the same kind."""
    path = out / "rows.jsonl"
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        retry = retry_failed and rec.get("status") == "failed"
        if rec.get("dry") == dry and rec["row"] != "env" and not retry:
            done.add(rec["row"])
    return done


def fits(row: Row, env: dict[str, Any]) -> str | None:
    """Why ``row`` cannot run on this machine (None: it fits). The GPU form's predicted
    peaks are checked in every mode (``--dry`` against ``--machine``)."""
    if row.device_gb > 0.95 * env["device_gb"]:
        return f"predicted device peak {row.device_gb:.0f} GB > 95 % of {env['device_gb']:.0f} GB"
    if row.host_gb > 0.95 * env["host_gb"]:
        return f"predicted host peak {row.host_gb:.0f} GB > 95 % of {env['host_gb']:.0f} GB"
    return None


def junit_problem(path: Path, dry: bool) -> str | None:
    """From pytest's JUnit XML: a failure text when a GPU test failed, erred, or (on a
    GPU machine) skipped; None when all passed."""
    if not path.exists():
        return "pytest wrote no report"
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    n = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    if n["tests"] == 0:
        return "no GPU test was collected"
    if n["failures"] or n["errors"]:
        return f"{n['failures']} failed, {n['errors']} errors of {n['tests']} GPU tests"
    if n["skipped"] and not dry:
        first = next((s.get("message", "?") for s in suite.iter("skipped")), "?")
        return f"{n['skipped']} of {n['tests']} GPU tests skipped (a failure on a GPU): {first}"
    return None


def run_row(row: Row, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run one row under its limit; its record (status, seconds, figures, error)."""
    argv = [x.replace("{out}", str(out)) for x in (row.dry if a.dry else row.gpu)]
    if row.name in a.fail:  # the test suite's hook: a row made to fail
        argv = [sys.executable, "-c", f"raise SystemExit('{row.name}: made to fail')"]
    (out / f"{row.name}.jsonl").unlink(missing_ok=True)
    limit = row.limit_s * (DRY_LIMIT_FACTOR if a.dry else 1)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    with open(out / f"{row.name}.txt", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = time.perf_counter() - t0
    text = (out / f"{row.name}.txt").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    rec: dict[str, Any] = {"row": row.name, "dry": a.dry, "seconds": round(seconds, 1)}
    rec.update(limit_s=limit, budget_s=row.budget_s, exit=code)
    rec["table"] = [ln for ln in lines if ln.startswith("|")][-20:]
    path = out / f"{row.name}.jsonl"
    figures = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    figures += [json.loads(ln[len("RESULT ") :]) for ln in lines if ln.startswith("RESULT ")]
    if figures:  # the row's own records (offload.py's child prints one RESULT line)
        rec["figures"] = figures
    error = None
    if code is None:
        error = f"killed at its limit of {limit} s"
    elif code != 0:
        error = lines[-1] if lines else f"exit {code}"
    elif row.name == "pytest_gpu":
        error = junit_problem(out / "pytest_gpu.xml", a.dry)
    if error is None:  # a figure that failed, or (on a GPU) was skipped, fails the row
        bad = [f for f in rec.get("figures", []) if f.get("error")]
        if not a.dry:
            bad += [
                {"error": f"skipped: {f['skipped']}"}
                for f in rec.get("figures", [])
                if f.get("skipped")
            ]
        error = f"{len(bad)} figure(s) failed: {bad[0]['error']}" if bad else None
    rec["status"] = "failed" if error else "ok"
    if error:
        rec["error"] = error
    return rec


def write_table(out: Path) -> None:
    """``table.md`` from ``rows.jsonl``: a line per row, then each row's own table."""
    recs = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    lines = ["| row | status | s (budget / limit) | note |", "|---|---|---:|---|"]
    detail: list[str] = []
    for r in recs:
        if r["row"] == "env":
            lines.insert(0, f"{r['device']}, torch {r['torch']}, {r['torchao']}, Python "
                         f"{r['python']}{' (dry)' if r['dry'] else ''}\n")  # fmt: skip
            continue
        secs = f"{r.get('seconds', '-')} ({r.get('budget_s', '-')} / {r.get('limit_s', '-')})"
        note = r.get("error") or r.get("reason") or ""
        lines.append(f"| {r['row']} | {r['status']} | {secs} | {note} |")
        if r.get("table"):
            detail += ["", f"### {r['row']}", "", *r["table"]]
    (out / "table.md").write_text("\n".join(lines + detail) + "\n", encoding="utf-8")


def record(out: Path, rec: dict[str, Any]) -> None:
    with open(out / "rows.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    write_table(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="every row's smallest form, on a CPU")
    p.add_argument("--call", choices=["1", "2", "all"], default="all", help="the rows of one call")
    p.add_argument("--only", default="", help="comma-separated row names (default: all)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else gpu_out/)")
    p.add_argument("--wheels", default=str(ROOT / "wheels"), help="folder of carried wheels")
    p.add_argument("--retry-failed", action="store_true", help="rerun rows recorded as failed")
    p.add_argument("--machine", choices=list(MACHINES), default="h100", help="--dry checks")
    p.add_argument("--device-gb", type=float, default=None, help="override the device's GB")
    p.add_argument("--host-gb", type=float, default=None, help="override the host's GB")
    p.add_argument("--fail", default="", help=argparse.SUPPRESS)  # tests: rows made to fail
    a = p.parse_args(argv)
    a.fail = {x for x in a.fail.split(",") if x}
    known = {r.name for r in ROWS}
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    if only - known:
        p.error(f"unknown rows {sorted(only - known)}; rows are {', '.join(sorted(known))}")
    a.only = only
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out or os.environ.get("OUT") or ROOT / ("gpu_out_dry" if a.dry else "gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        env = preflight(a)
        install_torchao(a, env, out)
    except Fatal as e:
        print(f"gpu_all: {e}", file=sys.stderr, flush=True)
        return 2
    (out / "schemas.txt").write_text(schemas() + "\n", encoding="utf-8")
    (out / "env.txt").write_text(json.dumps(env, indent=1) + "\n", encoding="utf-8")
    _say(out, f"gpu_all: {env['device']}, torch {env['torch']}, {env['torchao']}; out {out}")
    _say(out, "private attention ops:\n" + (out / "schemas.txt").read_text().rstrip())
    record(out, env)
    rows = [r for r in ROWS if a.call == "all" or r.call == int(a.call)]
    rows = [r for r in rows if not a.only or r.name in a.only]
    done = done_rows(out, a.dry, a.retry_failed)
    failed = 0
    for row in rows:
        if row.name in done:
            _say(out, f"[{row.name}] already in {out / 'rows.jsonl'}: not run again")
            continue
        why = fits(row, env)
        if why is not None:
            rec = {"row": row.name, "dry": a.dry, "status": "skipped", "reason": why}
        else:
            _say(out, f"[{row.name}] start (limit {row.limit_s} s, budget {row.budget_s} s)")
            rec = run_row(row, a, out)
        record(out, rec)
        failed += rec["status"] == "failed"
        note = rec.get("error") or rec.get("reason") or ""
        _say(out, f"[{row.name}] {rec['status']} after {rec.get('seconds', 0)} s {note}".rstrip())
        for line in rec.get("table", []):
            print("    " + line, flush=True)
    _say(
        out,
        f"gpu_all: {failed} row(s) failed; {time.perf_counter() - t0:.0f} s; {out / 'table.md'}",
    )
    return min(failed, 100)


def check_budgets() -> list[str]:
    """The budget rules of ``gpu_rows`` that do not hold (empty: all hold)."""
    problems = []
    total = PREFLIGHT_BUDGET_S + sum(r.budget_s for r in ROWS)
    if total > TOTAL_BUDGET_S:
        problems.append(f"budgets add up to {total} s > {TOTAL_BUDGET_S} s")
    for call in (1, 2):
        limits = sum(r.limit_s for r in ROWS if r.call == call)
        if limits > CALL_LIMIT_S:
            problems.append(f"call {call}'s limits add up to {limits} s > {CALL_LIMIT_S} s")
    for r in ROWS:
        if r.budget_s > r.limit_s:
            problems.append(f"{r.name}: budget {r.budget_s} s > limit {r.limit_s} s")
    return problems


if __name__ == "__main__":
    sys.exit(main())
