"""The rows of ``benchmarks/gpu_all.py``: every GPU figure plait records, with its budget.

One :class:`Row` per figure (or per group of figures one process measures): the call it
belongs to (the GPU machine is lent for 15 minutes, machine start included, and one
command may run 10: the rows are split into two calls), its time limit (the process is
killed there), its budget (what it should take: the budgets add up to at most 7 minutes),
its predicted device and host peaks (checked against the machine before it starts), the
command on the GPU machine and its smallest CPU form (``--dry``).

Budgets, in seconds (limit in brackets)::

    call 1: pytest_gpu 60 (120), calibrate 20 (45), step_plait_eager 15 (45),
            step_plait_compiled 45 (90), step_plait_compiled_float8 45 (90),
            step_plain_eager 12 (40)                                   = 197 (430)
    call 2: step_plain_compiled 40 (90), attention 35 (75), attention_documents 20 (60),
            offload_7b 90 (150), checkpoint_stall 15 (45), loader_cuda 8 (30),
            plan_predictions 5 (30)                                    = 213 (480)
    preflight (each call; torchao's wheel installed once): about 10   =  10

A row added by another issue goes in :data:`ROWS` with the same fields; its budget must
keep the total at or under 420 s (``tests/benchmarks/test_gpu_all.py`` checks it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

PY = sys.executable
MODEL_089B = ["--dim", "2048", "--layers", "16", "--heads", "16", "--kv-heads", "8"]
MODEL_089B += ["--ffn", "5632", "--vocab", "32000"]
MODEL_7B = ["--dim", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000"]
MODEL_7B += ["--ffn", "11008", "--seq", "2048"]
CALIBRATE_DRY = (
    "import sys, torch; from plait.bench.device import device_profile, measure_device; "
    "from plait.plan.hardware import PRESETS; from plait.plan.profile_toml import "
    "dump_hardware; r = measure_device('cpu', torch.float32, (32,), (32,), (2**12,), reps=1, "
    "optimizer_params=2**12); hw = device_profile(PRESETS['h100-80gb'], r, 'gpu_all --dry'); "
    "open(sys.argv[1], 'w').write(dump_hardware(hw)); print('calibrated (dry):', hw.name)"
)
"""The calibration's CPU form: the same measurement code, tiny, over the H100 preset."""
TOTAL_BUDGET_S = 420
"""Seven minutes of work in all (both calls, preflight included)."""
PREFLIGHT_BUDGET_S = 10
CALL_LIMIT_S = 560
"""The limits of one call's rows add up to at most this (a call may run 600 s)."""


@dataclass(frozen=True)
class Row:
    """One row of the GPU run (see the module docstring)."""

    name: str
    call: int
    limit_s: int
    budget_s: int
    device_gb: float
    """Predicted device peak of the GPU form (GB)."""
    host_gb: float
    """Predicted host peak of the GPU form (GB, resident)."""
    what: str
    """What the row measures, one line (docs/gpu.md lists them)."""
    gpu: tuple[str, ...]
    """argv on the GPU machine; ``{out}`` is the output folder."""
    dry: tuple[str, ...]
    """argv of the smallest CPU form."""
    json: bool = False
    """The command writes ``{out}/<name>.jsonl`` (one JSON object a line, as measured)."""


def _step(row: str, name: str, call: int, limit: int, budget: int, what: str) -> Row:
    common = ("benchmarks/gpu_step.py", "--rows", row, "--jsonl", f"{{out}}/{name}.jsonl")
    return Row(
        name,
        call,
        limit,
        budget,
        45.0,
        12.0,
        what,
        (PY, *common, "--device", "cuda", *MODEL_089B, "--steps", "5", "--warmup", "2"),
        (
            PY,
            *common,
            "--device",
            "cpu",
            "--tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--peak-tflops",
            "1",
            "--compile-backend",
            "eager",
        ),
        json=True,
    )


