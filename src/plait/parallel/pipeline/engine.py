"""The pipeline as the trainer sees it: schedule and runtime from the config, and the
optimizer whose clipping norm spans every pipeline stage.

:func:`find_stages` locates this rank's :class:`~plait.parallel.pipeline.split.
PipelineStages` inside the (data-parallel / ZeRO) wrapper that ``parallelize``
returns. :class:`PipelineEngine` builds the schedule named by
``parallel.pipeline_schedule`` and a :class:`~plait.parallel.pipeline.runtime.
PipelineRuntime` with the activation shape ``(micro, seq, dim)`` (``seq / tp`` under
sequence parallelism), and runs one training step (:func:`~plait.parallel.pipeline.
runtime.pipeline_step`) or one evaluation pass, returning the mean loss on every rank of
the pipeline.

:class:`PipelineOptimizer` clips by the global gradient norm of the whole model: the
local squared norms (weighted over tp as in :class:`~plait.parallel.tensor.optim.
TensorParallelOptimizer`) are summed over the ZeRO shard group, tp and pp. The last
stage's copy of a tied embedding matrix is left out of its sum (the first stage's copy,
equal after :meth:`~plait.parallel.pipeline.split.PipelineStages.sync_tied_grads`,
counts it once).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.config import Config, ModelConfig, ParallelConfig
from plait.mesh import Mesh
from plait.parallel.pipeline.partition import choose_boundaries
from plait.parallel.pipeline.runtime import LossFn, PipelineRuntime, pipeline_step
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.split import PipelineStages, StagePiece, split_transformer
from plait.parallel.tensor.optim import TensorParallelOptimizer


def split_for_pipeline(model: nn.Module, mesh: Mesh, cfg: Config | ParallelConfig) -> nn.Module:
    """``parallelize``'s step 3: this rank's :class:`PipelineStages` of the full model.

    Boundaries follow ``parallel.balance``: "equal" block counts, or "measured" (every
    rank profiles the full model on one micro-batch of the run's shape, the profiles are
    averaged, and the split minimising the slowest piece is taken; rank 0 prints both
    splits with their predicted per-piece times).
    """
    p = cfg.parallel if isinstance(cfg, Config) else cfg
    tp = mesh.size("tp")
    seq_factor = tp if p.sequence_parallel and tp > 1 else 1
    if isinstance(cfg, Config):
        micro, seq = cfg.micro_batch(mesh.world_size), cfg.train.seq_len
    else:
        micro, seq = 1, cast(ModelConfig, model.cfg).max_seq_len
    pieces = mesh.size("pp") * p.chunks
    bounds, text = choose_boundaries(model, mesh, pieces, p.balance, micro, seq, seq_factor)
    if p.balance == "measured" and mesh.rank == 0:
        print(text, flush=True)
    return split_transformer(model, mesh, p.chunks, bounds, seq_factor)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """16-bit logits are cast to float32 for the loss; float32/float64 stay as they are."""
    return t.float() if t.element_size() < 4 else t


def find_stages(model: nn.Module) -> PipelineStages | None:
    """This rank's pipeline pieces inside ``model`` (None when it is not split)."""
    for m in model.modules():
        if isinstance(m, PipelineStages):
            return m
    return None


