"""Every script in ``benchmarks/`` runs in its smallest form (``--tiny``) and prints its
tables, so that no benchmark rots unnoticed.

Each script runs as ``python benchmarks/X.py --tiny`` would, but inside this process
(:func:`run_script`: ``runpy`` with that ``sys.argv``): the interpreter, torch and the
worker pools' forkserver (which has torch and plait imported) are already there, which
saves 2-4 CPU-seconds per script, the cost of a fresh ``python`` plus a fresh forkserver.
What a script changes in the process (torch threads, random state, ``sys.path``,
environment, working folder) is put back, and it must not leave a process group
behind. Scripts that start their own processes (``plait train``, children) still do.

A new script without an entry in :data:`CASES` fails :func:`test_every_script_has_a_case`.
The GPU-only scripts run their CPU forms here; ``gpu_all.sh`` is syntax-checked and
``gpu_all.py --dry`` runs in ``test_gpu_all.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import runpy
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@dataclass(frozen=True)
class Case:
    """One script's tiny run and the tables it must print."""

    args: tuple[str, ...] = ()
    """Flags after ``--tiny``."""
    tables: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    """A header's first cells (joined by `` | ``) -> the leading cells of rows it must have."""


def _rows(*keys: str) -> list[tuple[str, ...]]:
    return [tuple(c.strip() for c in k.split("|")) for k in keys]


