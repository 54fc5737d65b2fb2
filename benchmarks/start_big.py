"""Starting a big model: peak host memory per rank and start-up time, per layout (issue 27).

Each row is one ``plait train --steps 1`` run of the built-in transformer in a fresh
launcher process (``python -m plait train --nproc 4 ...``), timed from the launcher's
start: to the start banner (every rank has built, loaded and sharded the model; the
first step starts right after it) and to the end of step 1. The peak host memory of
each rank is the banner's "peak memory at start (build and load)" line: the rank's peak
resident set (``VmHWM``) from process start to the end of build and load, gathered to
rank 0 (on CUDA the line has the device allocator's peak too, reported as well).

Layouts: dp4 ZeRO-3 and tp2 x dp2 (4 ranks each), and (``--init-from``, on by default)
dp4 ZeRO-3 again starting from a consolidated weights file of the same model written by
this script: its start-up minus the first row's is the import time, against the file's
size on disk. Once Hugging Face folders load, ``--init-from DIR`` times one of those.

The model size is a flag (default: dim 1024, 8 layers, 16 heads, vocabulary 32000:
0.17 B parameters, 0.67 GB in fp32), small enough that 4 ranks fit a 24 GB CPU machine
with every rank building the whole model; the issue's ~1 B (``--dim 2048 --layers 16``)
needs the meta-device build or a larger machine.

Run from the repository root (the ``--label`` names the section of RESULTS.md it writes,
so a "before" and an "after" table stand side by side)::

    python benchmarks/start_big.py                                  # print the table
    python benchmarks/start_big.py --label before --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LINE = re.compile(r"plait: peak memory at start \(build and load\): (.*)")
RANK = re.compile(r"rank (\d+) host ([\d,]+) MiB(?:, device ([\d,]+) MiB)?")


@dataclass
class Row:
    """One measured start."""

    name: str
    to_banner_s: float = 0.0
    to_step_s: float = 0.0
    host_mib: dict[int, int] = field(default_factory=dict)
    device_mib: dict[int, int] = field(default_factory=dict)
    note: str = ""


def model_flags(a: argparse.Namespace) -> list[str]:
    """The model and run flags every row shares."""
    return [
        *["--model.dim", str(a.dim), "--model.n_layers", str(a.layers)],
        *["--model.n_heads", str(a.heads), "--model.vocab_size", str(a.vocab)],
        *["--model.max_seq_len", str(a.seq_len), "--seq-len", str(a.seq_len)],
        *["--global-batch", "4", "--steps", "1", "--train.eval_every", "0"],
        *["--train.eval_batches", "1", "--data.max_bytes", "400000", "--progress", "lines"],
        *["--log.peak_tflops", "1", "--metrics", "none", "--launch.threads", "1"],
        *["--device", a.device],
    ]


def measure(name: str, args: list[str], timeout: float) -> Row:
    """Run ``python -m plait train ARGS`` and time its console lines from the start."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    row = Row(name)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tempfile.mkdtemp(prefix="start_big_"),
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append(line.rstrip())
        if line.startswith("plait: mesh") and not row.to_banner_s:
            row.to_banner_s = now
        m = MEMORY_LINE.search(line)
        if m:
            for r, host, dev in RANK.findall(m.group(1)):
                row.host_mib[int(r)] = int(host.replace(",", ""))
                if dev:
                    row.device_mib[int(r)] = int(dev.replace(",", ""))
        if re.match(r"\s*step\s+1\b", line) and not row.to_step_s:
            row.to_step_s = now
        if now > timeout:
            proc.kill()
            break
    code = proc.wait()
    if code != 0 or not row.host_mib:
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"{name}: plait train exited {code}:\n{tail}")
    return row


def write_weights(a: argparse.Namespace, path: Path) -> int:
    """A consolidated weights file of the benchmark's model (seed 1); its size."""
    sys.path.insert(0, str(ROOT / "src"))
    from safetensors.torch import save_file

    from plait.config import ModelConfig
    from plait.model.factory import build_model

    cfg = ModelConfig(
        dim=a.dim, n_layers=a.layers, n_heads=a.heads, vocab_size=a.vocab, max_seq_len=a.seq_len
    )
    model = build_model(cfg, seed=1)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(path))
    del model
    return path.stat().st_size


