"""Pipeline schedules as data: naive, GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1).

Each function returns a :class:`~plait.parallel.pipeline.actions.Schedule`: for every
rank the ordered actions of one optimizer step, compute *and* communication. The
compute order is the schedule's; the point-to-point actions are placed by one rule
(:func:`with_comms`), the same for every schedule:

- ``F(i, s)`` is preceded (not necessarily immediately) by ``RECV_F(i, s)`` when stage
  ``s - 1`` is on another rank and followed by ``SEND_F(i, s)`` when stage ``s + 1`` is;
- ``B(i, s)`` / ``I(i, s)`` is preceded by ``RECV_B(i, s)`` when stage ``s + 1`` is on
  another rank and followed by ``SEND_B(i, s)`` when stage ``s - 1`` is;
- ``W`` has no communication.

Adjacent communication actions form one batch (:func:`comm_steps`), run as one batched
isend/irecv and waited on as a whole: in 1F1B's steady state ``SEND_F(i) RECV_B(j)`` is
Megatron's ``send_forward_recv_backward``. ``validate.py`` proves that the batches cannot
deadlock and that every send meets its receive, in the same order on every rank pair.

Stages are virtual (``0 .. p*v - 1``, stage ``s`` on rank ``s % p``, local chunk
``s // p``). Interleaving (v > 1) needs p >= 2 so neighbouring stages are always on
different ranks; with p = 1 (v = 1) there is no communication at all.

References: GPipe (Huang et al., 2019); 1F1B / PipeDream-Flush (Narayanan et al.,
2019, 2021); interleaved 1F1B (Narayanan et al., 2021, Megatron-LM's
``forward_backward_pipelining_with_interleaving``); ZB-H1 (Qi et al., "Zero Bubble
Pipeline Parallelism", 2023).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op, Schedule

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb")
"""Names accepted by :func:`build_schedule`."""


# ----------------------------------------------------------------------------- checks


def _check(name: str, p: int, m: int, v: int) -> None:
    if name not in SCHEDULES:
        raise ConfigError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
        )
    if p < 1:
        raise ConfigError(f"pipeline stages must be >= 1, got {p}")
    if m < 1:
        raise ConfigError(f"micro-batches per step must be >= 1, got {m}")
    if v < 1:
        raise ConfigError(f"model chunks per rank must be >= 1, got {v}")
    if name != "interleaved" and v != 1:
        raise ConfigError(
            f"schedule {name!r} runs one model chunk per rank, got chunks={v}; "
            "use chunks=1, or the 'interleaved' schedule for chunks > 1"
        )
    if name == "interleaved":
        if v > 1 and p < 2:
            raise ConfigError(
                f"interleaved schedule with {v} chunks needs at least 2 pipeline ranks, "
                f"got {p}; use chunks=1 with one rank"
            )
        if m % p != 0:
            lo, hi = (m // p) * p, (m // p + 1) * p
            near = f"{lo} or {hi}" if lo > 0 else f"{hi}"
            raise ConfigError(
                f"the interleaved schedule needs the micro-batches per step to be a "
                f"multiple of the pipeline stages (as in Megatron-LM), got {m} "
                f"micro-batches for {p} stages; use {near} micro-batches, or the '1f1b' "
                "schedule"
            )


# ------------------------------------------------------------------- communication


def with_comms(
    p: int, v: int, compute: Sequence[Sequence[Action]]
) -> tuple[tuple[Action, ...], ...]:
    """Insert the point-to-point actions into each rank's compute order (see module doc).

    Placement by lock-step rounds: in round t every rank runs its next compute action if
    its input was sent in an earlier round (else it waits the round out); then each rank
    gets one batch holding the sends of its round-t compute and the receives of what its
    neighbours sent in round t. A batch's every match is therefore in the peer's batch of
    the same round, so the batches complete round by round and cannot deadlock; a send
    sits right after the compute that produced it, a receive before the compute that uses
    it, and at most one message per round travels on any (sender, receiver) pair, so the
    receives on every pair are posted in the order of the sends.
    """
    last = p * v - 1
    pending = [list(acts) for acts in compute]
    pos = [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    sent: set[Action] = set()  # sends posted in earlier rounds
    while any(pos[r] < len(pending[r]) for r in range(p)):
        batches: list[list[Action]] = [[] for _ in range(p)]
        recvs: list[list[Action]] = [[] for _ in range(p)]
        progressed = False
        for r in range(p):
            if pos[r] == len(pending[r]):
                continue
            a = pending[r][pos[r]]
            i, s = a.microbatch, a.stage
            if a.op is Op.FORWARD:
                need = Action(Op.SEND_ACT, i, s - 1) if s > 0 and (s - 1) % p != r else None
                send = Action(Op.SEND_ACT, i, s) if s < last and (s + 1) % p != r else None
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                need = Action(Op.SEND_GRAD, i, s + 1) if s < last and (s + 1) % p != r else None
                send = Action(Op.SEND_GRAD, i, s) if s > 0 and (s - 1) % p != r else None
            elif a.op is Op.BACKWARD_WEIGHT:
                need = send = None
            else:
                raise ValueError(f"with_comms takes compute actions only, got {a}")
            if need is not None and need not in sent:
                continue
            out[r].append(a)
            pos[r] += 1
            progressed = True
            if send is not None:
                batches[r].append(send)
                q, match = peer(send, p)
                recvs[q].append(match)
        if not progressed:
            stuck = {r: str(pending[r][pos[r]]) for r in range(p) if pos[r] < len(pending[r])}
            raise ValueError(f"compute order cannot run: every rank waits for input ({stuck})")
        for r in range(p):
            out[r] += batches[r] + recvs[r]
            sent.update(batches[r])
    return tuple(tuple(acts) for acts in out)


def peer(a: Action, p: int) -> tuple[int, Action]:
    """For a communication action: (the peer rank, the peer's matching action).

    ``SEND_F(i, s)`` matches ``RECV_F(i, s + 1)``; ``SEND_B(i, s)`` matches
    ``RECV_B(i, s - 1)`` (and conversely).
    """
    i, s = a.microbatch, a.stage
    if a.op is Op.SEND_ACT:
        other = Action(Op.RECV_ACT, i, s + 1)
    elif a.op is Op.RECV_ACT:
        other = Action(Op.SEND_ACT, i, s - 1)
    elif a.op is Op.SEND_GRAD:
        other = Action(Op.RECV_GRAD, i, s - 1)
    elif a.op is Op.RECV_GRAD:
        other = Action(Op.SEND_GRAD, i, s + 1)
    else:
        raise ValueError(f"{a} is not a communication action")
    return other.stage % p, other


def comm_steps(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """Split one rank's actions into steps: a compute action alone, or a maximal run of
    adjacent communication actions (one batched isend/irecv, waited on as a whole)."""
    steps: list[tuple[Action, ...]] = []
    run: list[Action] = []
    for a in actions:
        if a.op.is_comm:
            run.append(a)
            continue
        if run:
            steps.append(tuple(run))
            run = []
        steps.append((a,))
    if run:
        steps.append(tuple(run))
    return steps


def _make(name: str, p: int, m: int, v: int, compute: Sequence[Sequence[Action]]) -> Schedule:
    return Schedule(name, p, m, v, with_comms(p, v, compute))


# ---------------------------------------------------------------------- schedules


def naive(p: int, m: int = 1) -> Schedule:
    """No pipelining: each micro-batch runs forward through every stage, then backward,
    before the next one starts (m = 1 is plain model parallelism: the whole batch at once).
    """
    _check("naive", p, m, 1)
    return _make("naive", p, m, 1, [
        [a for i in range(m) for a in (Action(Op.FORWARD, i, r), Action(Op.BACKWARD, i, r))]
        for r in range(p)
    ])


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards (in micro-batch order);
    a flush ends the step. Holds m micro-batches' activations per rank."""
    _check("gpipe", p, m, 1)
    return _make("gpipe", p, m, 1, [
        [Action(Op.FORWARD, i, r) for i in range(m)]
        + [Action(Op.BACKWARD, i, r) for i in range(m)]
        for r in range(p)
    ])


def _one_f_one_b_order(p: int, m: int, r: int, back: Op) -> list[Action]:
    warmup = min(p - r - 1, m)
    order = [Action(Op.FORWARD, i, r) for i in range(warmup)]
    for k in range(m - warmup):
        order += [Action(Op.FORWARD, warmup + k, r), Action(back, k, r)]
    order += [Action(back, k, r) for k in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs min(p - r - 1, m) warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.
    At most p - r micro-batches are in flight on rank r."""
    _check("1f1b", p, m, 1)
    return _make("1f1b", p, m, 1, [_one_f_one_b_order(p, m, r, Op.BACKWARD) for r in range(p)])


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): rank r holds v chunks (stages r, r + p, ...).

    The m*v forward units of a rank run in groups of p micro-batches, chunk 0 first then
    chunk 1, ...; backward units the same with the chunks reversed. Rank r runs
    (p - r - 1)*2 + (v - 1)*p warm-up forwards (all of them when m == p), then one
    forward / one backward, then the remaining backwards. Needs m % p == 0.
    """
    _check("interleaved", p, m, v)
    total = m * v

    def unit(k: int, op: Op, r: int) -> Action:
        group, pos = divmod(k, p * v)
        chunk = pos // p
        if op is not Op.FORWARD:
            chunk = v - 1 - chunk
        return Action(op, group * p + pos % p, chunk * p + r)

    compute = []
    for r in range(p):
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [unit(k, Op.FORWARD, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(warmup + k, Op.FORWARD, r), unit(k, Op.BACKWARD, r)]
        order += [unit(k, Op.BACKWARD, r) for k in range(total - warmup, total)]
        compute.append(order)
    return _make("interleaved", p, m, v, compute)


def zero_bubble(p: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2023): backward split into ``I`` (input gradient,
    on the critical path, sent upstream at once) and ``W`` (weight gradient, deferred).

    The order is built by list-scheduling with F = I = W = 1: a free rank runs the next
    ``I`` if its gradient has arrived, else the next ``F`` if its input has arrived and
    1F1B's limit allows it (at most p - r forwards without their ``I``, and at most p
    micro-batches holding activations, i.e. without their ``W`` -- 1F1B's peak), else a
    deferred ``W``. The deferred ``W`` fill the cool-down bubbles of 1F1B: with equal
    costs the idle time per rank drops from 3(p - 1) to p - 1 units.
    """
    _check("zb", p, m, 1)
    return _make("zb", p, m, 1, _list_schedule(p, m))


def _list_schedule(p: int, m: int) -> list[list[Action]]:
    """Greedy unit-time list schedule of F, I, W (see :func:`zero_bubble`)."""
    done_f = [[-1] * m for _ in range(p)]  # finish time of F(i, r)
    done_i = [[-1] * m for _ in range(p)]
    nf, ni, nw = [0] * p, [0] * p, [0] * p
    busy_until = [0] * p
    order: list[list[Action]] = [[] for _ in range(p)]
    events: list[int] = [0]
    t = 0
    while any(nw[r] < m for r in range(p)):
        t = heapq.heappop(events)
        while events and events[0] == t:
            heapq.heappop(events)
        for r in range(p):
            if busy_until[r] > t:
                continue
            i = ni[r]
            grad_ready = i < nf[r] and 0 <= done_f[r][i] <= t and (
                r == p - 1 or 0 <= done_i[r + 1][i] <= t
            )
            j = nf[r]
            input_ready = j < m and (r == 0 or 0 <= done_f[r - 1][j] <= t)
            if grad_ready:
                done_i[r][i] = t + 1
                ni[r] += 1
                order[r].append(Action(Op.BACKWARD_INPUT, i, r))
            elif input_ready and nf[r] - ni[r] < p - r and nf[r] - nw[r] < p:
                done_f[r][j] = t + 1
                nf[r] += 1
                order[r].append(Action(Op.FORWARD, j, r))
            elif nw[r] < ni[r]:
                order[r].append(Action(Op.BACKWARD_WEIGHT, nw[r], r))
                nw[r] += 1
            else:
                continue
            busy_until[r] = t + 1
            heapq.heappush(events, t + 1)
        if not events and any(nw[r] < m for r in range(p)):  # cannot happen
            raise AssertionError("zero-bubble list scheduling stalled")
    return order


# ------------------------------------------------------------------------ factory

_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "naive": lambda p, m, v: naive(p, m),
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": lambda p, m, v: interleaved_1f1b(p, m, v),
    "zb": lambda p, m, v: zero_bubble(p, m),
}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for p ranks, m micro-batches and
    v chunks per rank; raises ConfigError naming the numbers on bad input."""
    _check(name, p, m, v)
    return _BUILDERS[name](p, m, v)
