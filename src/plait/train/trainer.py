"""The training loop: thin, deterministic, the same on one rank and on many.

One optimizer step consumes ``train.global_batch`` sequences. Each data-parallel rank
takes its contiguous slice of the step's global batch (:class:`BatchSampler`) and cuts
it into ``accumulation_steps`` micro-batches; every micro-step's loss is divided by the
number of micro-steps and the data-parallel wrapper averages over ranks, so the gradient
is the mean over the global batch whatever the layout. Only the last micro-step
communicates (``no_sync``; ZeRO stages 2/3 reduce-scatter every micro-step because they
keep only gradient shards).

The optimizer is always a :class:`~plait.parallel.zero.optim.ZeroOptimizer` around
AdamW: under ZeRO it holds fp32 master shards; it clips by the true global gradient
norm, applies the fp16 loss scaler, and skips a step whose loss or gradients are not
finite. A skipped step leaves weights, optimizer state and the learning-rate schedule's
step untouched (the schedule advances with *applied* steps only) and is reported in the
metrics. The per-rank memory report (:mod:`plait.train.memory`) is printed at start and
after the first step (when the optimizer state exists) and written with the first
step's metrics.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.config import Config
from plait.mesh import Mesh
from plait.model import Transformer, flops_per_token, lm_loss, param_count
from plait.parallel.parallelize import parallelize
from plait.parallel.pipeline.engine import PipelineEngine, PipelineOptimizer
from plait.parallel.precision import DynamicLossScaler
from plait.parallel.tensor.loss import vocab_parallel_loss
from plait.parallel.tensor.optim import TensorParallelOptimizer
from plait.parallel.zero import ZeroDataParallel
from plait.parallel.zero.optim import StepReport, ZeroOptimizer
from plait.train.checkpoint import Checkpointing
from plait.train.data import BatchSampler, TokenDataset, check_enough, load_tokens, split_train_val
from plait.train.faults import FaultMonitor
from plait.train.memory import MemoryReport, memory_report, peak_memory, reset_peak_memory
from plait.train.metrics import MetricsWriter, Progress, StepMetrics, peak_flops


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up to the peak
    (after the linear scaling rule, if on), then cosine decay to ``peak·min_lr_ratio``."""
    t = cfg.train
    peak = t.effective_lr()
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    low = peak * t.min_lr_ratio
    return low + 0.5 * (peak - low) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases or 1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    t = cfg.train
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_at(0, cfg),
        betas=(t.beta1, t.beta2),
    )


@dataclass
class RunSummary:
    """What a finished run reports."""

    steps: int
    losses: list[float]
    val_losses: list[tuple[int, float]]
    tokens_per_s: float
    params: int
    skipped_steps: int = 0


