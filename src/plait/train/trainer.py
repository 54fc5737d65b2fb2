"""The training loop: thin, deterministic, the same on one rank and on many.

One optimizer step consumes ``train.global_batch`` sequences. Each data-parallel rank
takes its contiguous slice of the step's global batch (:class:`BatchSampler`) and cuts
it into ``accumulation_steps`` micro-batches; every micro-step's loss is divided by the
number of micro-steps and the data-parallel wrapper averages over ranks, so the gradient
is the mean over the global batch whatever the layout. Only the last micro-step
communicates (``no_sync``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from plait import comm
from plait.config import Config
from plait.mesh import Mesh
from plait.model import Transformer, flops_per_token, lm_loss, param_count
from plait.parallel.data import DataParallel
from plait.parallel.parallelize import parallelize
from plait.train.data import BatchSampler, TokenDataset, check_enough, load_tokens, split_train_val
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
        self.model = parallelize(base, mesh, cfg.parallel)
        self.optimizer = make_optimizer(base, cfg)

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
        self.metrics = MetricsWriter(cfg.log.metrics if self.is_main else None)
        self.progress = Progress(
            cfg.train.steps, cfg.log.progress, cfg.log.log_every, self.is_main and show_progress
        )

    # ------------------------------------------------------------------ pieces

    def _micro_batches(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in self.sampler.micro_batches(step, self.micro_batch):
            x, y = self.train_set.batch(idx)  # (micro, seq), (micro, seq)
            yield x.to(self.device), y.to(self.device)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)  # (micro, seq, vocab)
        return lm_loss(logits.float(), y)

    def _global_mean(self, value: torch.Tensor) -> float:
        """Average a scalar over the data-parallel ranks."""
        v = value.detach().to(torch.float64).reshape(1).clone()
        comm.all_reduce(v, self.mesh.axis("dp"), op="avg")
        return float(v.item())

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step; returns (global mean loss, gradient norm)."""
        lr = lr_at(step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, (x, y) in enumerate(self._micro_batches(step)):
            last = k == self.accum - 1
            sync = (
                self.model.no_sync()
                if isinstance(self.model, DataParallel) and not last
                else contextlib.nullcontext()
            )
            with sync:
                loss = self._loss(x, y)
                (loss / self.accum).backward()
            total += loss.detach().double() / self.accum
        clip = self.cfg.train.grad_clip
        # after the all-reduce every replica holds the same full gradient: the local norm
        # is the global norm
        norm = nn.utils.clip_grad_norm_(self.base.parameters(), clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._global_mean(total), float(norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_batches`` global batches."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        n = self.cfg.train.eval_batches
        for b in range(n):
            idx = self.val_sampler.rank_indices(b)
            x, y = self.val_set.batch(idx)
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
        tokens_per_step = t.global_batch * t.seq_len
        losses: list[float] = []
        vals: list[tuple[int, float]] = []
        times: list[float] = []
        for step in range(t.steps):
            bytes0, secs0 = self.mesh.stats.total_bytes(), self.mesh.stats.total_seconds()
            t0 = time.perf_counter()
            loss, norm = self.train_step(step)
            dt = time.perf_counter() - t0
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
                lr=lr_at(step, cfg),
                grad_norm=norm,
                tokens_per_s=tps,
                mfu=tps * self.flops_per_token / self.peak,
                step_seconds=dt,
                comm_bytes=self.mesh.stats.total_bytes() - bytes0,
                comm_seconds=self.mesh.stats.total_seconds() - secs0,
                val_loss=val,
            )
            self.metrics.write(m)
            self.progress.update(m)
        self.progress.close()
        self.metrics.close()
        steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        return RunSummary(t.steps, losses, vals, tokens_per_step / steady, self.params)

    def _banner(self) -> str:
        cfg, t = self.cfg, self.cfg.train
        lr_note = (
            f"lr {t.effective_lr():.2e} (linear scaling rule: {t.lr:.2e} x "
            f"{t.global_batch}/{t.base_batch})"
            if t.scale_lr
            else f"lr {t.lr:.2e}"
        )
        return (
            f"plait: {self.mesh.describe()}\n"
            f"plait: model {self.params / 1e6:.2f} M parameters "
            f"({cfg.model.n_layers} layers, dim {cfg.model.dim}); "
            f"{len(self.train_set):,} training / {len(self.val_set):,} validation sequences "
            f"of {t.seq_len} tokens\n"
            f"plait: global batch {t.global_batch} = dp {self.mesh.size('dp')} x micro-batch "
            f"{self.micro_batch} x accumulation {self.accum}; {lr_note}; "
            f"{t.steps} steps on {self.device.type}"
        )
