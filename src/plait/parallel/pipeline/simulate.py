"""Simulate a pipeline schedule: per-rank timelines, makespan, bubble, in-flight memory.

:func:`simulate` is the one replay of a
:class:`~plait.parallel.pipeline.actions.Schedule` under the blocking semantics of the
runtime (``runtime.py``); the validator (``validate.py``) finds deadlocks with it.
Each rank runs its actions in order; a compute action always completes, taking its
cost; a maximal run of adjacent communication actions on a rank
(:func:`~plait.parallel.pipeline.schedules.comm_steps`) is one batch -- one batched
isend/irecv -- posted when the rank reaches it, and it completes, letting the rank go
on, once the matching send of each of its *receives* has been posted by the peer (the
peer has reached the batch holding it): it ends ``comm`` after the later of its own
posting and those. Sends never block: they complete in the background (waited for at
the end of the step). With ``rendezvous=True`` sends block too: a batch then also waits
until the matching receive of each of its sends has been posted (unbuffered sends; the
stricter model). The schedule deadlocks if some rank can never finish:
:class:`ScheduleError` then names each blocked rank's batch and the matches never
posted. Every rank starts at 0.

All times are exact :class:`fractions.Fraction` (costs given as floats are converted
exactly), so textbook formulas can be checked with ``==``.

Cost convention. ``forward``, ``backward`` (= ``backward_input`` + ``backward_weight``
for the zero-bubble split) are the costs of one micro-batch through *one rank's share
of the model*; with v chunks per rank a chunk holds 1/v of it, so with
``per_chunk=True`` (the default) each chunk action costs 1/v of the figure. Under this
convention, with ``comm = 0`` and any forward/backward costs, GPipe and 1F1B end at
(m + p - 1)(f + b) and idle (p - 1)(f + b) per rank, a bubble fraction (p - 1)/(m + p - 1);
interleaved 1F1B idles (1/v)(p - 1)(f + b) per rank, which is (1/v)(p - 1)/(m + p - 1)
of the non-interleaved step (see :attr:`SimResult.idle`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op, Schedule
from plait.parallel.pipeline.schedules import comm_steps, peer

Time = Fraction

MAX_REPORTED = 8
"""Violations listed in one ScheduleError."""


class ScheduleError(ConfigError):
    """A pipeline schedule that is not sound; the message lists the first violations."""

    def __init__(self, name: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:MAX_REPORTED])
        more = len(self.problems) - MAX_REPORTED
        tail = f"; and {more} more" if more > 0 else ""
        super().__init__(f"pipeline schedule {name!r} is not sound: {shown}{tail}")


@dataclass(frozen=True)
class Costs:
    """Cost of each kind of action, in any unit of time (see the module doc)."""

    forward: Fraction | float = 1
    """Forward of one micro-batch through one rank's share of the model."""
    backward: Fraction | float = 2
    """Full backward (input and weight gradients) of one micro-batch."""
    backward_input: Fraction | float = 1
    """Zero-bubble ``I``: the input-gradient half of the backward."""
    backward_weight: Fraction | float = 1
    """Zero-bubble ``W``: the weight-gradient half of the backward."""
    comm: Fraction | float = 0
    """Latency of one batch of point-to-point messages, from its last post to its end."""
    per_chunk: bool = True
    """Divide compute costs by v (a chunk is 1/v of a rank's layers)."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight", "comm"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost {name} must be >= 0, got {getattr(self, name)}")

    def of(self, op: Op, chunks: int) -> Time:
        """Exact cost of one compute action of kind ``op`` with ``chunks`` per rank."""
        raw = {
            Op.FORWARD: self.forward,
            Op.BACKWARD: self.backward,
            Op.BACKWARD_INPUT: self.backward_input,
            Op.BACKWARD_WEIGHT: self.backward_weight,
        }[op]
        c = Fraction(raw)
        return c / chunks if self.per_chunk else c


class Event(NamedTuple):
    """One action of one rank in a timeline (simulated or measured)."""

    rank: int
    action: Action
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class SimResult:
    """A simulated step."""

    schedule: Schedule
    """The schedule simulated."""
    timeline: tuple[Event, ...]
    """Every action (compute and communication) with its start and end, rank by rank."""
    makespan: Time
    """Time at which the last rank finishes."""
    busy: tuple[Time, ...]
    """Compute time of each rank."""
    peak_inflight: tuple[int, ...]
    """Per rank, the most (micro-batch, stage) forwards held at once whose backward
    (``B``, or ``W`` when split) has not finished -- activations kept in memory."""

    @property
    def idle(self) -> tuple[Time, ...]:
        """Time each rank does not compute (bubbles and communication waits)."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> Time:
        """Fraction of all ranks' time spent not computing: sum(idle) / (p * makespan)."""
        return sum(self.idle, Fraction(0)) / (len(self.busy) * self.makespan)


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    rendezvous: bool = False,
    durations: Sequence[Mapping[Action, float]] | None = None,
) -> SimResult:
    """Simulate ``schedule`` with ``costs`` (default: F = 1, B = 2, I = W = 1, comm = 0);
    raises :class:`ScheduleError` if it deadlocks, one line per blocked rank.
    ``durations`` (per rank, each compute action's measured duration) replaces the
    per-kind compute costs: the replay of a measured step with free communication
    (benchmarks/pipeline_profile.py)."""
    costs = costs or Costs()
    p, v = schedule.stages, schedule.chunks
    steps = [comm_steps(acts) for acts in schedule.actions]
    at = [0] * p
    now = [Fraction(0)] * p
    posted: dict[tuple[int, Action], Time] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(steps[r]):
                step = steps[r][at[r]]
                start = now[r]
                if step[0].op.is_comm:
                    for a in step:
                        posted.setdefault((r, a), start)
                    peers = [posted.get(peer(a, p)) for a in waits_for(step, rendezvous)]
                    if any(t is None for t in peers):
                        break
                    end = max([start, *(t for t in peers if t is not None)]) + Fraction(costs.comm)
                    events[r] += [Event(r, a, start, end) for a in step]
                else:
                    a = step[0]
                    cost = costs.of(a.op, v) if durations is None else Fraction(durations[r][a])
                    end = start + cost
                    events[r].append(Event(r, step[0], start, end))
                now[r] = end
                at[r] += 1
                moved = True
    stuck = [
        _stuck_line(r, steps[r][at[r]], posted, p, rendezvous)
        for r in range(p)
        if at[r] < len(steps[r])
    ]
    if stuck:
        raise ScheduleError(schedule.name, stuck)
    busy = tuple(
        sum((e.end - e.start for e in evs if e.action.op.is_compute), Fraction(0)) for evs in events
    )
    return SimResult(
        schedule=schedule,
        timeline=tuple(e for evs in events for e in evs),
        makespan=max(now) if p else Fraction(0),
        busy=busy,
        peak_inflight=tuple(peak_inflight(acts) for acts in schedule.actions),
    )


def waits_for(step: Sequence[Action], rendezvous: bool = False) -> list[Action]:
    """The actions of a communication batch whose matches must be posted before it
    completes: its receives (and its sends too under ``rendezvous``)."""
    recv = (Op.RECV_ACT, Op.RECV_GRAD)
    return [a for a in step if rendezvous or a.op in recv]


def _stuck_line(
    r: int,
    step: tuple[Action, ...],
    posted: Mapping[tuple[int, Action], Time],
    p: int,
    rendezvous: bool,
) -> str:
    """The report of rank ``r`` blocked in ``step``: the batch and the matches missing."""
    missing = [
        f"{m} on rank {q}"
        for q, m in (peer(a, p) for a in waits_for(step, rendezvous))
        if (q, m) not in posted
    ]
    return (
        f"deadlock: rank {r} waits in batch [{' '.join(map(str, step))}] for {', '.join(missing)}"
    )


def peak_inflight(actions: tuple[Action, ...]) -> int:
    """Most forwards held at once on one rank whose backward (B, or W) has not finished."""
    held = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            held -= 1
    return peak
