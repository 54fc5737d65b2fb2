"""The planner's predictions against real runs on this machine, and against published runs.

Part 1 (measured here). Every layout of :data:`ROWS` trains the built-in ``small`` model
(0.87 M parameters, fp32, AdamW) with plait's own :class:`~plait.train.trainer.Trainer`
on the built-in corpus, in a pool of gloo ranks of one thread each. Just before the
steps the same ranks calibrate the machine all at once (:func:`plait.bench.calibrate.
calibrate_body`: matmul, attention and element-wise rates, operator overhead, optimizer
rate, alpha-beta fits of the collectives at this rank count, and the in-step cost of a
tensor-parallel all-reduce on pairs of ranks), and re-measure the compute
rates just after; each rate is timed on two clocks, wall and process CPU time. For each
layout the script prints

* rank 0's **state bytes** (weights, gradients, fp32 masters, AdamW state, exactly as
  :func:`plait.train.memory.memory_report` reads them from the tensors; plait's
  gradients are views into its data-parallel buckets, so the buckets count as the
  gradients) and the **bucket** bytes beyond the gradients they hold (a runtime whose
  buckets copy the gradients), against the planner (pipeline stage 0, shard 0), filed
  the same way on both sides;
* **activation bytes** of one micro-batch on rank 0's stage, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters and buffers
  excluded), against the planner's list of saved tensors for plait's block (see
  :mod:`plait.plan.activations`) and, for scale, Korthikanti et al.'s 16-bit-with-
  dropout formula per layer (with the planner's embedding/head terms);
* **step time**: the median over steps of the slowest rank's ``Trainer.train_step``
  (after a barrier), in process CPU time against the planner with the CPU-time profile
  (less the pipeline bubble, during which a rank sleeps in a receive and its CPU
  time does not advance), and in wall time against the planner with the wall-clock
  profile. The machine is
  shared: CPU time is blind to the time other jobs take the cores (and to ranks
  oversubscribing them), wall time is not; the load average is recorded per row.

Layouts the runtime does not run yet (:func:`plait.parallel.checks.validate_run` refuses
them) are listed as "not yet available"; they become measured rows as soon as it does.

Part 2 (published). The planner's utilisation for large runs whose configuration the
papers state, with the datasheet presets, against the reported figure.

Run from the repository root::

    python benchmarks/planner_vs_measured.py                       # print
    python benchmarks/planner_vs_measured.py --out benchmarks/RESULTS.md  # its section
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the pool's workers resolve the body by module name
    sys.path.insert(0, str(ROOT))

BODY = "benchmarks.planner_vs_measured:measure_body"
COMPUTE_BODY = "plait.bench.measure:compute_body"
TP_GRID_BODY = "plait.bench.tp_block:grid_body"
CALIBRATE_BODY = "plait.bench.calibrate:calibrate_body"
QUIET = 0.10
"""Background CPU use (fraction of all cores) below which a measurement starts."""
MODEL = "small"
SEQ = 128


@dataclass(frozen=True)
class Row:
    """One layout to measure."""

    name: str
    world: int
    parallel: dict[str, Any] = field(default_factory=dict)
    global_batch: int = 16
    micro_batch: int = 8


ROWS = [
    Row("dp1", 1, {"dp": 1}, 8, 8),
    Row("dp2", 2, {"dp": 2}, 16, 8),
    Row("dp2, accumulation 2", 2, {"dp": 2}, 16, 4),
    Row("zero3 dp2", 2, {"dp": 2, "zero": 3}, 16, 8),
    Row("tp2", 2, {"dp": 1, "tp": 2}, 8, 8),
    Row("tp2 + SP", 2, {"dp": 1, "tp": 2, "sequence_parallel": True}, 8, 8),
    Row("dp2 x tp2", 4, {"dp": 2, "tp": 2}, 16, 8),
    Row("pp2 1F1B", 2, {"dp": 1, "pp": 2}, 8, 2),
    Row("cp2", 2, {"dp": 1, "cp": 2}, 8, 8),
]


# --------------------------------------------------------------------------- rank side


def _storage_bytes(tensors: list[Any], exclude: set[int]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_body(ctx: Any, cfg_kwargs: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """On every rank: train ``warmup + steps`` steps, time them, then count bytes."""
    import torch

    from plait import comm
    from plait.config import Config, DataConfig, LogConfig, ModelConfig, ParallelConfig, TrainConfig
    from plait.parallel.data_parallel import DataParallel
    from plait.train.trainer import Trainer

    cfg = Config(
        model=ModelConfig(**cfg_kwargs["model"]),
        parallel=ParallelConfig(**cfg_kwargs["parallel"]),
        train=TrainConfig(**cfg_kwargs["train"]),
        data=DataConfig(max_bytes=2_000_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )
    p = cfg.parallel
    mesh = ctx.mesh(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp)
    trainer = Trainer(cfg, mesh, show_progress=False)
    world = mesh.axis("pp", "dp", "cp", "tp")
    times, cpu_times = [], []
    for step in range(warmup + steps):
        comm.barrier(world)
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)

    # one more micro-step, with every saved tensor counted
    base = trainer.base
    fixed = {t.untyped_storage().data_ptr() for t in [*base.parameters(), *base.buffers()]}
    saved: list[Any] = []

    def pack(t: Any) -> Any:
        saved.append(t)
        return t

    idx = next(iter(trainer.sampler.micro_batches(warmup + steps, trainer.micro_batch)))
    x, y = trainer.train_set.batch(idx)
    if trainer.model.context is not None:  # cp: this rank's tokens, as ParallelModel.step feeds
        x, y = trainer.model.context.shard(x), trainer.model.context.shard(y)
    stages = trainer.model.stages
    loss_fn = trainer.model.loss_fn
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if stages is None:
            loss = loss_fn(trainer.model(x).float(), y)
        else:  # this rank's pipeline stage on one micro-batch, as the runtime runs it
            piece = stages.chunks[0]
            if piece.tok_embeddings is not None:
                inp = x
            else:  # the hidden states a previous stage would send: (micro, seq, dim)
                inp = torch.randn(x.shape[0], x.shape[1], cfg.model.dim, requires_grad=True)
            out = piece(inp)
            loss = loss_fn(out.float(), y) if piece.output is not None else out.sum()
    activations = _storage_bytes(saved, fixed)
    saved.clear()
    loss.backward()
    # exact bytes of the state this rank holds (after a backward: gradients exist)
    report = trainer.memory_report().bytes
    wrapper = trainer.model.module
    buckets = (
        sum(b for _, _, b in wrapper.bucket_summary())
        if isinstance(wrapper, DataParallel)
        else None
    )
    # plait's gradients are views into its buckets: memory_report files the buckets as
    # gradients, and so does the planner (state); only bucket bytes beyond the
    # gradients they hold (copies, padding) are "DP buckets", as the planner files them
    grad_views = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    extra = max(0, buckets - grad_views) if buckets is not None else None
    grads = report["grads"] - (extra or 0)
    trainer.optimizer.zero_grad(set_to_none=True)
    return {
        "wrapper": type(trainer.model.module).__name__,
        "rank": mesh.rank,
        "times": times[warmup:],
        "cpu_times": cpu_times[warmup:],
        "params": report["params"],
        "grads": grads,
        "master": report["master"],
        "optimizer": report["optimizer"] + report["optimizer_scalars"],
        "buckets": extra,
        "activations": activations,
    }


# --------------------------------------------------------------------------- parent side


def _config(row: Row) -> dict[str, Any]:
    from plait.model import MODEL_PRESETS

    model = MODEL_PRESETS[MODEL]
    return {
        "model": {k: getattr(model, k) for k in model.__dataclass_fields__},
        "parallel": dict(row.parallel),
        "train": {
            "global_batch": row.global_batch,
            "micro_batch": row.micro_batch,
            "seq_len": SEQ,
            "steps": 1000,
        },
    }


def _full_config(row: Row) -> Any:
    from plait.config import Config, ModelConfig, ParallelConfig, TrainConfig

    c = _config(row)
    return Config(
        model=ModelConfig(**c["model"]),
        parallel=ParallelConfig(**c["parallel"]),
        train=TrainConfig(**c["train"]),
    )


def available(row: Row) -> str | None:
    """None when the runtime runs ``row``, else the reason it refuses."""
    from plait.errors import ConfigError
    from plait.parallel.checks import validate_run

    try:
        validate_run(_full_config(row), row.world)
    except (ConfigError, TypeError) as e:  # TypeError: a config field not there yet
        return str(e)
    return None


def predict(row: Row, hw: Any) -> Any:
    """The planner's estimate for ``row``: the config mapped exactly as ``plait train``'s
    memory check maps it (:func:`plait.plan.fit.plan_inputs`)."""
    from plait.plan import Query, estimate
    from plait.plan.fit import plan_inputs

    spec, layout, precision, runtime = plan_inputs(_full_config(row), row.world)
    return estimate(Query.of_layout(spec, layout, hw, precision, runtime, SEQ, 0.0), layout)


def korthikanti_bytes(row: Row, e: Any) -> float:
    """Korthikanti et al.'s per-layer formula (16-bit, dropout, unfused attention) x the
    layers of pipeline stage 0, plus the planner's embedding/head terms of that stage."""
    from plait.plan.activations import (
        embedding_activation_bytes,
        head_activation_bytes,
        korthikanti_layer_bytes,
    )
    from plait.plan.memory import stage_layers

    s, lay = e.model, e.layout
    t, sp = lay.tp, lay.sequence_parallel
    per_layer = korthikanti_layer_bytes(SEQ, lay.micro_batch, s.hidden, s.n_heads, t, sp)
    edge = embedding_activation_bytes(e.query, lay)
    if lay.pp == 1:
        edge += head_activation_bytes(e.query, lay)
    return stage_layers(s.n_layers, lay.pp, 0) * per_layer + edge


