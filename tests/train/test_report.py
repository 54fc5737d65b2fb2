"""The trainer's console text (:mod:`plait.train.report`), line by line, exactly.

The strings are the ones ``plait train`` prints (docs and the CLI tests match pieces of
them); each branch of each line is pinned here without running a step.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from plait import init_mesh
from plait.config import Config
from plait.testing import WorkerContext, WorkerPool
from plait.train.memory import PeakMemory, host_peak_bytes, reset_host_peak
from plait.train.report import (
    RunFacts,
    RunSummary,
    banner,
    outputs_note,
    start_memory_line,
    step_memory_line,
    stop_line,
    straggler_note,
    stragglers_line,
    summary_line,
    timeline_line,
)
from plait.train.trainer import Trainer
from tests.tiny import tiny_config

M = "tests.train.test_report"

FACTS = RunFacts(
    layout="plain data parallel (bucketed all-reduce)",
    params=41_120,
    model_note="2 layers, dim 32",
    train_sequences=5_937,
    val_sequences=312,
    micro_batch=8,
    accumulation=1,
    peak_source="log.peak_tflops = 1 TFLOP/s",
    loggers=[],
)


def _with(cfg: Config, **sections: dict[str, object]) -> Config:
    """``cfg`` with fields of its sections replaced: ``_with(cfg, train={...})``."""
    changes = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    return dataclasses.replace(cfg, **changes)


def test_banner_names_mesh_layout_model_batch_and_peak() -> None:
    cfg = tiny_config(steps=2)
    assert banner(cfg, init_mesh(), FACTS) == (
        "plait: mesh pp1 x dp1 x cp1 x tp1 (1 ranks); rank 0: pp=0, dp=0, cp=0, tp=0\n"
        "plait: plain data parallel (bucketed all-reduce); params/compute fp32, gradient "
        "reduction fp32; recompute none\n"
        "plait: model 0.04 M parameters (2 layers, dim 32); 5,937 training / 312 validation "
        "sequences of 32 tokens\n"
        "plait: global batch 8 = dp 1 x micro-batch 8 x accumulation 1; lr 3.00e-03; 2 "
        "warm-up step(s), then cosine decay to x0.1; 2 steps on cpu\n"
        "plait: MFU peak log.peak_tflops = 1 TFLOP/s"
    )
    offload = _with(cfg, train={"activation_offload": True, "activation_offload_blocks": 1})
    assert "recompute none; activations of the first 1 block(s) offloaded to host memory\n" in (
        banner(offload, init_mesh(), FACTS)
    )
    every = _with(cfg, train={"activation_offload": True})
    assert "; activations of every block offloaded to host memory\n" in banner(
        every, init_mesh(), FACTS
    )
    packed = dataclasses.replace(FACTS, packing=0.9634)
    assert (
        "5,937 training / 312 validation sequences of 32 tokens (packed samples: 96.3% real "
        "tokens)\n" in banner(cfg, init_mesh(), packed)
    )


def test_banner_precision_and_learning_rate_notes() -> None:
    cfg = _with(
        tiny_config(steps=2),
        train={"scale_lr": True, "base_batch": 4},
        precision={"dtype": "fp16"},
    )
    text = banner(cfg, init_mesh(), FACTS)
    assert (
        "; params/compute fp16, gradient reduction fp16, fp32 master weights, dynamic loss "
        "scale 65536 (K=2000); recompute none\n" in text
    )
    lr = "; lr 6.00e-03 (linear scaling rule: 3.00e-03 x 8/4); 2 warm-up step(s), then "
    assert lr + "cosine decay to x0.1; 2 steps on cpu\n" in text
    bf16 = _with(tiny_config(), precision={"dtype": "bf16", "reduce_dtype": "fp32"})
    assert "params/compute bf16, gradient reduction fp32, fp32 master weights;" in banner(
        bf16, init_mesh(), FACTS
    )


def test_outputs_note_lists_metrics_checkpoints_and_loggers() -> None:
    cfg = tiny_config()
    assert outputs_note(cfg, []) == ""
    cfg = _with(
        cfg,
        log={"metrics": "runs/m.jsonl"},
        train={"checkpoint_dir": "ck", "checkpoint_every": 5},
    )
    assert outputs_note(cfg, ["tensorboard runs/tb"]) == (
        "\nplait: writes metrics runs/m.jsonl; checkpoints every 5 steps and at the end "
        "into ck; tensorboard runs/tb"
    )
    cfg = _with(cfg, log={"metrics": None}, train={"checkpoint_every": 0})
    assert outputs_note(cfg, []) == "\nplait: writes checkpoints at the end into ck"


def test_stop_line_says_why_and_where() -> None:
    assert stop_line(3, 10, int(signal.SIGTERM), "ck/step_00000003") == (
        "plait: stopped early at step 3 of 10 (SIGTERM on rank 0); checkpoint ck/step_00000003"
    )
    assert stop_line(3, 10, None, None) == (
        "plait: stopped early at step 3 of 10 (a stop signal to another rank); no checkpoint "
        "(train.checkpoint_dir is not set)"
    )


def test_straggler_lines() -> None:
    assert straggler_note("step 4: rank 1 slow", 2, cores=8, threads=2) == (
        "step 4: rank 1 slow; later straggler steps are only counted"
    )
    assert straggler_note("step 4: rank 1 slow", 4, cores=2, threads=1) == (
        "step 4: rank 1 slow; later straggler steps are only counted (this machine runs up "
        "to 4 ranks x 1 thread(s) on 2 cores: oversubscribed, so compute times vary)"
    )
    assert stragglers_line(3, {2: 1, 1: 2}) == (
        "plait: stragglers on 3 steps (rank 1: 2, rank 2: 1); every step's are in the metrics "
        '("stragglers")'
    )


def test_summary_and_timeline_lines() -> None:
    s = RunSummary(2, [5.5, 5.4286], [(2, 5.25191)], 170.6, 41_120, wall_seconds=4.25)
    assert summary_line(s, []) == (
        "plait: done: 2 steps in 4.2 s; final loss 5.4286; validation loss 5.2519; 171 tokens/s"
    )
    s = dataclasses.replace(s, val_losses=[], metrics="m.jsonl", checkpoint="ck/step_2")
    assert summary_line(s, ["wandb"]) == (
        "plait: done: 2 steps in 4.2 s; final loss 5.4286; 171 tokens/s; metrics m.jsonl; "
        "checkpoint ck/step_2; wandb"
    )
    empty = RunSummary(2, [], [], 0.0, 1)
    assert summary_line(empty, []) == "plait: done: 0 steps in 0.0 s; 0 tokens/s"
    assert timeline_line("t.png", 0.125) == "plait: wrote t.png (measured bubble 12.5%)"


def test_start_memory_line_names_every_rank() -> None:
    cpu = [PeakMemory(0, 412 * 2**20, None), PeakMemory(1, 1536 * 2**20, None)]
    assert start_memory_line(cpu) == (
        "plait: peak memory at start (build and load): rank 0 host 412 MiB; rank 1 host 1,536 MiB"
    )
    gpu = [PeakMemory(0, 3 * 2**30, 2**30)]
    assert start_memory_line(gpu) == (
        "plait: peak memory at start (build and load): rank 0 host 3,072 MiB, device 1,024 MiB"
    )
    zero3 = [PeakMemory(0, 500 * 2**20, None, 3 * 2**20), PeakMemory(1, 501 * 2**20, None, 0)]
    assert step_memory_line(zero3, 1) == (
        "plait: peak memory in step 1: rank 0 host 500 MiB, ZeRO-3 transient 3 MiB; "
        "rank 1 host 501 MiB, ZeRO-3 transient 0 MiB"
    )
    cfg = tiny_config(steps=2)
    with_line = banner(cfg, init_mesh(), dataclasses.replace(FACTS, start_memory=cpu))
    assert with_line == banner(cfg, init_mesh(), FACTS).replace(
        "TFLOP/s", "TFLOP/s\n" + start_memory_line(cpu)
    )


def test_host_peak_reads_vmhwm_else_getrusage(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  123456 kB\nVmRSS:\t 1000 kB\n")
    assert host_peak_bytes(status) == 123456 * 1024
    fallback = host_peak_bytes(tmp_path / "missing")  # ru_maxrss
    assert 10 * 2**20 < fallback < 64 * 2**30  # a Python process with torch loaded


def test_reset_host_peak_restarts_vmhwm(tmp_path: Path) -> None:
    """The peak restarts from the current resident set (Linux), so a step's peak can be
    read alone; where the file cannot be written it says so."""
    assert not reset_host_peak(tmp_path / "missing" / "clear_refs")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs (not Linux)")
    block = bytearray(b"\x01") * (64 * 2**20)  # 64 MiB written, then returned
    del block
    high = host_peak_bytes()
    assert reset_host_peak()
    assert host_peak_bytes() < high - 32 * 2**20


def _body_start_memory(ctx: WorkerContext) -> tuple[list[PeakMemory] | None, float, str]:
    mesh = ctx.mesh(dp=2)
    trainer = Trainer(tiny_config(steps=1), mesh, show_progress=False)
    text = banner(trainer.cfg, mesh, trainer._facts()) if mesh.rank == 0 else ""
    gathers = [v["calls"] for k, v in mesh.stats.snapshot().items() if k.endswith("/gather")]
    return trainer.start_memory, sum(gathers), text


def test_trainer_gathers_every_ranks_start_memory(pools: Callable[[int], WorkerPool]) -> None:
    """Two ranks: rank 0 holds both ranks' peaks (host > 0; no device peak on the CPU),
    gathered through plait.comm (counted); the banner prints the line."""
    (peaks, counted, text), (other, _, _) = pools(2).run(f"{M}:_body_start_memory")
    assert other is None
    assert peaks is not None and [m.rank for m in peaks] == [0, 1]
    assert all(m.host_bytes > 2**20 and m.device_bytes is None for m in peaks)
    assert counted == 1  # one counted gather of the peaks
    assert start_memory_line(peaks) in text
