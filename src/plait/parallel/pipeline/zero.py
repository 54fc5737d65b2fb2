"""The schedule driver: one of the two drivers of the ZeRO drive interface (ZeRO-2/3 under pp).

A :class:`~plait.parallel.zero.ZeroDataParallel` hands its units, gradient reducer and
(stage 3) parameter gatherer to exactly one driver as a
:class:`~plait.parallel.zero.drive.ZeroDrive`. Without a pipeline the driver is
:class:`~plait.parallel.zero.driver.AutogradDriver`, which reacts to autograd: a forward
pre-hook gathers a unit, a hook on its output's gradient gathers it again for backward,
and a post-accumulate-grad hook reduce-scatters a unit once backward has produced all its
gradients, with one end-of-backward callback. Under pipeline parallelism
one step is many forwards and backwards of several pieces (interleaved: several chunks per
rank; zero-bubble: backward split into ``I`` and ``W``, whose weight gradients are written
into ``.grad`` directly), so those hooks would fire per micro-batch and per piece and the
end-of-backward callback would see other pieces' units without gradients. So
``parallelize`` builds the wrapper with ``driver="schedule"`` (no hook is installed) and
hands its :attr:`~plait.parallel.zero.ZeroDataParallel.drive` to the pipeline engine:
:class:`PipelineZero` is the wrapper's one driver, called by the pipeline runtime around
every compute action (``before(action)`` / ``after(action)``), knowing the rank's whole
action list. It only says *when*: the reductions (the in-flight cap, the refusal of
parameters with no gradient, the events) are the drive's
:class:`~plait.parallel.zero.reducer.GradientReducer`'s, the gathers its
:class:`~plait.parallel.zero.gather.ParameterGatherer`'s:

* **Gradients** (stages 2 and 3) accumulate in ``.grad`` over the micro-batches of one
  step. With ``grad_reduce = "step"`` (the default, as torchtitan/FSDP2 do under PP) each
  unit is reduce-scattered once per step, asynchronously, right after the last action of
  the step that produces its piece's weight gradients (the last ``B``, or ``W`` under
  zero-bubble), so the reduction overlaps the rest of the schedule; the full gradients of
  the rank's pieces live from their first backward to that point. With ``"microbatch"``
  each backward action reduce-scatters its piece's gradients at once and drops them: the
  full gradients of one piece live only during one action, at the price of m
  reduce-scatters per step instead of one. Either way the reduced shards are summed into
  the unit's ``grad_shard`` (the reduce-scatter averages over dp; hybrid sharding then
  averages over the replicas). Units holding a tied matrix (its two copies' gradients are
  summed over pp after the schedule) or spanning two pieces are reduced at the end of the
  step.
* **Parameters** (stage 3). With ``reshard = False`` (the default, torchtitan's
  ``reshard_after_forward=False`` under PP) a piece's units are gathered at its first
  action of the step and freed after its last one: one all-gather per unit per step, the
  rank's pieces' full parameters held during the step (every unit's all-gather is
  launched at the step's first action, so later pieces arrive while the first computes).
  With ``reshard = True`` every compute action gathers its piece's units before and
  frees them after, unless the rank's next action runs the same piece: only the current
  piece's full parameters are held, at the price of up to one all-gather per action (2m
  per piece and step, 3m under zero-bubble) when the schedule alternates pieces
  (interleaved); with one piece per rank it stays gathered, which is the peak either
  way. Nothing is prefetched across actions: with v = 2 the next action's piece is the
  other one, so prefetching would hold both, the memory of not resharding. Freed storage
  is released with ``resize_(0)`` and refilled in place
  (:mod:`plait.parallel.zero.gather`), so autograd's saved references stay valid across
  a free and the next gather.

Between steps a rank holds only shards (stage 3: parameters, gradients and optimizer
state; stage 2: full parameters, gradient and optimizer-state shards). Evaluation
(forward actions only) frees everything afterwards (:meth:`PipelineZero.release`).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from plait.config import PP_GRAD_REDUCES, PPGradReduce
from plait.config.rules.choices import check_choice
from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op, Schedule
from plait.parallel.zero.drive import SCHEDULE_STAGES, ZeroDrive
from plait.parallel.zero.flat import FlatUnit

if TYPE_CHECKING:
    from plait.parallel.pipeline.runtime import PipelineRuntime
    from plait.parallel.pipeline.split import PipelineStages

GradReduce = PPGradReduce  # declared once, in plait.config
_GRAD_OPS = (Op.BACKWARD, Op.BACKWARD_WEIGHT)  # the actions that write weight gradients


class PipelineZero:
    """Drive ``drive``'s (stage 2 or 3) gathers and reductions from the pipeline schedule.

    Args:
        drive: the drive of the ZeRO wrapper around this rank's ``stages`` (stage 2 or
            3), a wrapper built with ``driver="schedule"`` (it has no autograd driver).
        stages: this rank's pipeline pieces.
        schedule: the schedule the runtime executes.
        rank: this rank's index on the pp axis.
        grad_reduce: "step" (one reduce-scatter per unit and step) or "microbatch".
        reshard: stage 3: free a piece's parameters after every action (True) or keep
            them from the piece's first to its last action of the step (False).
    """

    def __init__(
        self,
        drive: ZeroDrive,
        stages: PipelineStages,
        schedule: Schedule,
        rank: int,
        *,
        grad_reduce: GradReduce = "step",
        reshard: bool = False,
    ) -> None:
        if drive.stage not in SCHEDULE_STAGES:
            raise ConfigError(f"PipelineZero drives ZeRO stages 2 and 3, not {drive.stage}")
        check_choice("grad_reduce", grad_reduce, PP_GRAD_REDUCES)
        self.drive, self.stages, self.schedule = drive, stages, schedule
        self.grad_reduce: GradReduce = grad_reduce
        self.reshard = reshard
        piece_of: dict[int, int] = {}  # id(parameter) -> virtual stage holding it
        for s in range(rank, schedule.virtual_stages, schedule.stages):
            for p in stages.piece(s).parameters():
                piece_of[id(p)] = s
        units = drive.units
        self.pieces_of = [sorted({piece_of[id(p)] for p in u.params}) for u in units]
        self.units_of: dict[int, list[FlatUnit]] = {}
        for u in units:
            for s in self.pieces_of[u.index]:
                self.units_of.setdefault(s, []).append(u)
        tied = stages.tied
        self.deferred = {  # reduced after the schedule (and the tied-gradient sum)
            u.index
            for u in units
            if len(self.pieces_of[u.index]) > 1 or any(p is tied for p in u.params)
        }
        compute = [a for a in schedule.actions[rank] if a.op.is_compute]
        self.last_grad: dict[int, Action] = {}  # piece -> its last weight-gradient action
        self.last_use: dict[int, Action] = {}  # piece -> its last compute action
        for a in compute:
            self.last_use[a.stage] = a
            if a.op in _GRAD_OPS:
                self.last_grad[a.stage] = a
        forward = [a for a in compute if a.op is Op.FORWARD]  # an evaluation pass
        self._next = dict(itertools.pairwise(compute))  # the next compute action
        self._next_eval = dict(itertools.pairwise(forward))
        self.reductions = 0  # reduce-scatters launched (counted; tests read them)
        self.gathers = 0  # stage 3: all-gathers launched
        self.peak_grad_bytes = 0  # the most unsharded gradient bytes held after an action
        self._started = False  # stage 3, kept gathered: this step's gathers are launched

    def describe(self) -> str:
        """One phrase: when gradients are reduced and (stage 3) parameters gathered."""
        grads = "once per step" if self.grad_reduce == "step" else "after every backward action"
        text = f"ZeRO-{self.drive.stage} under pp: gradients reduce-scattered {grads}"
        if self.drive.stage == 3:
            params = "re-gathered for every action" if self.reshard else "gathered once per step"
            text += f", parameters {params}"
        return text

    # ------------------------------------------------------------------ runtime hooks

    def before(self, a: Action) -> None:
        """Before compute action ``a``: stage 3 gathers the piece's units (all launched,
        then waited for); stage 2 completes the units' post-step all-gathers that
        :meth:`ZeroDataParallel.sync_params` left in flight."""
        g = self.drive.gatherer
        if g is None:  # stage 2: the piece's post-step all-gathers must be complete
            for u in self.units_of.get(a.stage, []):
                self.drive.wait_params(u)
            return
        units = self.units_of.get(a.stage, [])
        if not self.reshard and not self._started:
            # kept gathered through the step anyway: launch every unit's all-gather at
            # the step's first action, the later pieces' overlapping the first's compute
            self._started = True
            first = {u.index for u in units}
            units = [*units, *(u for u in self.drive.units if u.index not in first)]
        for u in units:
            self.gathers += int(g.start(u))  # launched unless gathered or gathering
        for u in self.units_of.get(a.stage, []):
            g.ensure(u)

    def after(self, a: Action) -> None:
        """After compute action ``a``: reduce the piece's gradients when due; stage 3
        frees its units when due."""
        s = a.stage
        if a.op in _GRAD_OPS:
            held = sum(
                p.grad.numel() * p.grad.element_size()
                for u in self.drive.units
                for p in u.params
                if p.grad is not None
            )
            self.peak_grad_bytes = max(self.peak_grad_bytes, held)
        if a.op in _GRAD_OPS and (self.grad_reduce == "microbatch" or a == self.last_grad.get(s)):
            for u in self.units_of.get(s, []):
                if u.index not in self.deferred:
                    self._reduce(u)
        g = self.drive.gatherer
        if g is None:
            return
        if self.reshard:  # free what the next action does not use (same piece: keep)
            nxt = (self._next if torch.is_grad_enabled() else self._next_eval).get(a)
            needed = {u.index for u in self.units_of.get(nxt.stage, [])} if nxt else set()
            for u in self.units_of.get(s, []):
                if u.index not in needed:
                    g.free(u)
        elif a == self.last_use.get(s):
            for u in self.units_of.get(s, []):
                if u.index not in self.deferred:
                    g.free(u)

    # ------------------------------------------------------------------ step

    def train(
        self,
        runtime: PipelineRuntime,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        scale: float,
        weight: torch.Tensor | None = None,
    ) -> float:
        """One step's schedule (``runtime.action_hooks`` is this driver); then the tied
        gradients' sum over pp, the deferred units' reductions, and every reduction
        waited for (gradients end in the units' ``grad_shard``). Returns the mean loss
        on every pipeline rank (token-weighted given ``weight``,
        :meth:`PipelineRuntime.step`)."""
        try:
            loss = runtime.step(tokens, targets, scale, weight)
            self.stages.sync_tied_grads()
            for u in self.drive.units:
                if u.index in self.deferred:
                    self._reduce(u)
            self.drive.reducer.finish()  # every reduction waited for, shards added
        except BaseException:
            self._abandon()
            raise
        finally:
            self.release()
        return runtime.loss_to_all(loss)

    def _abandon(self) -> None:
        """A failed step: complete the reductions in flight and drop them, and the
        accumulated gradients, so the next step starts clean (the reduced shards are the
        optimizer's to zero)."""
        self.drive.reducer.abandon()
        for u in self.drive.units:
            for p in u.params:
                p.grad = None

    def release(self) -> None:
        """Stage 3: free every unit (after a step or an evaluation pass)."""
        self._started = False
        if self.drive.gatherer is not None:
            self.drive.gatherer.free_all()

    # ------------------------------------------------------------------ reductions

    def _reduce(self, u: FlatUnit) -> None:
        """Reduce-scatter ``u``'s accumulated ``.grad`` now (asynchronously) and drop it."""
        self.drive.reducer.reduce(u)
        self.reductions += 1