def _cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all cores busy over ``interval`` seconds (from /proc/stat; 0 elsewhere)."""

    def sample() -> tuple[int, int]:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return 0, 0
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return 0.0 if t1 == t0 else 1.0 - (i1 - i0) / (t1 - t0)


def wait_quiet(threshold: float, max_wait_s: float) -> float:
    """Wait (at most ``max_wait_s``) until other processes keep less than ``threshold``
    of the cores busy; returns the last busy fraction seen."""
    deadline = time.monotonic() + max_wait_s
    busy = _cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        time.sleep(2.0)
        busy = _cpu_busy()
    return busy


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def _mb(n: float) -> str:
    return f"{n / 2**20:.3f}"


def profile_here(pool: Any, hw: Any, quick: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """``hw`` re-measured on ``pool``'s ranks, all at once: the compute rates, and the
    collectives' alpha-beta fits at this rank count (ranks share the cores, so both
    depend on how many run); ``quick``: the calibration's short form."""
    from plait.bench.calibrate import profile_from_results

    res = pool.run(CALIBRATE_BODY, quick, timeout_s=600.0)
    here, _ = profile_from_results(res, hw.memory_bytes, hw.name)
    return here, res


def _block_ratio(e: Any) -> float:
    """The ratio the planner multiplies ``e``'s blocks by: the profile's tensor-parallel
    block grid at a tp-2 layout (compute and collectives), else its block composition
    ratio, at the block's hidden size and tokens per micro-batch and rank."""
    from plait.plan.overheads import block_scale, tp_block_ratio

    lay = e.layout
    tokens = lay.micro_batch * SEQ / lay.cp
    tp = tp_block_ratio(e.hardware, lay, e.model.hidden, tokens)
    return block_scale(e.hardware, e.model.hidden, tokens) if tp is None else tp