ROWS: tuple[Row, ...] = (
    Row(
        "pytest_gpu",
        1,
        120,
        60,
        20.0,
        16.0,
        "the gpu-marked tests (compile, float8, CUDA attention kernels, memory snapshot, "
        "offload, activation offload, sync-free step); a skip counts as a failure on a GPU "
        "machine",
        (
            PY,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "-rs",
            "--junitxml",
            "{out}/pytest_gpu.xml",
            "tests",
        ),
        (
            PY,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "-rs",
            "--junitxml",
            "{out}/pytest_gpu.xml",
            "tests/bench/test_device.py",
        ),
    ),
    Row(
        "calibrate",
        1,
        45,
        20,
        10.0,
        8.0,
        "plait bench calibrate --device cuda: the planner's GPU profile (bf16 matmul, "
        "attention and memory-bound rates)",
        (
            PY,
            "-m",
            "plait",
            "bench",
            "calibrate",
            "--device",
            "cuda",
            "--quick",
            "--out",
            "{out}/calibration.toml",
        ),
        (PY, "-c", CALIBRATE_DRY, "{out}/calibration.toml"),
    ),
    _step(
        "plait eager",
        "step_plait_eager",
        1,
        45,
        15,
        "0.89 B llama, seq 2048 x batch 4: plait's eager step (bf16, fp32 masters)",
    ),
    _step(
        "plait compiled",
        "step_plait_compiled",
        1,
        90,
        45,
        "the same with train.compile (torch.compile per block)",
    ),
    _step(
        "plait compiled + float8",
        "step_plait_compiled_float8",
        1,
        90,
        45,
        "the same with precision.float8 (torchao, from the carried wheel)",
    ),
    _step(
        "plain eager",
        "step_plain_eager",
        1,
        40,
        12,
        "a hand-written loop on the same model: bf16 autocast, fused AdamW",
    ),
    _step(
        "plain compiled", "step_plain_compiled", 2, 90, 40, "the plain loop on torch.compile(model)"
    ),
    Row(
        "attention",
        2,
        75,
        35,
        12.0,
        8.0,
        "one attention layer fwd+bwd, seq 4096 and 16384: SDPA vs blockwise (fused "
        "kernels, blocks 128/1024/whole) and ring (cp 1); a fused row that fell back fails",
        (
            PY,
            "benchmarks/attention_gpu.py",
            "--repeats",
            "5",
            "--jsonl",
            "{out}/attention.jsonl",
        ),
        (PY, "benchmarks/attention_gpu.py", "--tiny", "--jsonl", "{out}/attention.jsonl"),
        json=True,
    ),
    Row(
        "attention_documents",
        2,
        60,
        20,
        12.0,
        8.0,
        "the same under document masking (an end of document every 2048 tokens)",
        (
            PY,
            "benchmarks/attention_gpu.py",
            "--repeats",
            "3",
            "--documents",
            "2048",
            "--jsonl",
            "{out}/attention_documents.jsonl",
        ),
        (
            PY,
            "benchmarks/attention_gpu.py",
            "--tiny",
            "--documents",
            "20",
            "--jsonl",
            "{out}/attention_documents.jsonl",
        ),
        json=True,
    ),
    Row(
        "offload_7b",
        2,
        150,
        90,
        40.0,
        115.0,
        "7B llama, ZeRO-2 + optimizer offload on one GPU, global batch 16 (1 x 16 "
        "accumulation), full recomputation: tokens/s, MFU, host and device peaks",
        (
            PY,
            "benchmarks/offload.py",
            "--child",
            "after",
            "--device",
            "cuda",
            *MODEL_7B,
            "--batch",
            "1",
            "--accum",
            "16",
            "--dtype",
            "bf16",
            "--recompute",
            "full",
            "--peak-tflops",
            "989",
            "--steps",
            "1",
            "--warmup",
            "1",
        ),
        (PY, "benchmarks/offload.py", "--tiny", "--child", "after"),
    ),
    Row(
        "checkpoint_stall",
        2,
        45,
        15,
        8.0,
        16.0,
        "the training thread's stall per save: synchronous vs train.async_checkpoint, "
        "and a bit-exact resume on the GPU",
        (PY, "benchmarks/checkpoint_stall_gpu.py"),
        (PY, "benchmarks/checkpoint_stall_gpu.py", "--tiny", "--device", "cpu"),
    ),
    Row(
        "loader_cuda",
        2,
        30,
        8,
        1.0,
        8.0,
        "the data loader's CUDA mode: batches pinned (contiguous buffers) by the "
        "background thread, tokens/s per rank",
        (
            PY,
            "benchmarks/data_loader.py",
            "--tokens",
            "20000000",
            "--steps",
            "100",
            "--no-prepare",
        ),
        (PY, "benchmarks/data_loader.py", "--tiny", "--no-prepare"),
    ),
    Row(
        "plan_predictions",
        2,
        30,
        5,
        0.0,
        2.0,
        "the planner's predictions (from the calibrated profile) for the measured rows: "
        "the 0.89 B step and the 7B offload run",
        (
            PY,
            "benchmarks/gpu_plan_rows.py",
            "--profile",
            "{out}/calibration.toml",
            "--jsonl",
            "{out}/plan_predictions.jsonl",
        ),
        (
            PY,
            "benchmarks/gpu_plan_rows.py",
            "--profile",
            "{out}/calibration.toml",
            "--jsonl",
            "{out}/plan_predictions.jsonl",
        ),
        json=True,
    ),
)