def table(rows: list[Row], params: int, nproc: int = 4) -> str:
    """The markdown table."""
    out = [
        f"| layout ({nproc} ranks) | start to banner s | start to end of step 1 s | "
        "peak host MiB per rank (build + load) | max | device MiB |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        host = ", ".join(f"{v:,}" for _, v in sorted(r.host_mib.items()))
        dev = ", ".join(f"{v:,}" for _, v in sorted(r.device_mib.items())) or "-"
        name = r.name + (f" ({r.note})" if r.note else "")
        out.append(
            f"| {name} | {r.to_banner_s:.1f} | {r.to_step_s:.1f} | {host} | "
            f"{max(r.host_mib.values()):,} | {dev} |"
        )
    out.append("")
    out.append(f"Model: {params / 1e9:.3f} B parameters ({params * 4 / 1e9:.2f} GB in fp32).")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument(
        "--init-from",
        default="auto",
        help="weights to time the import of ('auto': a consolidated file this script "
        "writes; 'none': skip; or a path)",
    )
    p.add_argument("--label", default="before", help="RESULTS.md section: start_big_<label>")
    p.add_argument("--out", type=Path, help="write the table into this RESULTS.md")
    p.add_argument("--nproc", type=int, default=4, help="ranks of every row")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = p.parse_args()
    if a.tiny:  # 2 ranks, ZeRO-3 from scratch and from a weights file
        a.dim, a.layers, a.heads, a.vocab, a.seq_len, a.nproc = 32, 1, 2, 256, 16, 2
    sys.path.insert(0, str(ROOT / "src"))
    from plait.bench.results import command_line, environment, load_average, write_section

    load0, t_start = load_average(), time.perf_counter()
    flags = model_flags(a)
    n = a.nproc
    zero3 = f"dp{n} ZeRO-3"
    layouts = {
        zero3: ["--nproc", str(n), "--dp", str(n), "--zero", "3"],
        f"tp2 x dp{n // 2}": ["--nproc", str(n), "--tp", "2", "--dp", str(n // 2)],
    }
    if a.tiny:
        del layouts[f"tp2 x dp{n // 2}"]
    rows = []
    for name, layout in layouts.items():
        rows.append(measure(name, [*flags, *layout], a.timeout))
        print(table(rows, 0, n).split("\n")[-3], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights, size = a.init_from, 0
        if a.init_from == "auto":
            path = Path(tmp) / "model.safetensors"
            size, weights = write_weights(a, path), str(path)
        elif a.init_from != "none":
            w = Path(a.init_from)
            size = sum(f.stat().st_size for f in w.rglob("*")) if w.is_dir() else w.stat().st_size
        if weights != "none":
            row = measure(
                f"{zero3} --init-from",
                [*flags, *layouts[zero3], "--init-from", weights],
                a.timeout,
            )
            extra = row.to_banner_s - rows[0].to_banner_s
            row.note = f"{size / 1e9:.2f} GB on disk; import {extra:+.1f} s vs the first row"
            rows.append(row)
    from plait.config import ModelConfig
    from plait.model.factory import build_model

    cfg = ModelConfig(
        dim=a.dim, n_layers=a.layers, n_heads=a.heads, vocab_size=a.vocab, max_seq_len=a.seq_len
    )
    params = sum(t.numel() for t in build_model(cfg, seed=0).parameters())
    text = table(rows, params, n)
    print(text)
    if a.out is not None:
        load1 = load_average()
        busy = " (busy: above 3; times are noisy)" if max(load0, load1) > 3 else ""
        body = "\n".join(
            [
                f"## Start big: memory and start-up, {a.label} (issue 27)",
                "",
                text,
                "",
                f"- {environment()}; {os.cpu_count()} cores; gloo on loopback; one torch "
                "thread per rank.",
                f"- Command: `{command_line(__file__)}` ({time.perf_counter() - t_start:.0f} s).",
                f"- Load average (1 min) {load0:.1f} at the start and {load1:.1f} at the "
                f"end{busy}.",
                f"- Model: dim {a.dim}, {a.layers} layers, {a.heads} heads, vocabulary "
                f"{a.vocab}, sequences of {a.seq_len}, global batch 4, one step, fp32, AdamW.",
            ]
        )
        write_section(a.out, f"start_big_{a.label}", body)


if __name__ == "__main__":
    main()