def measured_table(
    hw: Any, steps: int, warmup: int, max_wait_s: float, only: str, quick: bool = False
) -> list[str]:
    """Run every available row and format the comparison (``quick``: the short forms of
    the calibration and of the rate measurements)."""
    from plait.bench.calibrate import profile_from_results
    from plait.bench.results import load_average
    from plait.bench.tp_block import mean_grids
    from plait.plan.memory import copies_gradients, stage_memory, stage_params
    from plait.testing import WorkerPool

    lines = [
        "| layout | state MiB pred / meas | err | DP buckets MiB pred / meas | "
        "activations MiB meas | plait fp32 pred (err) | Korthikanti pred (err) | "
        "CPU ms/step pred / meas | err | wall ms/step pred / meas | err | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    parts = [
        "| layout | compute | TP comm | CP comm | PP comm + bubble | "
        "DP/ZeRO comm exposed (total) | optimizer | other | predicted (no bubble) | "
        "measured | block ratio | predicted without it (err) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pools: dict[int, Any] = {}
    try:
        for row in ROWS:
            if only and only not in row.name:
                continue
            why = available(row)
            if why is not None:
                lines.append(f"| {row.name} | not yet available | | | | | | | | | | |")
                continue
            pool = pools.get(row.world)
            if pool is None:
                pool = pools[row.world] = WorkerPool(row.world, comm_timeout_s=120.0)
            pool.start()
            # the machine is shared: start when it is quiet (if it gets quiet), and
            # measure the rates of exactly this many concurrent ranks just before and
            # after the steps, on both clocks
            wait_quiet(QUIET, max_wait_s)
            load0 = load_average()
            _, before = profile_here(pool, hw, quick)
            res = pool.run(BODY, _config(row), steps, warmup, timeout_s=600.0)
            after = pool.run(COMPUTE_BODY, quick, timeout_s=600.0)
            tp_after = pool.run(TP_GRID_BODY, quick, timeout_s=600.0)
            load1 = load_average()
            # the tensor-parallel blocks (pairs) measured before and after the steps, the
            # mean per point, as the compute rates are pooled over both
            before = [
                {**b, "tp_grid": mean_grids([b["tp_grid"], a])} if "tp_grid" in b else b
                for b, a in zip(before, tp_after, strict=True)
            ]
            # the fresh compute rates with each rank's own collectives, ring, pipeline
            # and tensor-parallel blocks
            pooled = [*before, *({**before[i], "compute": c} for i, c in enumerate(after))]
            prof = {
                c: profile_from_results(pooled, hw.memory_bytes, hw.name, clock=c)[0]
                for c in ("wall", "cpu")
            }
            e = predict(row, prof["wall"])
            e_cpu = predict(row, prof["cpu"])
            # a rank idle in its pipeline bubble sleeps in the transport's receive: process
            # CPU time does not advance, so the CPU-time prediction leaves the bubble out
            cpu_pred = e_cpu.time.total - e_cpu.time.bubble
            # the same profile without the block composition ratio, for comparison
            e_plain = predict(
                row, replace(prof["cpu"], block_scale=(), tp_block_scale=(), sp_block_scale=())
            )
            plain_pred = e_plain.time.total - e_plain.time.bubble
            r0 = next(r for r in res if r["rank"] == 0)
            state_meas = r0["params"] + r0["grads"] + r0["master"] + r0["optimizer"]
            step_meas = statistics.median(
                max(ts) for ts in zip(*(r["times"] for r in res), strict=True)
            )
            cpu_meas = statistics.median(
                max(ts) for ts in zip(*(r["cpu_times"] for r in res), strict=True)
            )
            # rank 0: pipeline stage 0, shard 0
            mem = stage_memory(e.query, e.layout, 0)
            # activations of one micro-batch on that stage (the in-flight factor apart)
            act_pred = (mem.activations + mem.embedding_head) / mem.in_flight
            k = korthikanti_bytes(row, e)
            meas_act = r0["activations"]
            sp0 = stage_params(e.model, e.layout, 0)
            bucket_pred = (
                sp0.params * e.precision.grad_bytes
                if copies_gradients(e.layout, e.precision, e.runtime)
                else 0
            )
            buckets = "n/a" if r0["buckets"] is None else _mb(r0["buckets"])
            lines.append(
                f"| {row.name} | {_mb(mem.state)} / {_mb(state_meas)} | "
                f"{_err(mem.state, state_meas)} | {_mb(bucket_pred)} / {buckets} | "
                f"{_mb(meas_act)} | {_mb(act_pred)} ({_err(act_pred, meas_act)}) | "
                f"{_mb(k)} ({_err(k, meas_act)}) | "
                f"{1e3 * cpu_pred:.1f} / {1e3 * cpu_meas:.1f} | "
                f"{_err(cpu_pred, cpu_meas)} | "
                f"{1e3 * e.time.total:.1f} / {1e3 * step_meas:.1f} | "
                f"{_err(e.time.total, step_meas)} | {load0:.0f} -> {load1:.0f} |"
            )
            t = e_cpu.time
            ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
            parts.append(
                f"| {row.name} | {ms(t.compute + t.recompute)} | {ms(t.tp_comm)} | "
                f"{ms(t.cp_comm)} | {ms(t.pp_comm)} + {ms(t.bubble)} | "
                f"{ms(t.dp_comm)} ({ms(t.dp_comm_total)}) | "
                f"{ms(t.optimizer)} | {ms(t.other)} | {ms(cpu_pred)} | {ms(cpu_meas)} | "
                f"{_block_ratio(e_cpu):.3f} | {ms(plain_pred)} ({_err(plain_pred, cpu_meas)}) |"
            )
    finally:
        for pool in pools.values():
            pool.close()
    return [
        *lines,
        "",
        "Predicted CPU time per step by component (ms); block ratio: the calibrated "
        "ratio the blocks are charged, interpolated at the row's hidden size and tokens per "
        "micro-batch: the block composition ratio (`Hardware.block_scale`), or for tp = 2 "
        "the tensor-parallel block grid's (`tp_block_scale`, `sp_block_scale`), which also "
        "multiplies the blocks' TP collectives; without it: the profile with no grid:",
        "",
        *parts,
    ]


# --------------------------------------------------------------------------- published


@dataclass(frozen=True)
class Published:
    """A published run whose configuration the paper states."""

    name: str
    cite: str
    model: Any
    hardware: str
    runtime: str
    seq: int
    layout: Any
    reported: float
    metric: str  # "hfu" (counts recomputation) or "mfu"
    assumptions: str
    alternative: Any = None
    """A layout for what the paper leaves open, reported as a sensitivity figure."""
    alternative_label: str = ""


NARAYANAN = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
    "Clusters Using Megatron-LM' (SC21, arXiv:2104.04473), table 1: per-GPU throughput "
    "as a percentage of the 312 TFLOP/s peak, FLOPs counted with their eq. 3, which "
    "includes the recomputed forward (= HFU here)"
)
DUBEY = (
    "Dubey et al. 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), table 4: BF16 "
    "MFU of Llama 3 405B pre-training at sequence 8192; section 3.3.2: FSDP shards the "
    "optimizer state and gradients but keeps the weights gathered after forward "
    "(ZeRO-2 here), 8K sequences trained without activation checkpointing, an "
    "interleaved pipeline schedule (its figure 6 draws 2 stages per rank)"
)