IMPLS_ZERO = ("zero3", "fsdp2", "zero1", "zero2", "dp", "zro")
CASES: dict[str, Case] = {
    "attention_gpu": Case(("--documents", "20")),  # run by test_gpu_all.py (gpu_all --dry)
    "checkpoint_stall_gpu": Case(
        ("--device", "cpu"), {"save | stall per save ms": _rows("sync", "async")}
    ),
    "checkpoint_vs_dcp": Case(
        tables={
            "layout | plait save ms": _rows("dp x2", "zero3 x2"),
            "layout | state per rank MB": _rows("dp x2", "zero3 x2"),
        }
    ),
    "collectives": Case(
        tables={
            "algorithm | N | steps": _rows("ring | 2", "tree | 2"),
            "N | size | algorithm": _rows("2 | 4 B | ring", "2 | 2 KiB | library"),
        }
    ),
    "compression": Case(
        tables={
            "run | dp bus bytes / step": _rows(
                "plait none",
                "plait fp16",
                "plait bf16",
                "plait topk",
                "plait powersgd",
                "torch DDP",
                "torch DDP-fp16",
                "torch DDP-bf16",
                "torch DDP-powersgd",
            ),
            "link | none": _rows("1 Gbit/s", "10 Gbit/s", "100 Gbit/s", "one node (NVLink)"),
        }
    ),
    "compression_convergence": Case(
        tables={"steps | method": _rows("2 | none", "2 | powersgd r4")}
    ),
    "context_parallel": Case(
        tables={
            "cp | longest seq measured": _rows("1", "2"),
            "cp | attention": _rows(
                "1 | torch SDPA (reference)", "2 | ring", "2 | ulysses", "2 | allgather"
            ),
        }
    ),
    "data_loader": Case(
        tables={
            "loader | tokens/s per rank": _rows(
                "prepared folder, read in the step",
                "prepared folder, background thread",
                "mixture 0.7/0.3, read in the step",
                "mixture 0.7/0.3, background thread",
            ),
            "workers | tokens": _rows("1", "2"),
        }
    ),
    "data_order_memory": Case(
        tables={
            "component | windows": _rows(
                "sampler permutation | 20,000",
                "sampler permutation | 200,000",
                "mixture blend (2 sources) | 20,000",
                "mixture blend (2 sources) | 200,000",
            )
        }
    ),
    "dp_vs_torch_ddp": Case(tables={"world | plait median ms (IQR)": _rows("2")}),
    "eager_step": Case(
        tables={
            "loop | step (ms)": _rows("plain", "plait", "plait, AdamW default kernel"),
            "AdamW kernel (optimizer step alone) | CPU (ms)": _rows("default", "foreach", "fused"),
        }
    ),
    "family_step": Case(
        tables={"family | step (ms)": _rows("llama", "qwen2", "qwen3", "phi3", "olmo2")}
    ),
    "generate": Case(
        tables={
            "model | new tokens": [
                ("dim 32, 1 layers, 8 heads / 4 kv", "4", name)
                for name in ("plait kv-cache", "plait recompute", "plait hf-cache", "hf generate")
            ]
        }
    ),
    "gpu_all": Case(),  # checked by tests/benchmarks/test_gpu_all.py (--dry)
    "gpu_plan_rows": Case(),  # run by gpu_all --dry
    "gpu_rows": Case(),  # gpu_all's rows (a module), checked by test_gpu_all.py
    "gpu_step": Case(  # checked by test_gpu_step_tiny
        (
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--peak-tflops",
            "1",
            "--rows",
            "plait eager,plain eager,plait compiled + float8",
        )
    ),
    "packing": Case(tables={"layout | windows": _rows("padded", "packed")}),
    "loss_chunk": Case(tables={"loss_chunk | fwd+bwd ms": _rows("0", "32")}),
    "moe": Case(
        tables={
            "tokens | loop ms": _rows("256"),
            "model | ep": _rows(
                "dense, same active params | 1",
                "MoE 8 experts top-2 | 1",
                "MoE 8 experts top-2 | 2",
            ),
            "step | aux loss 0.01 (max / min)": _rows("1", "2", "4"),
        }
    ),
    "moe_zero": Case(
        tables={"ZeRO | dtype": _rows("0 | fp32", "1 | fp32", "2 | fp32", "3 | fp32", "3 | bf16")}
    ),
    "lora": Case(
        tables={
            "ZeRO | run": _rows(
                "0 | full", "0 | lora r8", "0 | lora r16", "3 | full", "3 | lora r8", "3 | lora r16"
            )
        }
    ),
    "muon_step": Case(
        tables={
            "ZeRO | optimizer": _rows(
                *(f"{z} | {o}" for z in (0, 1, 3) for o in ("adamw", "muon", "adafactor"))
            )
        }
    ),
    "offload": Case(
        tables={
            "threads | fused (M params/s)": _rows("1"),
            "variant | step (s)": _rows("before", "after"),
            "ranks | path": _rows(
                "1 | eager (clip 0)",
                "1 | two-pass (clipped)",
                "2 | eager (clip 0)",
                "2 | two-pass: opt.step() alone",
                "pp2, stage 0 | two-pass: opt.step() alone",
                "pp2, stage 1 | two-pass: opt.step() alone",
            ),
        }
    ),
    "pipeline_bubble": Case(
        tables={
            "p | m | schedule | measured bubble": _rows(
                "2 | 4 | gpipe", "2 | 4 | 1f1b", "2 | 4 | interleaved (v=2)", "2 | 4 | zb"
            ),
            "p | m | schedule | predicted / 1F1B (unit costs)": _rows(
                "2 | 4 | interleaved (v=2)", "2 | 4 | zb"
            ),
        }
    ),
    "pipeline_profile": Case(tables={"rank | compute ms": _rows("0", "1")}),
    "planner_block_profile": Case(tables={"hidden x tokens": _rows("32 x 1024 (h2)")}),
    "planner_vs_measured": Case(tables={"layout | state MiB pred / meas": _rows("tp2 + SP")}),
    "elastic_recovery": Case(
        tables={"recovery from | ranks | detection s": _rows("memory | 3 -> 2", "disk | 3 -> 2")}
    ),
    "ray_vs_torchrun": Case(tables={"launcher | ranks": _rows("nproc | 2", "torchrun | 2")}),
    "activation_offload": Case(
        tables={
            "variant (CPU) | step s": _rows(
                "none", "offload every block", "offload first half", "selective recompute"
            ),
            "Llama 3 8B, 32k, 1 x H100 (planned) | device activations GiB": _rows(
                "none", "offload every block"
            ),
        }
    ),
    "zero3_memory": Case(
        tables={
            "generation (ZeRO-3) | model MiB": _rows(
                "before: whole model gathered", "after: unit by unit"
            ),
            "step (ZeRO-3) | tensor peak above shards MiB": _rows(
                "before: outputs kept", "after: outputs folded"
            ),
        }
    ),
    "start_big": Case(
        tables={
            "layout (2 ranks)": _rows(
                "dp2 ZeRO-3", "dp2 ZeRO-3 --init-from (0.00 GB on disk; import"
            )
        }
    ),
    "tp_traffic": Case(
        tables={
            "impl | median ms (IQR)": _rows("dp2", "tp2", "tp2+sp", "dtensor-tp2", "dtensor-tp2+sp")
        }
    ),
    "zero_pipeline": Case(
        tables={
            "variant | step s (median)": _rows(
                "zero1", "zero2 step", "zero2 micro", "zero3 keep", "zero3 reshard"
            )
        }
    ),
    "zero_vs_fsdp2": Case(
        tables={
            "world | impl | median ms (IQR)": [("2", k) for k in IMPLS_ZERO],
            "N | stage": _rows("2 | 0", "2 | 1", "2 | 2", "2 | 3"),
        }
    ),
}
"""Every script of ``benchmarks/`` (by stem) and what its ``--tiny`` run must print."""