class PipelineEngine:
    """Schedule + runtime for a ``parallelize``-d model on a mesh with pp > 1."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config, loss_fn: LossFn) -> None:
        stages = find_stages(model)
        if stages is None:
            raise ValueError("the model is not split for pipeline parallelism (pp = 1?)")
        p, t = cfg.parallel, cfg.train
        world = mesh.world_size
        m = cfg.pipeline_microbatches(world)
        self.model = model
        self.stages = stages
        # NCCL's grouped send/recv is a rendezvous: place messages so that no batch
        # waits on a send whose receive comes later (the validator's rendezvous model).
        placement = "lockstep" if comm.world_backend() == "nccl" else "adjacent"
        self.schedule = build_schedule(
            p.pipeline_schedule, mesh.size("pp"), m, p.chunks, placement=placement
        )
        seq = t.seq_len // (mesh.size("tp") if p.sequence_parallel else 1)
        dtype = next(stages.parameters()).dtype
        self.runtime = PipelineRuntime(
            stages,
            self.schedule,
            mesh.axis("pp"),
            lambda logits, targets: loss_fn(_at_least_fp32(logits), targets),
            (cfg.micro_batch(world), seq, cfg.model.dim),
            dtype,
            mesh.device,
        )

    def train(self, tokens: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> float:
        """Forward + backward of this rank's batch ``(batch, seq)``; gradients reduced
        over dp; returns the mean loss on every pipeline rank."""
        return pipeline_step(self.model, self.runtime, tokens, targets, scale)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss of one batch (forward actions only), on every pipeline rank."""
        return self.runtime.loss_to_all(self.runtime.forward_loss(tokens, targets))

    def gather_timeline(self) -> list[tuple[int, Any, float, float]] | None:
        """The last training step's measured timeline of every pipeline rank, on pp index
        0 (``None`` elsewhere): ``(rank, action, start, end)`` records in seconds from the
        earliest start, the format :func:`plait.viz.draw_timeline` draws.

        Each rank's records follow its schedule's action list, so only the times travel:
        one gather over pp of ``(n_max, 2)`` float64 (start, end on the ``perf_counter``
        clock, which the processes of one machine share; across machines the times are
        aligned only as well as the hosts' monotonic clocks). Collective over pp.
        """
        rt, sched = self.runtime, self.schedule
        n_max = max(len(a) for a in sched.actions)
        mine = torch.zeros(n_max, 2, dtype=torch.float64)  # (action, start/end)
        for i, r in enumerate(rt.records):
            mine[i, 0], mine[i, 1] = rt.step_start + r.start, rt.step_start + r.end
        pp = rt.group
        rows = comm.gather(mine, pp, dst=0)
        if rows is None:
            return None
        t0 = min(float(rows[r][0, 0]) for r in range(pp.size) if sched.actions[r])
        return [
            (r, action, float(rows[r][i, 0]) - t0, float(rows[r][i, 1]) - t0)
            for r in range(pp.size)
            for i, action in enumerate(sched.actions[r])
        ]

    def describe(self) -> str:
        """One line: schedule, micro-batches, pieces and this rank's block ranges."""
        s, b = self.schedule, self.stages.boundaries
        stages = [c.stage for c in self.stages.chunks if isinstance(c, StagePiece)]
        mine = ", ".join(f"piece {k}: blocks {b[k]}-{b[k + 1] - 1}" for k in stages)
        return (
            f"pipeline {s.name}: pp {s.stages} x chunks {s.chunks}, {s.microbatches} "
            f"micro-batches per step; boundaries {b}; this rank: {mine}"
        )


class PipelineOptimizer(TensorParallelOptimizer):
    """A :class:`TensorParallelOptimizer` whose clipping norm also spans the pp axis."""

    def __init__(self, model: nn.Module, optimizer: Any, mesh: Mesh, **kwargs: Any) -> None:
        stages = find_stages(model)
        last = stages is not None and stages.pp_index == stages.stages - 1
        self._skip = stages.tied if stages is not None and last else None  # before the slots
        super().__init__(model, optimizer, mesh, **kwargs)
        self.pp_group = mesh.axis("pp")

    def _norm_weight(self, p: torch.Tensor) -> float:
        if p is self._skip:
            return 0.0  # the first stage counts the tied matrix
        return super()._norm_weight(p)

    def _norm_groups(self) -> list[AxisGroup]:
        groups = super()._norm_groups()  # ZeRO shards of a stage, tensor-parallel pieces
        if self.pp_group.size > 1:
            groups.append(self.pp_group)  # pipeline stages
        return groups