class Trainer:
    """Builds model, data and optimizer for ``cfg`` on ``mesh`` and runs the loop."""

    def __init__(self, cfg: Config, mesh: Mesh, show_progress: bool = True) -> None:
        world = mesh.world_size
        cfg.validate(world)
        self.cfg = cfg
        self.mesh = mesh
        self.device = mesh.device
        self.is_main = mesh.rank == 0
        self.micro_batch = cfg.micro_batch(world)
        self.accum = cfg.accumulation_steps(world)

        torch.manual_seed(cfg.train.seed)
        base = Transformer(cfg.model, seed=cfg.train.seed).to(self.device)
        self.base = base
        self.checkpoints = Checkpointing(cfg, mesh)  # resume / init_from, periodic saves
        self.checkpoints.load_weights(base)  # before sharding: every layout starts from them
        self.model = parallelize(base, mesh, cfg)
        self.tp = mesh.size("tp")  # tp > 1: logits vocabulary-sharded, norm summed over tp
        self.loss_fn = vocab_parallel_loss(mesh, cfg.model.vocab_size) if self.tp > 1 else lm_loss
        pp = mesh.size("pp") > 1  # the step runs the pipeline schedule (PipelineEngine)
        self.pipe = PipelineEngine(self.model, mesh, cfg, self.loss_fn) if pp else None
        prec = cfg.precision
        scaler = (
            DynamicLossScaler(prec.loss_scale, prec.loss_scale_window)
            if prec.dtype == "fp16"
            else None
        )
        opt_kw: dict[str, Any] = {
            "max_norm": cfg.train.grad_clip,
            "scaler": scaler,
            "nonfinite": prec.nonfinite,
        }
        self.optimizer = (
            ZeroOptimizer(self.model, make_optimizer(base, cfg), **opt_kw)
            if self.tp == 1 and not pp  # tp > 1: the clipping norm summed over tp too
            else TensorParallelOptimizer(self.model, make_optimizer(base, cfg), mesh, **opt_kw)
            if not pp  # pp > 1: also over the pipeline stages
            else PipelineOptimizer(self.model, make_optimizer(base, cfg), mesh, **opt_kw)
        )
        self.sched_step = 0  # applied (not skipped) optimizer steps: the schedule's clock

        tokens = load_tokens(cfg.data)
        train_tokens, val_tokens = split_train_val(tokens, cfg.data.val_fraction)
        self.train_set = TokenDataset(train_tokens, cfg.train.seq_len)
        self.val_set = TokenDataset(val_tokens, cfg.train.seq_len)
        check_enough(self.train_set, cfg.train.global_batch, "training")
        check_enough(self.val_set, cfg.train.global_batch, "validation")
        dp, dp_rank = mesh.size("dp"), mesh.index("dp")
        seed = cfg.train.seed
        self.sampler = BatchSampler(len(self.train_set), cfg.train.global_batch, dp_rank, dp, seed)
        self.val_sampler = BatchSampler(
            len(self.val_set), cfg.train.global_batch, dp_rank, dp, seed + 1
        )

        self.params = param_count(cfg.model)
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak = peak_flops(self.device, cfg.log.peak_tflops) * world
        self.metrics = MetricsWriter(
            cfg.log.metrics if self.is_main else None, self.checkpoints.resume_step
        )
        self.progress = Progress(
            cfg.train.steps, cfg.log.progress, cfg.log.log_every, self.is_main and show_progress
        )
        self.faults = FaultMonitor(cfg, mesh)  # stop requests, stragglers
        self.start_step = self.checkpoints.restore(self)  # optimizer, schedule, sampler, RNG

    # ------------------------------------------------------------------ pieces

    def _micro_batches(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in self.sampler.micro_batches(step, self.micro_batch):
            x, y = self.train_set.batch(idx)  # (micro, seq), (micro, seq)
            yield x.to(self.device), y.to(self.device)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)  # (micro, seq, vocab) or, tp > 1, (micro, seq, padded vocab/tp)
        return self.loss_fn(logits.float(), y)

    def _global_mean(self, value: torch.Tensor) -> float:
        """Average a scalar over the data-parallel ranks."""
        v = value.detach().to(torch.float64).reshape(1).clone()
        comm.all_reduce(v, self.mesh.axis("dp"), op="avg")
        return float(v.item())

    def train_step(self, step: int) -> tuple[float, StepReport]:
        """One optimizer step on the data of step ``step``; returns (global mean loss,
        the optimizer's report). The learning rate follows :attr:`sched_step`."""
        lr = lr_at(self.sched_step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = self._micro_batches(step)
        if self.pipe is not None:  # the schedule runs every micro-batch, dp-reduced
            xs, ys = zip(*batches, strict=True)
            scale = self.optimizer.scaler.scale if self.optimizer.scaler is not None else 1.0
            total += self.pipe.train(torch.cat(xs), torch.cat(ys), scale)
            batches = iter(())
        for k, (x, y) in enumerate(batches):
            last = k == self.accum - 1
            no_sync = getattr(self.model, "no_sync", None)
            sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
            with sync:
                loss = self._loss(x, y)
                self.optimizer.scale_loss(loss / self.accum).backward()
            total += loss.detach().double() / self.accum
        mean = self._global_mean(total)
        report = self.optimizer.step(loss_finite=math.isfinite(mean))
        self.optimizer.zero_grad(set_to_none=True)
        if not report.skipped:
            self.sched_step += 1
        return mean, report

    def memory_report(self) -> MemoryReport:
        """Exact bytes of this rank's parameters, gradients, masters, optimizer state."""
        return memory_report(self.model, self.optimizer, self.mesh.rank)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_batches`` global batches."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        n = self.cfg.train.eval_batches
        for b in range(n):
            idx = self.val_sampler.rank_indices(b)
            x, y = self.val_set.batch(idx)
            if self.pipe is not None:
                total += self.pipe.evaluate(x.to(self.device), y.to(self.device)) / n
                continue
            total += self._loss(x.to(self.device), y.to(self.device)).double() / n
        self.model.train()
        return self._global_mean(total)

    # ------------------------------------------------------------------ loop

    def run(self) -> RunSummary:
        """Train for ``train.steps`` steps; returns losses and throughput."""
        cfg = self.cfg
        t = cfg.train
        if self.is_main:
            self.progress.message(self._banner())
            self.progress.message(self.memory_report().format())
        tokens_per_step = t.global_batch * t.seq_len
        losses: list[float] = []
        vals: list[tuple[int, float]] = []
        times: list[float] = []
        for step in self.faults.steps(self.start_step, t.steps):  # SIGTERM/SIGINT: stop
            bytes0, secs0 = self.mesh.stats.total_bytes(), self.mesh.stats.total_seconds()
            reset_peak_memory(self.device)
            lr = lr_at(self.sched_step, cfg)
            t0 = time.perf_counter()
            loss, report = self.train_step(step)
            dt = time.perf_counter() - t0
            if self.pipe is not None and cfg.log.timeline and step == t.steps - 1:
                self._draw_timeline(cfg.log.timeline)
            health = self.faults.after_step(dt, self.mesh.stats.total_seconds() - secs0)
            mem = None
            if step == 0:
                rep = self.memory_report()
                mem = rep.as_dict()
                if self.is_main:
                    self.progress.message("after the first step: " + rep.format())
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
                mfu=tps * self.flops_per_token / self.peak,
                step_seconds=dt,
                comm_bytes=self.mesh.stats.total_bytes() - bytes0,
                comm_seconds=self.mesh.stats.total_seconds() - secs0,
                val_loss=val,
                skipped=report.skipped,
                loss_scale=report.loss_scale,
                peak_memory_bytes=peak_memory(self.device),
                memory=mem,
                stragglers=health.as_metrics(),
            )
            self.metrics.write(m)
            self.progress.update(m)
            if health.stragglers and self.is_main:
                self.progress.message(self.faults.describe(n, health))
            self.checkpoints.after_step(self, n, stop=health.stop)
            if health.stop:
                break
        self.progress.close()
        self.metrics.close()
        steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        return RunSummary(
            t.steps, losses, vals, tokens_per_step / steady, self.params, self.optimizer.skipped
        )

    def _draw_timeline(self, path: str) -> None:
        """Write the last step's measured pipeline timeline to ``path`` (rank 0 draws)."""
        assert self.pipe is not None
        records = self.pipe.gather_timeline()  # collective over pp
        if records is not None and self.is_main:
            from plait.viz import draw_timeline

            s = self.pipe.schedule
            bubble = draw_timeline(
                records,
                path,
                f"measured {s.name}, p={s.stages}, m={s.microbatches}",
                ranks=s.stages,
                chunks=s.chunks,
                unit="s",
            )
            self.progress.message(f"plait: wrote {path} (measured bubble {bubble:.1%})")

    def _banner(self) -> str:
        cfg, t = self.cfg, self.cfg.train
        lr_note = (
            f"lr {t.effective_lr():.2e} (linear scaling rule: {t.lr:.2e} x "
            f"{t.global_batch}/{t.base_batch})"
            if t.scale_lr
            else f"lr {t.lr:.2e}"
        )
        if isinstance(self.model, ZeroDataParallel):
            z = self.model
            zero_note = (
                f"ZeRO stage {z.stage} over dp: shard groups of {z.shard_group.size}, "
                f"replicated x{z.replicate_group.size}, {len(z.units)} units"
                + (f", offload {z.offload}" if z.offload != "none" else "")
            )
        else:
            zero_note = "plain data parallel (bucketed all-reduce)"
        if self.tp > 1:
            sp = cfg.parallel.sequence_parallel
            sp_note = ", sequence parallel" if sp else ""
            zero_note = (
                f"tensor parallel tp {self.tp} (Megatron plan, vocabulary-parallel loss"
                f"{sp_note}); {zero_note}"
            )
        if self.pipe is not None:
            zero_note = f"{self.pipe.describe()}; {zero_note}"
        prec = cfg.precision
        prec_note = f"params/compute {prec.dtype}, gradient reduction " + (
            prec.dtype if prec.reduce_dtype == "auto" else prec.reduce_dtype
        )
        if prec.dtype != "fp32":
            prec_note += ", fp32 master weights"
        if prec.dtype == "fp16":
            prec_note += f", dynamic loss scale {prec.loss_scale:g} (K={prec.loss_scale_window})"
        return (
            f"plait: {self.mesh.describe()}\n"
            f"plait: {zero_note}; {prec_note}; recompute {t.recompute}\n"
            f"plait: model {self.params / 1e6:.2f} M parameters "
            f"({cfg.model.n_layers} layers, dim {cfg.model.dim}); "
            f"{len(self.train_set):,} training / {len(self.val_set):,} validation sequences "
            f"of {t.seq_len} tokens\n"
            f"plait: global batch {t.global_batch} = dp {self.mesh.size('dp')} x micro-batch "
            f"{self.micro_batch} x "
            f"{'pipeline micro-batches' if self.mesh.size('pp') > 1 else 'accumulation'} "
            f"{self.accum}; {lr_note}; "
            f"{t.steps} steps on {self.device.type}"
        )