def tables(text: str) -> dict[tuple[str, ...], list[list[str]]]:
    """The markdown tables in ``text``: header cells -> data rows' cells."""
    out: dict[tuple[str, ...], list[list[str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("|---"):
            head = tuple(c.strip() for c in line.strip().strip("|").split("|"))
            rows = out.setdefault(head, [])
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
    return out


def run_script(name: str, args: tuple[str, ...]) -> str:
    """``python benchmarks/<name>.py --tiny ARGS`` in this process; its stdout."""
    path = BENCH / f"{name}.py"
    saved_argv, saved_path, saved_env, cwd = sys.argv[:], sys.path[:], dict(os.environ), os.getcwd()
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    py_rng, np_rng, dtype = random.getstate(), np.random.get_state(), torch.get_default_dtype()
    buf = io.StringIO()
    code: object = 0
    try:
        os.chdir(ROOT)  # "run from the repository root", as each script says
        if os.environ.get("PYTHONPATH"):  # for the processes a script starts
            os.environ["PYTHONPATH"] = os.pathsep.join(
                os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p
            )
        sys.argv = [str(path), "--tiny", *args]
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                code = e.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        torch.set_default_dtype(dtype)
    text = buf.getvalue()
    assert code in (0, None), f"{name} --tiny exited {code}:\n{text[-3000:]}"
    assert not (dist.is_available() and dist.is_initialized()), f"{name} left a process group"
    return text


def test_every_script_has_a_case() -> None:
    """A script added to benchmarks/ needs a ``--tiny`` run here (and in the README)."""
    assert sorted(p.stem for p in BENCH.glob("*.py")) == sorted(CASES)
    readme = (BENCH / "README.md").read_text()
    missing = [n for n in CASES if f"`{n}.py`" not in readme]
    assert not missing, f"benchmarks/README.md does not list {missing}"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.tables))
def test_tiny_run_prints_its_tables(name: str) -> None:
    case = CASES[name]
    got = tables(run_script(name, case.args))
    for header, want in case.tables.items():
        lead = tuple(c.strip() for c in header.split("|"))
        found = [rows for head, rows in got.items() if head[: len(lead)] == lead]
        assert found, f"{name}: no table with header {header!r}; tables: {list(got)}"
        rows = [r for block in found for r in block]
        for key in want:
            hit = [
                r
                for r in rows
                if tuple(r[: len(key) - 1]) == key[:-1] and r[len(key) - 1].startswith(key[-1])
            ]
            assert hit, f"{name}: table {header!r} has no row {key}; rows: {rows}"


def test_gpu_step_tiny(tmp_path: Path) -> None:
    """``gpu_step.py --device cpu --tiny`` (docs/gpu.md's command): a row per run with
    tokens/s and a finite loss; rows this plait cannot run are listed as skipped."""
    rows_json = tmp_path / "rows.json"
    out = run_script("gpu_step", (*CASES["gpu_step"].args, "--json", str(rows_json)))
    assert "| run | tokens/s | MFU | peak memory GiB | loss after N steps |" in out
    got = {row["run"]: row for row in json.loads(rows_json.read_text())["rows"]}
    for name in ("plait eager", "plain eager"):
        assert got[name]["tokens_per_s"] > 0 and math.isfinite(got[name]["loss"])
    assert "skipped" in got["plait compiled + float8"]  # no float8 on a CPU
    # same model, seed, batch and optimizer settings: the first step's loss agrees
    assert abs(got["plait eager"]["loss"] - got["plain eager"]["loss"]) < 1e-4


def test_gpu_all_sh_parses() -> None:
    """``benchmarks/gpu_all.sh`` (the GPU machine's runner) is valid bash."""
    r = subprocess.run(
        ["bash", "-n", str(BENCH / "gpu_all.sh")], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