def published_runs() -> list[Published]:
    """The runs compared in part 2 (configurations as the papers state them)."""
    from dataclasses import replace

    from plait.plan import Layout, ModelSpec
    from plait.plan.modelspec import MODEL_SPECS

    def megatron(
        name: str, layers: int, h: int, heads: int, t: int, p: int, gpus: int, batch: int,
        pct: float,
    ) -> Published:  # fmt: skip
        spec = ModelSpec(name, layers, h, heads, heads, 4 * h, 51200, "gpt", 2048)
        dp = gpus // (t * p)
        lay = Layout(dp=dp, tp=t, pp=p, micro_batch=1, microbatches=batch // dp, recompute="full")
        return Published(
            f"Megatron-LM GPT {name}, {gpus} x A100-80GB",
            NARAYANAN,
            spec,
            "a100-80gb",
            "megatron",
            2048,
            lay,
            pct,
            "hfu",
            f"t={t}, p={p}, {gpus} GPUs, batch {batch}, sequence 2048, vocabulary 51200 as "
            "stated; micro-batch 1, non-interleaved 1F1B, full recomputation and no "
            "sequence parallelism (2021) assumed",
        )

    llama = MODEL_SPECS["llama3-405b"]

    def llama_row(gpus: int, dp: int, per_dp: int, pct: float) -> Published:
        lay = Layout(
            dp=dp, tp=8, pp=16, micro_batch=1, microbatches=per_dp, zero=2,
            schedule="interleaved", chunks=8, recompute="none",
            sequence_parallel=True, pp_grad_reduce="microbatch", edge_trim=1,
        )  # fmt: skip
        return Published(
            f"Llama 3 405B, {gpus} x H100-80GB",
            DUBEY,
            llama,
            "h100-80gb",
            "megatron-flash",
            8192,
            lay,
            pct,
            "mfu",
            f"TP 8, CP 1, PP 16, DP {dp}, {per_dp} sequences of 8192 per DP group as "
            "stated; micro-batch 1, ZeRO-2 with gradients reduce-scattered after each "
            "backward (FSDP), no recomputation, one block fewer on the first and the last "
            "stage (126 = 16 x 8 - 2) as described; interleaved with one block per model "
            "chunk (v=8, the paper does not state v) and Megatron sequence parallelism "
            "assumed",
            replace(lay, chunks=2),
            "v=2",
        )

    return [
        megatron("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 0.43),
        megatron("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 0.47),
        megatron("1T", 128, 25600, 160, 8, 64, 3072, 3072, 0.52),
        llama_row(8192, 64, 32, 0.43),
        llama_row(16384, 128, 16, 0.41),
    ]


def published_table() -> list[str]:
    """The planner's utilisation against the reported figures."""
    from plait.plan import Query, estimate
    from plait.plan.hardware import hardware_preset
    from plait.plan.layout import PRECISIONS, RUNTIMES

    lines = [
        "| run | metric | reported | planner | error | largest overhead | "
        "memory GiB/rank (fits 80 GB?) | sensitivity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    cites: list[str] = []
    for r in published_runs():

        def run(layout: Any, r: Published = r) -> Any:
            q = Query.of_layout(
                r.model, layout, hardware_preset(r.hardware), PRECISIONS["bf16-mixed"],
                RUNTIMES[r.runtime], r.seq, headroom=0.0,
            )  # fmt: skip
            return estimate(q, layout)

        e = run(r.layout)
        pred = e.hfu if r.metric == "hfu" else e.mfu
        t = e.time
        over = {
            "bubble": t.bubble, "TP comm": t.tp_comm, "recompute": t.recompute,
            "DP comm": t.dp_comm, "PP comm": t.pp_comm,
        }  # fmt: skip
        big = max(over, key=lambda k: over[k])
        alt = ""
        if r.alternative is not None:
            a = run(r.alternative)
            alt = f"{r.alternative_label}: {100 * (a.hfu if r.metric == 'hfu' else a.mfu):.1f}%"
        if r.cite not in cites:
            cites.append(r.cite)
        ref = cites.index(r.cite) + 1
        lines.append(
            f"| {r.name} [{ref}] | {r.metric.upper()} | {100 * r.reported:.0f}% | "
            f"{100 * pred:.1f}% | {100 * (pred - r.reported):+.1f} points "
            f"({100 * (pred - r.reported) / r.reported:+.0f}%) | "
            f"{big} {100 * over[big] / t.total:.0f}% | "
            f"{e.memory.total / 2**30:.1f} ({'yes' if e.fits else 'no'}) | {alt} |"
        )
        notes.append(f"- {r.name}: {r.assumptions}.")
    refs = [f"[{i}] {c}." for i, c in enumerate(cites, 1)]
    return [*lines, "", *notes, "", *refs]


# --------------------------------------------------------------------------- main


def _profile_line(hw: Any) -> str:
    ar = hw.intra.fit("all_reduce")
    return (
        f"`{hw.name}`: matmul up to {hw.matmul.peak / 1e9:.1f} GFLOP/s, attention up to "
        f"{hw.attention.peak / 1e9:.1f} GFLOP/s, element-wise up to "
        f"{hw.elementwise.peak / 1e9:.1f} GB/s, {hw.op_overhead_s * 1e6:.1f} us per operator, "
        f"all-reduce alpha {ar[0] * 1e6:.0f} us, B {ar[1] / 1e9:.2f} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    from plait.bench.calibrate import calibrate
    from plait.bench.results import write_section
    from plait.plan.profile_toml import load_hardware

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="use this hardware profile instead of calibrating")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per layout")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--out", help="rewrite this script's section of this markdown file")
    ap.add_argument("--only", default="", help="measure only rows whose name contains this")
    ap.add_argument("--no-published", action="store_true", help="skip part 2")
    ap.add_argument(
        "--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine"
    )
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args(argv)
    if args.tiny:  # one 2-rank row, quick calibrations, no wait for a quiet machine
        args.steps, args.warmup, args.only, args.max_wait = 1, 0, "tp2 + SP", 0.0

    t0 = time.time()
    if args.profile:
        hw = load_hardware(args.profile)
    else:
        hw, _ = calibrate(2, quick=args.tiny)
    measured = measured_table(
        hw, args.steps, args.warmup, args.max_wait, args.only, quick=args.tiny
    )
    published = [] if args.no_published else published_table()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/planner_vs_measured.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = [
        "## Planner vs measured (issue 6)",
        "",
        f"Written by `{cmd.strip()}` on {stamp} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch fp32, "
        f"gloo ranks of one thread; {args.steps} measured steps per layout after "
        f"{args.warmup}; {time.time() - t0:.0f} s). Model `{MODEL}` (0.87 M parameters), "
        f"sequence {SEQ}, AdamW, plait's Trainer.",
        "",
        "### Measured on this machine",
        "",
        *measured,
        "",
        "### Published large-scale runs",
        "",
        *published,
        "",
        f"Reference profile (`--profile`, used for memory and names): {_profile_line(hw)}.",
    ]
    out = "\n".join(text)
    print(out)
    if args.out:
        write_section(Path(args.out), "planner_vs_measured", out.rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
