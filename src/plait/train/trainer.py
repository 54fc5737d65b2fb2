"""The training loop: thin, deterministic, the same on one rank and on many.

One optimizer step consumes ``train.global_batch`` sequences. Each data-parallel rank
takes its contiguous slice of the step's global batch (:class:`BatchSampler`) and cuts
it into ``accumulation_steps`` micro-batches; the loss is token-weighted (every counted
target of the global batch weighs the same: :mod:`plait.parallel.token_weight`), so the
gradient is the mean over the global batch's tokens whatever the layout. Only the last micro-step
communicates (``no_sync``; ZeRO stages 2/3 reduce-scatter every micro-step because they
keep only gradient shards). Checkpoints see a :class:`~plait.checkpoint.TrainState`.

The trainer uses only the public path a user's own loop uses: ``parallelize`` returns a
:class:`~plait.parallel.model.ParallelModel` whose ``step`` runs forward and
backward (the pipeline schedule when pp > 1), and :class:`plait.optim.Optimizer` wraps
AdamW: under ZeRO it holds fp32 master shards; it clips by the true global gradient
norm, applies the fp16 loss scaler, and skips a step whose loss or gradients are not
finite. A skipped step leaves weights, optimizer state and the learning-rate schedule's
step untouched (the schedule advances with *applied* steps only) and is reported in the
metrics. The per-rank memory report (:mod:`plait.train.memory`) is printed once, after
the first step (when the optimizer state exists), and written with that step's metrics.
Rank 0 also feeds the configured loggers (:mod:`plait.train.loggers`) and ends with a
one-line summary (losses, wall time, tokens/s, where metrics and checkpoint are).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import nn

from plait.checkpoint import Checkpointing, TrainState
from plait.config import Config
from plait.data import BackgroundLoader, BatchSampler, check_enough, make_datasets
from plait.data.read_count import READ
from plait.host_scalar import HostScalar
from plait.mesh import Mesh
from plait.model.factory import (
    describe_model,
    model_flops_per_token,
    model_params,
)
from plait.optim import StepReport
from plait.parallel.checks import validate_run
from plait.parallel.lora import adapter_parameters
from plait.parallel.precision import NonFiniteError
from plait.train.data_reads import data_read_line, gather_read_bytes, stage_parts, to_device
from plait.train.faults import FaultMonitor, restart_count
from plait.train.intervals import CheckpointIntervals
from plait.train.loggers import Logger, make_loggers, scalars_of
from plait.train.lr_schedule import lr_at
from plait.train.matrix_optim import optimizer_note
from plait.train.memory import (
    MemoryReport,
    PeakMemory,
    gather_peak_memory,
    host_peak_bytes,
    memory_report,
    peak_memory,
    reset_host_peak,
    reset_peak_memory,
)
from plait.train.metrics import MetricsWriter, Progress, StepMetrics, peak_flops
from plait.train.profile import StepProfiler, check_memory_snapshot
from plait.train.report import (
    RunFacts,
    RunSummary,
    banner,
    step_memory_line,
    stop_line,
    straggler_note,
    stragglers_line,
    summary_line,
    timeline_line,
)
from plait.train.sample import TrainingSamples
from plait.train.start import one_device_model, start_parallel
from plait.train.validation import Validation


class Trainer:
    """Builds model, data and optimizer for ``cfg`` on ``mesh`` and runs the loop."""

    def __init__(self, cfg: Config, mesh: Mesh, show_progress: bool = True) -> None:
        world = mesh.world_size
        validate_run(cfg, world)
        check_memory_snapshot(cfg.log.memory_snapshot, mesh.device.type)
        self.cfg = cfg
        self.mesh = mesh
        self.device = mesh.device
        self.is_main = mesh.rank == 0
        self.micro_batch = cfg.micro_batch(world)
        self.accum = cfg.accumulation_steps(world)

        base = one_device_model(cfg, self.device)
        self.base = base  # the one-device model; parallelize shards it in place
        self.params = model_params(base, cfg.model)  # before sharding
        self.adapters = adapter_parameters(base, cfg.lora)  # LoRA's, one-device
        self.flops_per_token = model_flops_per_token(base, cfg.model, cfg.train.seq_len)
        self.model_note = describe_model(base, cfg.model)
        self.show_progress = show_progress
        # folder lock, resume / init_from (an elastic restart resumes by itself), saves
        self.checkpoints = Checkpointing(cfg, mesh, restart_count())
        try:
            self._build(cfg, mesh, base)
        except BaseException:
            self.checkpoints.close()
            raise
        self.start_memory = gather_peak_memory(mesh)  # rank 0: every rank's build/load peak

    def _build(self, cfg: Config, mesh: Mesh, base: nn.Module) -> None:
        world = mesh.world_size
        self.model, self.optimizer = start_parallel(base, cfg, mesh, self.checkpoints)

        # text read whole, a prepared shard folder (memory-mapped) or a mixture of folders
        self.train_set, self.val_set = make_datasets(
            cfg.data, cfg.train.seq_len, cfg.model.vocab_size
        )
        check_enough(self.train_set, cfg.train.global_batch, "training")
        dp, dp_rank = mesh.size("dp"), mesh.index("dp")
        seed = cfg.train.seed
        self.sampler = BatchSampler(len(self.train_set), cfg.train.global_batch, dp_rank, dp, seed)
        self.parts = stage_parts(self.model)  # a pipeline's middle stage reads nothing
        t = cfg.train  # validation of any size (a small set: whole, in one padded batch)
        self.validation = Validation(
            self.val_set, t.global_batch, t.eval_batches, dp_rank, dp, seed + 1, self.parts
        )
        read = self._read_batch
        pin = self.device.type == "cuda"
        self.loader = BackgroundLoader(read, cfg.data.prefetch, pin) if cfg.data.prefetch else None
        self.state = TrainState(
            self.model, self.optimizer, self.sampler, mesh, cfg, rank_state=self.model.compressor
        )

        peak = peak_flops(self.device, cfg.log.peak_tflops)
        self.peak_source = peak.source
        self.peak = None if peak.flops is None else peak.flops * world
        """The mesh's peak FLOP/s (MFU's denominator); None when unknown."""
        self.loggers: list[Logger] = make_loggers(cfg) if self.is_main else []
        self.metrics = MetricsWriter(
            cfg.log.metrics if self.is_main else None, self.checkpoints.resume_step
        )
        show = self.is_main and self.show_progress
        self.progress = Progress(cfg.train.steps, cfg.log.progress, cfg.log.log_every, show)
        self.faults = FaultMonitor(cfg, mesh)  # stop requests, stragglers
        self.samples = TrainingSamples(cfg) if cfg.log.sample_every else None
        say = self.progress.message if self.is_main else None
        self.start_step = self.checkpoints.restore(self.state, say)  # optimizer, sampler, RNG
        self.validation.set_order(self.sampler.order)  # a resumed run's order (issue 44)
        self.intervals = CheckpointIntervals(cfg, self.checkpoints, mesh, say)  # 'auto'
        self.profiler = StepProfiler(cfg.log, mesh.rank, self.device, self.model)

    @property
    def sched_step(self) -> int:
        """Applied (not skipped) optimizer steps: the learning-rate schedule's clock."""
        return self.state.sched_step

    # ------------------------------------------------------------------ pieces

    def _read_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of step ``step``'s global batch on the host, ``(batch, seq)`` twice."""
        return self.train_set.batch(self.sampler.rank_indices(step), self.parts)

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of step ``step``'s global batch, ``(batch, seq)`` twice (read
        ahead by the background loader when ``data.prefetch`` > 0)."""
        x, y = self.loader.get(step) if self.loader is not None else self._read_batch(step)
        return to_device(x, self.device), to_device(y, self.device)

    def train_step(self, step: int) -> tuple[float, StepReport]:
        """One optimizer step on the data of step ``step``; returns (global mean loss,
        the optimizer's report). The learning rate follows :attr:`sched_step`."""
        lr = lr_at(self.sched_step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)  # Muon's groups: their own peak
        if self.model.compressor is not None:  # before backward: residuals in step units
            self.model.compressor.set_lr(lr)
        x, y = self._batch(step)
        loss = self.model.step(x, y, micro_batches=self.accum, loss_scale=self.optimizer.loss_scale)
        if self.optimizer.sync_free:  # the step does not wait for the loss: read it after
            pending = HostScalar(loss)
            report = self.optimizer.step()
            mean = pending.value()  # waits for forward + backward, not the optimizer's kernels
            if not math.isfinite(mean):
                raise NonFiniteError(
                    f"optimizer step {self.optimizer.steps}: the loss is not finite ({mean}), "
                    "found after the step (without clipping the step does not wait for the "
                    "loss); stopping. Set precision.nonfinite = 'skip' to skip such steps "
                    "instead, or lower the learning rate."
                )
        else:
            mean = float(loss.item())
            report = self.optimizer.step(loss_finite=math.isfinite(mean))
        self.optimizer.zero_grad(set_to_none=True)
        if not report.skipped:
            self.state.sched_step += 1
        return mean, report

    def memory_report(self) -> MemoryReport:
        """Exact bytes of this rank's parameters, gradients, masters, optimizer state."""
        return memory_report(self.model, self.optimizer, self.mesh.rank)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the validation batches (:mod:`plait.train.validation`)."""
        self.model.eval()
        losses = [
            float(self.model.evaluate(to_device(x, self.device), to_device(y, self.device)))
            for x, y in self.validation.batches()
        ]
        self.model.train()
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ loop

    def run(self) -> RunSummary:
        """Train for ``train.steps`` steps; returns losses and throughput. Releases the
        checkpoint folder's lock however it ends."""
        try:
            summary = self._run()
            self.optimizer.flush()  # a delayed offload update: the model ends updated
            return summary
        finally:
            self.optimizer.close()
            if self.loader is not None:
                self.loader.close()
            self.checkpoints.close()

    def _run(self) -> RunSummary:
        cfg = self.cfg
        t = cfg.train
        if self.start_step >= t.steps:  # a finished run re-submitted: nothing to do
            if self.is_main:
                self.progress.message(
                    f"plait: the run is already complete: {self.checkpoints.source} is at "
                    f"step {self.start_step} and train.steps is {t.steps}; nothing to train"
                )
            self.progress.close()
            self.metrics.close()
            for logger in self.loggers:
                logger.close()
            return RunSummary(
                t.steps,
                [],
                [],
                0.0,
                self.params,
                self.optimizer.skipped,
                last_step=self.start_step,
                already_complete=True,
            )
        if self.is_main:
            self.progress.message(banner(cfg, self.mesh, self._facts()))
        t_start = time.perf_counter()
        read0 = READ.total  # this process's data reads (every rank's gathered at the end)
        straggler_steps = 0
        tokens_per_step = t.global_batch * t.seq_len
        losses: list[float] = []
        vals: list[tuple[int, float]] = []
        times: list[float] = []
        checkpoint: str | None = None
        last, stopped = self.start_step, False
        for step in self.faults.steps(self.start_step, t.steps):  # SIGTERM/SIGINT: stop
            bytes0, secs0 = self.mesh.stats.total_bytes(), self.mesh.stats.total_seconds()
            reset_peak_memory(self.device)
            first = step == self.start_step  # its peaks are reported (host, ZeRO-3's)
            if first:
                self._restart_peaks()
            lr = lr_at(self.sched_step, cfg)
            t0 = time.perf_counter()
            with self.profiler.step(step + 1):  # log.profile's window: a trace per rank
                loss, report = self.train_step(step)
            dt = time.perf_counter() - t0
            self.profiler.after_step(step + 1, peak_memory(self.device))
            peaks = self._step_peaks() if first else None  # read now, gathered below
            moe = self.model.moe_summary() or None  # the step's router figures, before eval
            if self.model.pipeline is not None and cfg.log.timeline and step == t.steps - 1:
                self._draw_timeline(cfg.log.timeline)
            health = self.faults.after_step(dt, self.mesh.stats.total_seconds() - secs0)
            mem = None
            if step == 0:
                rep = self.memory_report()
                mem = rep.as_dict()
                if self.is_main:
                    self.progress.message(rep.format())
            times.append(dt)
            losses.append(loss)
            n = step + 1
            val = None
            if (t.eval_every and n % t.eval_every == 0) or n == t.steps:
                val = self.evaluate()
                vals.append((n, val))
            tps = tokens_per_step / dt
            m = StepMetrics(
                step=n,
                loss=loss,
                lr=lr,
                grad_norm=report.grad_norm,
                tokens_per_s=tps,
                mfu=None if self.peak is None else tps * self.flops_per_token / self.peak,
                step_seconds=dt,
                comm_bytes=self.mesh.stats.total_bytes() - bytes0,
                comm_seconds=self.mesh.stats.total_seconds() - secs0,
                val_loss=val,
                skipped=report.skipped,
                loss_scale=report.loss_scale,
                peak_memory_bytes=peak_memory(self.device),
                memory=mem,
                stragglers=health.as_metrics(),
                moe=moe,
            )
            self.metrics.write(m)
            if peaks is not None:  # gathered after the step's counted traffic
                self._report_step_peaks(n, peaks)
            scalars = scalars_of(dataclasses.asdict(m))
            for logger in self.loggers:
                logger.log(n, scalars)
            self.progress.update(m)
            if self.samples is not None and self.samples.due(n):  # every rank decodes
                line = self.samples.line(self.model, n)
                if self.is_main:
                    self.progress.message(line)
            if health.stragglers:
                straggler_steps += 1
                if straggler_steps == 1 and self.is_main:  # once; the metrics keep them all
                    text = self.faults.describe(n, health)
                    self.progress.message(straggler_note(text, self.mesh.world_size))
            saved = self.checkpoints.after_step(self.state, n, t.steps, stop=health.stop)
            self.intervals.after_step(self.state, n, self.start_step, dt, t.steps)
            checkpoint = str(saved) if saved is not None else checkpoint
            last = n
            if health.stop:
                stopped = n < t.steps
                break
        self.checkpoints.finish()  # an asynchronous save in flight completes (or fails) here
        self.profiler.close()
        data_bytes = gather_read_bytes(self.mesh, READ.total - read0)
        steady = sorted(times[1:] or times)[len(times[1:] or times) // 2] if times else 0.0
        summary = RunSummary(
            t.steps,
            losses,
            vals,
            tokens_per_step / steady if steady else 0.0,
            self.params,
            self.optimizer.skipped,
            wall_seconds=time.perf_counter() - t_start,
            metrics=cfg.log.metrics,
            checkpoint=checkpoint,
            last_step=last,
            stopped_early=stopped,
            data_bytes=data_bytes,
        )
        if self.is_main:
            if stopped:
                sig = self.faults.signals.requested
                self.progress.message(stop_line(last, t.steps, sig, checkpoint))
            if straggler_steps > 1:
                self.progress.message(stragglers_line(straggler_steps, self.faults.reported))
            if data_bytes is not None:
                self.progress.message(data_read_line(data_bytes))
            self.progress.message(summary_line(summary, [lg.name for lg in self.loggers]))
        self.progress.close()
        self.metrics.close()
        for logger in self.loggers:
            logger.close()
        return summary

    def _restart_peaks(self) -> None:
        """Before the run's first step: restart the host and ZeRO-3 peaks."""
        reset_host_peak()
        if self.model.zero is not None:
            self.model.zero.reset_peak_gathered()

    def _step_peaks(self) -> PeakMemory:
        """This rank's peaks since :meth:`_restart_peaks` (host, device, ZeRO-3's)."""
        z = self.model.zero
        transient = None
        if z is not None and z.gatherer is not None:  # ZeRO-3
            transient = z.peak_gathered_bytes + z.peak_grad_buffer_bytes
        return PeakMemory(self.mesh.rank, host_peak_bytes(), peak_memory(self.device), transient)

    def _report_step_peaks(self, n: int, mine: PeakMemory) -> None:
        """Collective: every rank's peaks of step ``n`` (``mine``: this rank's); rank 0
        prints them."""
        peaks = gather_peak_memory(self.mesh, mine)
        if peaks is not None and self.is_main:
            self.progress.message(step_memory_line(peaks, n))

    def _draw_timeline(self, path: str) -> None:
        """Write the last step's measured pipeline timeline to ``path`` (rank 0 draws)."""
        pipe = self.model.pipeline
        assert pipe is not None
        records = pipe.gather_timeline()  # collective over pp
        if records is not None and self.is_main:
            from plait.viz import draw_timeline

            s = pipe.schedule
            bubble = draw_timeline(
                records,
                path,
                f"measured {s.name}, p={s.stages}, m={s.microbatches}",
                ranks=s.stages,
                chunks=s.chunks,
                unit="s",
            )
            self.progress.message(timeline_line(path, bubble))

    def _facts(self) -> RunFacts:
        """What the start banner says about this built run (see :mod:`plait.train.report`)."""
        return RunFacts(
            layout=self.model.describe(),
            params=self.params,
            model_note=self.model_note,
            train_sequences=len(self.train_set),
            val_sequences=len(self.val_set),
            micro_batch=self.micro_batch,
            accumulation=self.accum,
            peak_source=self.peak_source,
            loggers=[lg.name for lg in self.loggers],
            start_memory=self.start_memory or (),
            val_note=self.validation.describe(),
            packing=getattr(self.train_set, "efficiency", None),
            adapters=self.adapters,
            optimizer_note=optimizer_note(self.model, self.cfg),
        )
