"""Execute a pipeline :class:`~plait.parallel.pipeline.actions.Schedule` on this rank.

:class:`PipelineRuntime` walks this rank's action list in order:

* ``F`` runs one piece on one micro-batch (the first piece on token ids, the others on
  the received activation, a fresh leaf that requires grad); the last piece applies the
  loss and keeps ``loss · scale / m`` as the tensor to differentiate, so the gradients
  are those of the *mean* loss over the ``m`` micro-batches; given a token ``weight``
  (:mod:`plait.parallel.token_weight`) it keeps ``token_sum · weight · scale`` instead,
  so every counted token of the global batch weighs the same.
* ``B`` back-propagates one micro-batch through one piece (input and weight gradients).
* ``I`` / ``W`` split ``B`` for zero-bubble schedules (Qi et al. 2023): ``I`` computes
  only the gradient with respect to the piece's input (``torch.autograd.grad`` with the
  input as the only target, graph retained, the gradients entering each weight's
  consumer node kept), ``W`` later computes only the weight gradients from them
  (:class:`~plait.parallel.pipeline.zb.BackwardSplit`); the first piece, whose input is
  token ids, does its whole backward in ``W``.
* A run of consecutive communication actions becomes one batched isend/irecv
  (:func:`plait.comm.batch_isend_irecv` on the pp axis). Every message has a known shape
  ``(micro, seq, dim)`` and dtype, so no shape handshake precedes it, and a tag unique
  within the step (kind, micro-batch, receiving stage), so messages cannot be confused.
  Receives are waited for where the schedule puts them (just before the compute that
  needs them); sends complete in the background and are waited for at the end of the
  step. These are the semantics the schedule validator assumes: a send never blocks, a
  receive blocks until its send is posted.
* Early receives (``early_recv=True``, the default except under NCCL's lock-step
  placement): the receives of the *next* communication batch are posted with the
  current one, one compute action ahead of their wait. gloo moves a message only once
  both sides have posted it (the receiver's post notifies the sender, whose background
  thread then writes the data), so a receive posted just before its wait put that
  hand-shake -- two thread wake-ups across processes -- on the critical path of every
  message; posted one action early it completes while this rank computes. The wait
  stays where the schedule has it, so no new waiting (or deadlock) is possible; tags
  are unique within the step, so an early receive cannot take another message.

Every action's start and end (seconds from the start of the step, which is
:attr:`PipelineRuntime.step_start` on ``time.perf_counter``'s clock, shared by the
processes of one machine) are recorded in :attr:`PipelineRuntime.records` as
``(rank, action, start, end)``; a batch of
communication actions shares one interval (posting to the end of its receives). The
measured timeline can be compared with the simulated one and drawn by
:mod:`plait.viz`.

:func:`pipeline_step` is what the trainer calls: the whole schedule under the
data-parallel wrapper's ``no_sync``, then the tied-embedding gradient sum, then one
synchronising backward pass that makes the wrapper reduce every gradient over dp.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from plait import comm
from plait.comm import P2P, AxisGroup, Handle
from plait.errors import ConfigError
from plait.parallel.loss import LossFn
from plait.parallel.pipeline.actions import Action, Op, Schedule
from plait.parallel.pipeline.split import PipelineStages
from plait.parallel.pipeline.zb import BackwardSplit
from plait.parallel.token_weight import weighted

_ACT, _GRAD = 0, 1


@dataclass(frozen=True)
class ActionRecord:
    """One executed action: pipeline rank, action, start and end (s from step start)."""

    rank: int
    action: Action
    start: float
    end: float

    def as_tuple(self) -> tuple[int, Action, float, float]:
        """``(rank, action, start, end)``, the record format :mod:`plait.viz` draws."""
        return (self.rank, self.action, self.start, self.end)


class ActionHooks(Protocol):
    """Called around every compute action of a step (:attr:`PipelineRuntime.action_hooks`)."""

    def before(self, a: Action) -> None:
        """Before ``a`` runs."""

    def after(self, a: Action) -> None:
        """After ``a`` ran."""


def _tag(kind: int, microbatch: int, stage: int, m: int, stages: int) -> int:
    """A tag unique within one step: (kind, micro-batch, receiving virtual stage)."""
    return (kind * stages + stage) * m + microbatch


class PipelineRuntime:
    """Runs ``schedule`` for this rank's ``stages`` over the pp axis ``group``.

    Args:
        stages: this rank's pieces (:func:`~plait.parallel.pipeline.split.split_transformer`).
        schedule: a valid schedule with ``schedule.stages == group.size`` and
            ``schedule.chunks`` pieces per rank.
        group: the pipeline axis (``mesh.axis("pp")``).
        loss_fn: ``(logits, targets) -> mean loss`` of one micro-batch.
        token_sum: ``(logits, targets) -> summed loss`` of one micro-batch (over its
            counted targets), used by a step given a token ``weight``; None: none.
        act_shape: shape of one activation message ``(micro, seq, dim)``.
        dtype: dtype of activations and their gradients.
        device: where the messages are received.
        early_recv: post each communication batch's receives with the batch before it
            (see the module doc); False keeps every receive in its own batch, as a
            rendezvous transport (NCCL's grouped send/recv) needs.
    """

    def __init__(
        self,
        stages: PipelineStages,
        schedule: Schedule,
        group: AxisGroup,
        loss_fn: LossFn,
        act_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        early_recv: bool = True,
        token_sum: LossFn | None = None,
    ) -> None:
        if schedule.stages != group.size or schedule.chunks * group.size != stages.virtual_stages:
            raise ConfigError(
                f"schedule {schedule.name!r} is for {schedule.stages} ranks x "
                f"{schedule.chunks} chunks, but the pipeline has {group.size} ranks and "
                f"{stages.virtual_stages} pieces"
            )
        self.stages = stages
        self.schedule = schedule
        self.group = group
        self.rank = group.index
        self.loss_fn = loss_fn
        self.token_sum = token_sum
        self.act_shape = tuple(act_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.early_recv = early_recv
        self.last_stage = schedule.virtual_stages - 1
        self.records: list[ActionRecord] = []
        self.step_start = 0.0  # time.perf_counter() at the start of the last step
        # called before and after every compute action (ZeRO-2/3 under pp gathers and
        # reduces there: plait.parallel.pipeline.zero.PipelineZero); None: nothing
        self.action_hooks: ActionHooks | None = None
        self._params = {
            s: [p for p in stages.piece(s).parameters() if p.requires_grad]
            for s in range(self.rank, schedule.virtual_stages, schedule.stages)
        }

    # ------------------------------------------------------------------ public

    def step(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        scale: float = 1.0,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch ``(batch, seq)`` cut into ``m`` micro-batches.

        Gradients of the mean loss (times ``scale``, e.g. a loss scale) accumulate into
        the local parameters' ``.grad``. Returns the mean loss (float64, detached) on the
        rank holding the last piece, None elsewhere. With a token ``weight`` (a scalar
        tensor, ``D / N``; needs ``token_sum``) the loss is instead the micro-batches'
        summed losses times ``weight``, and so is the value returned.
        """
        return self._run(self.schedule.actions[self.rank], tokens, targets, scale, True, weight)

    @torch.no_grad()
    def forward_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The loss without backward (the schedule's forward actions only), as
        :meth:`step` returns it."""
        fwd = (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)
        actions = [a for a in self.schedule.actions[self.rank] if a.op in fwd]
        return self._run(actions, tokens, targets, 1.0, False, weight)

    def loss_to_all(self, loss: torch.Tensor | None) -> float:
        """Broadcast the last rank's loss to every pipeline rank (a float everywhere)."""
        buf = torch.zeros(1, dtype=torch.float64, device=self.device)
        if loss is not None:
            buf.copy_(loss.reshape(1))
        comm.broadcast(buf, self.group, src=self.group.size - 1)
        return float(buf.item())

    # ------------------------------------------------------------------ execution

    def _run(
        self,
        actions: Sequence[Action],
        tokens: torch.Tensor,
        targets: torch.Tensor,
        scale: float,
        train: bool,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        m = self.schedule.microbatches
        if weight is not None and self.token_sum is None:
            raise ValueError("a token weight needs the runtime's token_sum loss")
        if tokens.shape[0] % m or tokens.shape[0] // m != self.act_shape[0]:
            raise ConfigError(
                f"a batch of {tokens.shape[0]} sequences does not split into {m} "
                f"micro-batches of {self.act_shape[0]}"
            )
        self._x = tokens.to(self.device).chunk(m)  # m x (micro, seq)
        self._y = targets.to(self.device).chunk(m)
        self._weight = weight
        self._scale = scale / m if weight is None else scale
        self._train = train
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._recv: dict[tuple[int, int, int], torch.Tensor] = {}  # (kind, mb, stage)
        self._to_send: dict[tuple[int, int, int], torch.Tensor] = {}
        self._grad_out: dict[tuple[int, int], torch.Tensor | None] = {}
        self._splits: dict[tuple[int, int], BackwardSplit] = {}
        self._sends: list[tuple[Handle, torch.Tensor]] = []
        self._posted: dict[tuple[int, int, int], Handle] = {}  # early receives, by key
        self._losses: list[torch.Tensor] = []
        self.records = []
        batches = _comm_batches(actions)  # start index -> (end index, next batch's actions)
        t0 = self.step_start = time.perf_counter()
        i = 0
        while i < len(actions):
            a = actions[i]
            if a.op.is_comm:
                j, ahead = batches[i]
                start = time.perf_counter() - t0
                self._communicate(actions[i:j], ahead if self.early_recv else ())
                end = time.perf_counter() - t0
                self.records.extend(ActionRecord(self.rank, c, start, end) for c in actions[i:j])
                i = j
                continue
            start = time.perf_counter() - t0
            hooks = self.action_hooks
            if hooks is not None:
                hooks.before(a)
            self._compute(a)
            if hooks is not None:
                hooks.after(a)
            self.records.append(ActionRecord(self.rank, a, start, time.perf_counter() - t0))
            i += 1
        for h, _ in self._sends:
            h.wait()
        leftover = len(self._outputs) + len(self._recv) + len(self._to_send) + len(self._posted)
        if train and leftover:
            raise RuntimeError(
                f"schedule {self.schedule.name!r} left {leftover} activation(s) or gradient(s) "
                f"unused on pipeline rank {self.rank}: it is not a valid schedule"
            )
        self._sends, self._inputs, self._outputs = [], {}, {}
        if not self._losses:
            return None
        losses = torch.stack([loss.double() for loss in self._losses])
        return losses.mean() if weight is None else losses.sum()

    def _communicate(self, actions: Sequence[Action], ahead: Sequence[Action] = ()) -> None:
        """One batched isend/irecv for a run of communication actions (and the receives
        of ``ahead``, the next run, posted early); wait this run's receives."""
        m, vs, p = self.schedule.microbatches, self.schedule.virtual_stages, self.group.size
        ops: list[P2P] = []
        keys: list[tuple[int, int, int] | None] = []  # receive key per op, None for sends
        for a in actions:
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                kind = _ACT if a.op == Op.SEND_ACT else _GRAD
                dst = a.stage + 1 if kind == _ACT else a.stage - 1  # the receiving stage
                t = self._to_send.pop((kind, a.microbatch, a.stage))
                ops.append(P2P("send", t, dst % p, _tag(kind, a.microbatch, dst, m, vs)))
                keys.append(None)
        for a in (*actions, *ahead):
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                kind = _ACT if a.op == Op.RECV_ACT else _GRAD
                rkey = (kind, a.microbatch, a.stage)
                if rkey in self._posted:  # posted early with the previous batch
                    continue
                peer = (a.stage - 1) % p if kind == _ACT else (a.stage + 1) % p
                buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                self._recv[rkey] = buf
                ops.append(P2P("recv", buf, peer, _tag(kind, a.microbatch, a.stage, m, vs)))
                keys.append(rkey)
        handles = comm.batch_isend_irecv(ops, self.group)
        for h, o, key in zip(handles, ops, keys, strict=True):
            if key is None:
                self._sends.append((h, o.tensor))
            else:
                self._posted[key] = h
        for a in actions:
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                kind = _ACT if a.op == Op.RECV_ACT else _GRAD
                self._posted.pop((kind, a.microbatch, a.stage)).wait()

    def _compute(self, a: Action) -> None:
        key = (a.microbatch, a.stage)
        if a.op == Op.FORWARD:
            self._forward(a, key)
        elif a.op == Op.BACKWARD:
            out, grad = self._outputs.pop(key), self._take_grad(a)
            torch.autograd.backward(out, grad)
            self._send_input_grad(a, self._inputs.pop(key).grad)
        elif a.op == Op.BACKWARD_INPUT:
            out, grad = self._outputs[key], self._take_grad(a)
            self._grad_out[key] = grad
            inp = self._inputs.pop(key)
            if a.stage > 0:  # the first piece's input (token ids) has no gradient
                split = BackwardSplit(out, inp, self._params[a.stage])
                self._splits[key] = split
                self._send_input_grad(a, split.input_grad(grad))
        elif a.op == Op.BACKWARD_WEIGHT:
            out, grad = self._outputs.pop(key), self._grad_out.pop(key)
            if key in self._splits:
                self._splits.pop(key).weight_grads()
            else:
                torch.autograd.backward(out, grad, inputs=self._params[a.stage])
        else:  # pragma: no cover - Op is closed
            raise ValueError(f"unknown action {a}")

    def _forward(self, a: Action, key: tuple[int, int]) -> None:
        piece = self.stages.piece(a.stage)
        if a.stage == 0:
            inp = self._x[a.microbatch]  # (micro, seq) token ids
        else:
            inp = self._recv.pop((_ACT, a.microbatch, a.stage))  # (micro, seq, dim)
            inp.requires_grad_(self._train)
        out = piece(inp)
        if a.stage == self.last_stage:
            if self._weight is None:
                loss = self.loss_fn(out, self._y[a.microbatch])  # the micro-batch's mean
            else:  # its summed loss, times D / N (plait.parallel.token_weight)
                assert self.token_sum is not None
                loss = weighted(self.token_sum(out, self._y[a.microbatch]), self._weight)
            self._losses.append(loss.detach())
            if self._train:
                self._outputs[key] = loss * self._scale
                self._inputs[key] = inp
            return
        self._to_send[(_ACT, a.microbatch, a.stage)] = out.detach()
        if self._train:
            self._outputs[key] = out
            self._inputs[key] = inp

    def _take_grad(self, a: Action) -> torch.Tensor | None:
        if a.stage == self.last_stage:
            return None  # the output is the (scaled) loss itself
        return self._recv.pop((_GRAD, a.microbatch, a.stage))

    def _send_input_grad(self, a: Action, grad: torch.Tensor | None) -> None:
        if a.stage == 0:
            return
        assert grad is not None
        self._to_send[(_GRAD, a.microbatch, a.stage)] = grad


def _comm_batches(actions: Sequence[Action]) -> dict[int, tuple[int, tuple[Action, ...]]]:
    """For each run of communication actions starting at index i: (the index after the
    run, the actions of the next run, empty for the last)."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(actions):
        if actions[i].op.is_comm:
            j = i
            while j < len(actions) and actions[j].op.is_comm:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    out: dict[int, tuple[int, tuple[Action, ...]]] = {}
    for k, (i, j) in enumerate(runs):
        nxt = tuple(actions[runs[k + 1][0] : runs[k + 1][1]]) if k + 1 < len(runs) else ()
        out[i] = (j, nxt)
    return out


def sync_gradients(model: nn.Module, stages: PipelineStages) -> None:
    """After the schedule: sum the tied copies' gradients over (first, last) pipeline
    rank, then let a data-parallel wrapper (``DataParallel``, ``ZeroDataParallel``
    stage 0/1) reduce every gradient over dp.

    The wrappers reduce in their post-accumulate-grad hooks during a synchronising
    backward pass; the pipeline ran every backward under ``no_sync``, so one backward
    of a graph that adds zero to every gradient (``Σ 0·sum(p)``) triggers the reduction
    of all of them at once (gradient values are unchanged: ``g + 0 = g``).
    """
    stages.sync_tied_grads()
    if not hasattr(model, "no_sync") or model is stages:
        return
    params = [p for p in stages.parameters() if p.requires_grad]
    zero = torch.stack([p.sum() * 0.0 for p in params]).sum()
    zero.backward()


def pipeline_step(
    model: nn.Module,
    runtime: PipelineRuntime,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    scale: float = 1.0,
    weight: torch.Tensor | None = None,
) -> float:
    """One training step's forward and backward through the pipeline.

    ``model`` is the data-parallel wrapper around ``runtime.stages`` (or the stages
    themselves). Gradients end reduced over dp (and summed over tied copies); returns
    the mean loss over the micro-batches of this rank's batch, on every pipeline rank
    (with a token ``weight``: their summed losses times it, :meth:`PipelineRuntime.step`).
    """
    no_sync = getattr(model, "no_sync", None)
    ctx = no_sync() if no_sync is not None else contextlib.nullcontext()
    with ctx:
        loss = runtime.step(tokens, targets, scale, weight)
    sync_gradients(model, runtime.stages)
    return runtime.loss_to_all(loss)
