"""The pipeline as ``parallelize`` sets it up: the split, the schedule and the runtime.

:func:`split_for_pipeline` is ``parallelize``'s pipeline step: it cuts the full model
into pieces (equal block counts or balanced by measured cost) and keeps this rank's.
:func:`find_stages` locates those :class:`~plait.parallel.pipeline.split.PipelineStages`
inside the (data-parallel / ZeRO) wrapper. :class:`PipelineEngine` builds the named
schedule and a :class:`~plait.parallel.pipeline.runtime.PipelineRuntime`, and runs one
training step (:func:`~plait.parallel.pipeline.runtime.pipeline_step`) or one
evaluation pass, returning the mean loss on every rank of the pipeline; it is the
driver behind :meth:`plait.parallel.model.ParallelModel.step` when pp > 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait import comm
from plait.config import Balance
from plait.mesh import Mesh
from plait.parallel.loss import loss_input
from plait.parallel.pipeline.partition import choose_boundaries
from plait.parallel.pipeline.runtime import LossFn, PipelineRuntime, pipeline_step
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.split import (
    PipelineStages,
    StagePiece,
    check_splittable,
    split_transformer,
)
from plait.parallel.pipeline.zero import GradReduce, PipelineZero
from plait.parallel.token_weight import sums_tokens, token_sum
from plait.parallel.zero.drive import ZeroDrive


def split_for_pipeline(
    model: nn.Module,
    mesh: Mesh,
    *,
    chunks: int = 1,
    balance: Balance = "equal",
    profile_shape: tuple[int, int] = (1, 0),
    seq_factor: int = 1,
) -> PipelineStages:
    """This rank's :class:`PipelineStages` of the full model: ``mesh.size("pp") x
    chunks`` pieces of contiguous blocks.

    Boundaries follow ``balance``: "equal" block counts, or "measured" (every rank
    profiles the full model on one micro-batch of ``profile_shape`` = (micro-batch,
    sequence length; 0: the model's longest), the profiles are averaged, and the split
    minimising the slowest piece is taken; rank 0 prints both splits with their
    predicted per-piece times). ``seq_factor`` is tp under sequence parallelism.
    """
    check_splittable(model)
    micro, seq = profile_shape
    if seq <= 0:
        cfg = getattr(model, "cfg", None)
        seq = int(getattr(cfg, "max_seq_len", 128))
    pieces = mesh.size("pp") * chunks
    bounds, text = choose_boundaries(model, mesh, pieces, balance, micro, seq, seq_factor)
    if balance == "measured" and mesh.rank == 0:
        print(text, flush=True)
    return split_transformer(model, mesh, chunks, bounds, seq_factor)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """16-bit logits are cast to float32 for the loss; float32/float64 stay as they are."""
    return t.float() if t.element_size() < 4 else t


def find_stages(model: nn.Module) -> PipelineStages | None:
    """This rank's pipeline pieces inside ``model`` (None when it is not split)."""
    for m in model.modules():
        if isinstance(m, PipelineStages):
            return m
    return None


class PipelineEngine:
    """Schedule + runtime for this rank's pipeline pieces on a mesh with pp > 1.

    Args:
        model: the (data-parallel / ZeRO) wrapper around this rank's
            :class:`PipelineStages` (``find_stages`` locates them).
        mesh: the device mesh (its pp axis carries the messages).
        loss_fn: ``(logits, targets) -> mean loss`` of one micro-batch.
        schedule: the schedule's name (``naive``, ``gpipe``, ``1f1b``, ``interleaved``,
            ``zb``).
        microbatches: m, the micro-batches each step's batch is cut into.
        hidden_dim: width of the activations passed between pieces.
        seq_factor: tp under sequence parallelism (messages hold ``seq / tp``
            positions), else 1.
        zero: ZeRO-2/3: the drive of ``model`` (a ``ZeroDataParallel`` built with
            ``driver="schedule"``): its units, reducer and gatherer, sequenced by the
            schedule (:class:`~plait.parallel.pipeline.zero.PipelineZero`); None: no
            ZeRO-2/3 (``model`` reduces its gradients itself, from autograd's hooks).
        zero_grad_reduce: ZeRO-2/3: reduce each unit's gradients once per step
            ("step") or after every backward action ("microbatch"); see
            :mod:`plait.parallel.pipeline.zero`.
        zero_reshard: ZeRO-3: free a piece's parameters after every action (re-gather
            per micro-batch) instead of keeping them gathered through the step.

    The message shape ``(batch / m, seq / seq_factor, hidden_dim)`` follows each call's
    tokens, so training and evaluation batches may differ.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        loss_fn: LossFn,
        *,
        schedule: str,
        microbatches: int,
        hidden_dim: int,
        seq_factor: int = 1,
        zero: ZeroDrive | None = None,
        zero_grad_reduce: GradReduce = "step",
        zero_reshard: bool = False,
    ) -> None:
        stages = find_stages(model)
        if stages is None:
            raise ValueError("the model is not split for pipeline parallelism (pp = 1?)")
        self.model = model
        self.stages = stages
        self.hidden_dim = hidden_dim
        self.seq_factor = seq_factor
        # NCCL's grouped send/recv is a rendezvous: place messages so that no batch
        # waits on a send whose receive comes later (the validator's rendezvous model).
        placement = "lockstep" if comm.world_backend() == "nccl" else "adjacent"
        chunks = len(stages.chunks)
        self.schedule = build_schedule(
            schedule, mesh.size("pp"), microbatches, chunks, placement=placement
        )
        dtype = next(stages.parameters()).dtype
        self.runtime = PipelineRuntime(
            stages,
            self.schedule,
            mesh.axis("pp"),
            lambda logits, targets: loss_fn(loss_input(loss_fn, logits), targets),
            (1, 1, hidden_dim),  # set from each batch (see _shape_for)
            dtype,
            mesh.device,
            early_recv=placement == "adjacent",  # a rendezvous transport keeps its batches
            token_sum=(
                (lambda logits, targets: token_sum(loss_fn, loss_input(loss_fn, logits), targets))
                if sums_tokens(loss_fn)
                else None
            ),
        )
        self.zero: PipelineZero | None = None  # ZeRO-2/3: the schedule drives the wrapper
        if zero is not None:
            self.zero = PipelineZero(
                zero,
                stages,
                self.schedule,
                mesh.index("pp"),
                grad_reduce=zero_grad_reduce,
                reshard=zero_reshard,
            )
            self.runtime.action_hooks = self.zero

    def _shape_for(self, tokens: torch.Tensor) -> None:
        """Size the activation messages for a batch ``(batch, seq)`` of tokens."""
        m = self.schedule.microbatches
        if tokens.shape[0] % m:
            raise ValueError(
                f"a batch of {tokens.shape[0]} sequences does not split into the "
                f"pipeline's {m} micro-batches; use a multiple of {m}"
            )
        seq = tokens.shape[1] // self.seq_factor
        self.runtime.act_shape = (tokens.shape[0] // m, seq, self.hidden_dim)

    def train(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        scale: float = 1.0,
        weight: torch.Tensor | None = None,
    ) -> float:
        """Forward + backward of this rank's batch ``(batch, seq)``; gradients reduced
        over dp; returns the mean loss on every pipeline rank (given a token ``weight``,
        ``D / N``: the micro-batches' summed losses times it,
        :mod:`plait.parallel.token_weight`)."""
        self._shape_for(tokens)
        if self.zero is not None:
            return self.zero.train(self.runtime, tokens, targets, scale, weight)
        return pipeline_step(self.model, self.runtime, tokens, targets, scale, weight)

    @torch.no_grad()
    def evaluate(
        self, tokens: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None
    ) -> float:
        """The loss of one batch (forward actions only), on every pipeline rank, as
        :meth:`train` returns it."""
        self._shape_for(tokens)
        try:
            loss = self.runtime.forward_loss(tokens, targets, weight)
        finally:
            if self.zero is not None:
                self.zero.release()
        return self.runtime.loss_to_all(loss)

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
        text = (
            f"pipeline {s.name}: pp {s.stages} x chunks {s.chunks}, {s.microbatches} "
            f"micro-batches per step; boundaries {b}; this rank: {mine}"
        )
        if self.zero is not None:
            text += "; " + self.zero.describe()
        return text
