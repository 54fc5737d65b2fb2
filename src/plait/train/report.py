"""What a training run tells its console (rank 0), and the summary it returns.

The trainer (:mod:`plait.train.trainer`) only calls these: :func:`banner` at the start
(mesh, layout, precision, model, data, batch, learning rate, each rank's peak memory
while building and loading (:func:`start_memory_line`; the first step's,
:func:`step_memory_line`), outputs), the notes of the
loop (:func:`straggler_note`, :func:`timeline_line`) and the end (:func:`stop_line`,
:func:`stragglers_line`, :func:`summary_line`). The per-rank memory report is
:meth:`plait.train.memory.MemoryReport.format`. Every function returns text; none prints.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from plait.config import Config
from plait.data import truncation_note
from plait.mesh import Mesh
from plait.train.lr_schedule import schedule_note
from plait.train.memory import PeakMemory


@dataclass
class RunSummary:
    """What a finished run reports."""

    steps: int
    losses: list[float]
    val_losses: list[tuple[int, float]]
    tokens_per_s: float
    params: int
    skipped_steps: int = 0
    wall_seconds: float = 0.0
    """From the start of the loop to its end (evaluation and checkpoints included)."""
    metrics: str | None = None
    """The metrics JSONL written, if any."""
    checkpoint: str | None = None
    """The last checkpoint saved, if any."""
    last_step: int = 0
    """Optimizer steps done when the run ended (``steps`` unless it stopped early)."""
    stopped_early: bool = False
    """A stop request (SIGTERM/SIGINT) ended the run before ``steps``."""
    already_complete: bool = False
    """The run resumed from a checkpoint at or beyond ``steps``: nothing was trained."""
    data_bytes: list[int] | None = None
    """Data bytes each rank read during the loop, in rank order (on rank 0; None on the
    others and when nothing was trained): :mod:`plait.train.data_reads`."""


@dataclass(frozen=True)
class RunFacts:
    """What the start banner says about a built run besides its config and mesh."""

    layout: str
    """The parallel layout (:meth:`~plait.parallel.model.ParallelModel.describe`)."""
    params: int
    """Parameters of the one-device model."""
    model_note: str
    """The model's description (:func:`~plait.model.factory.describe_model`)."""
    train_sequences: int
    val_sequences: int
    micro_batch: int
    accumulation: int
    """Micro-batches per step (pipeline micro-batches when pp > 1)."""
    peak_source: str
    """Where the MFU peak comes from."""
    loggers: Sequence[str]
    """The names of rank 0's loggers."""
    start_memory: Sequence[PeakMemory] = ()
    """Every rank's peak memory while building and loading
    (:func:`~plait.train.memory.gather_peak_memory`; empty: not measured)."""
    val_note: str = ""
    """How many windows the validation set holds and how it is evaluated
    (:meth:`plait.train.validation.Validation.describe`)."""
    packing: float | None = None
    """Real tokens / window tokens of packed training data (None: not packed)."""
    adapters: int = 0
    """LoRA: the adapters' parameters in the one-device model (0: no LoRA)."""
    optimizer_note: str = ""
    """Which parameters which optimizer steps (Muon, Adafactor; empty: AdamW)."""


def lora_line(cfg: Config, adapters: int, params: int) -> str:
    """The banner's LoRA line: rank, scale, targets, what is trained."""
    lo = cfg.lora
    share = 100.0 * adapters / max(params, 1)
    return (
        f"plait: LoRA rank {lo.rank}, alpha {lo.alpha:g} (scale {lo.scale:g}) on "
        f"{','.join(lo.target_names)}: {adapters:,} adapter parameters trained "
        f"({share:.2f}% of the model's); the base is frozen ({cfg.precision.dtype})"
        + (f"; adapters from {lo.init_from}" if lo.init_from else "")
    )


def _offload_note(on: bool, blocks: int) -> str:
    """The banner's words for ``train.activation_offload`` (nothing when off)."""
    if not on:
        return ""
    which = f"the first {blocks} block(s)" if blocks else "every block"
    return f"; activations of {which} offloaded to host memory"


def banner(cfg: Config, mesh: Mesh, run: RunFacts) -> str:
    """The lines printed before the first step."""
    t = cfg.train
    lr_note = (
        f"lr {t.effective_lr():.2e} (linear scaling rule: {t.lr:.2e} x "
        f"{t.global_batch}/{t.base_batch})"
        if t.scale_lr
        else f"lr {t.lr:.2e}"
    ) + f"; {schedule_note(cfg)}"
    zero_note = run.layout
    if cfg.parallel.sequence_parallel and mesh.size("tp") > 1:
        zero_note += "; sequence parallel"
    prec = cfg.precision
    prec_note = f"params/compute {prec.dtype}, gradient reduction " + (
        prec.dtype if prec.reduce_dtype == "auto" else prec.reduce_dtype
    )
    if prec.dtype != "fp32":
        prec_note += ", fp32 master weights"
    if prec.dtype == "fp16":
        prec_note += f", dynamic loss scale {prec.loss_scale:g} (K={prec.loss_scale_window})"
    return (
        f"plait: {mesh.describe()}\n"
        f"plait: {zero_note}; {prec_note}; recompute {t.recompute}"
        f"{'; torch.compile per block' if t.compile else ''}"
        f"{_offload_note(t.activation_offload, t.activation_offload_blocks)}\n"
        f"plait: model {run.params / 1e6:.2f} M parameters ({run.model_note}); "
        f"{run.train_sequences:,} training / {run.val_sequences:,} validation sequences "
        f"of {t.seq_len} tokens"
        + (f" (packed samples: {run.packing:.1%} real tokens)" if run.packing is not None else "")
        + (f"; {run.val_note}" if run.val_note else "")
        + "\n"
        f"plait: global batch {t.global_batch} = dp {mesh.size('dp')} x micro-batch "
        f"{run.micro_batch} x "
        f"{'pipeline micro-batches' if mesh.size('pp') > 1 else 'accumulation'} "
        f"{run.accumulation}; {lr_note}; "
        f"{t.steps} steps on {mesh.device.type}\n"
        + (f"{lora_line(cfg, run.adapters, run.params)}\n" if cfg.lora.enabled else "")
        + f"plait: MFU peak {run.peak_source}"
        + (f"\nplait: {run.optimizer_note}" if run.optimizer_note else "")
        + (f"\n{start_memory_line(run.start_memory)}" if run.start_memory else "")
        + outputs_note(cfg, run.loggers)
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def start_memory_line(peaks: Sequence[PeakMemory], span: str = "at start (build and load)") -> str:
    """One line: each rank's peak host memory (resident set), device memory (allocator
    peak, where the device reports one) and ZeRO-3's counted transient (where given)
    over ``span``: from process start to the end of building the model and loading its
    weights, or a training step (:func:`step_memory_line`)."""
    ranks = []
    for m in peaks:
        text = f"rank {m.rank} host {_mib(m.host_bytes)}"
        if m.device_bytes is not None:
            text += f", device {_mib(m.device_bytes)}"
        if m.transient_bytes is not None:
            text += f", ZeRO-3 transient {_mib(m.transient_bytes)}"
        ranks.append(text)
    return f"plait: peak memory {span}: " + "; ".join(ranks)


def step_memory_line(peaks: Sequence[PeakMemory], step: int) -> str:
    """The start line's counterpart for training step ``step`` (each peak restarted
    before it: what the step itself reached)."""
    return start_memory_line(peaks, f"in step {step}")


def outputs_note(cfg: Config, loggers: Sequence[str]) -> str:
    """The banner's tail: where this run writes (metrics, checkpoints, loggers) and data
    notes, each on its own line (empty when there is nothing to say)."""
    t = cfg.train
    outs = [f"metrics {cfg.log.metrics}"] if cfg.log.metrics else []
    if t.checkpoint_dir:
        every = f"every {t.checkpoint_every} steps and " if t.checkpoint_every else ""
        if t.checkpoint_every == "auto":
            every = "at Young's interval (chosen at step 2 from a timed save) and "
        outs.append(f"checkpoints {every}at the end into {t.checkpoint_dir}")
    m = t.memory_checkpoint_every
    if m:
        when = "at Young's interval (chosen at step 2)" if m == "auto" else f"every {m} steps"
        outs.append(f"memory copies (own + a buddy rank's host memory) {when}")
    outs += list(loggers)
    text = f"\nplait: writes {'; '.join(outs)}" if outs else ""
    note = truncation_note(cfg.data)
    return text + (f"\nplait: {note}" if note else "")


def straggler_note(
    description: str, ranks_here: int, cores: int | None = None, threads: int | None = None
) -> str:
    """The one console report of stragglers (later ones go to the metrics only):
    ``description`` of the step, and a note when this machine is oversubscribed (up to
    ``ranks_here`` ranks x ``threads`` threads on ``cores`` cores; default: this
    machine's cores and torch's threads)."""
    text = description + "; later straggler steps are only counted"
    cores = cores if cores is not None else os.cpu_count() or 1
    threads = threads if threads is not None else torch.get_num_threads()
    if ranks_here * threads > cores:
        text += (
            f" (this machine runs up to {ranks_here} ranks x {threads} thread(s) on "
            f"{cores} cores: oversubscribed, so compute times vary)"
        )
    return text


def stragglers_line(steps: int, reported: Mapping[int, int]) -> str:
    """The end-of-run count of straggler steps, with steps flagged per rank."""
    counts = ", ".join(f"rank {r}: {k}" for r, k in sorted(reported.items()))
    return (
        f"plait: stragglers on {steps} steps ({counts}); every step's "
        'are in the metrics ("stragglers")'
    )


def timeline_line(path: str, bubble: float) -> str:
    """The line after the measured pipeline timeline is drawn."""
    return f"plait: wrote {path} (measured bubble {bubble:.1%})"


def stop_line(step: int, steps: int, sig: int | None, checkpoint: str | None) -> str:
    """The one line a run stopped by request prints: at ``step`` of ``steps``, by
    signal ``sig`` on rank 0 (None: a stop signal to another rank)."""
    why = f"{signal.Signals(sig).name} on rank 0" if sig else "a stop signal to another rank"
    where = (
        f"checkpoint {checkpoint}"
        if checkpoint
        else "no checkpoint (train.checkpoint_dir is not set)"
    )
    return f"plait: stopped early at step {step} of {steps} ({why}); {where}"


def summary_line(s: RunSummary, loggers: Sequence[str]) -> str:
    """The end-of-run line: losses, wall time, throughput, where the outputs are."""
    done = len(s.losses)
    parts = [f"plait: done: {done} steps in {s.wall_seconds:.1f} s"]
    if s.losses:
        parts.append(f"final loss {s.losses[-1]:.4f}")
    if s.val_losses:
        parts.append(f"validation loss {s.val_losses[-1][1]:.4f}")
    parts.append(f"{s.tokens_per_s:,.0f} tokens/s")
    outputs = [f"metrics {s.metrics}"] if s.metrics else []
    if s.checkpoint:
        outputs.append(f"checkpoint {s.checkpoint}")
    outputs += list(loggers)
    if outputs:
        parts.append("; ".join(outputs))
    return "; ".join(parts)
