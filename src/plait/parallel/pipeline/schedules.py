"""Pipeline schedules as data: naive, GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1).

Each function returns a :class:`~plait.parallel.pipeline.actions.Schedule`: for every
rank the ordered actions of one optimizer step, compute *and* communication. The
compute order is the schedule's; the point-to-point actions are placed by
:func:`with_comms`, the same way for every schedule. ``placement="adjacent"`` (default):

- ``RECV_F(i, s)`` immediately before ``F(i, s)`` when stage ``s - 1`` is on another rank,
  ``SEND_F(i, s)`` immediately after it when stage ``s + 1`` is;
- ``RECV_B(i, s)`` immediately before ``B(i, s)`` / ``I(i, s)`` when stage ``s + 1`` is on
  another rank, ``SEND_B(i, s)`` immediately after it when stage ``s - 1`` is;
- ``W`` has no communication.

So a send and the next compute's receive sit side by side and form one batch
(:func:`comm_steps`), one batched isend/irecv: in 1F1B's steady state ``SEND_F(i)
RECV_B(j)`` is Megatron's ``send_forward_recv_backward``. Under the runtime's semantics
(a send never blocks; a receive blocks until its send is posted) this placement adds no
waiting beyond the data dependencies, and the order cannot deadlock whenever the compute
order respects them; ``validate.py`` proves it for each schedule, and also that on every
rank pair the receives are posted in the order of the sends.

``placement="lockstep"`` is for unbuffered sends (a batch waits for its sends' receives
too, as a grouped NCCL kernel does; ``validate(..., rendezvous=True)``), under which the
adjacent placement of interleaved 1F1B deadlocks: receives are posted in the round their
send is (see :func:`_lockstep`), so every batch's matches are in the peer's batch of the
same round. Same compute order; GPipe, 1F1B and ZB-H1 lose nothing, interleaved 1F1B
waits 11-25% longer at B = 2F (nothing at B = F) in the simulator.

Stages are virtual (``0 .. p*v - 1``, stage ``s`` on rank ``s % p``, local chunk
``s // p``). Interleaving (v > 1) needs p >= 2 so neighbouring stages are always on
different ranks; with p = 1 (v = 1) there is no communication at all.

References: GPipe (Huang et al., 2019); 1F1B / PipeDream-Flush (Narayanan et al.,
2019, 2021); interleaved 1F1B (Narayanan et al., 2021, Megatron-LM's
``forward_backward_pipelining_with_interleaving``); ZB-H1 (Qi et al., "Zero Bubble
Pipeline Parallelism", 2023).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from plait.config import PIPELINE_SCHEDULES
from plait.config.rules.layout import check_chunks, check_interleaved
from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op, Schedule

SCHEDULES = PIPELINE_SCHEDULES
"""Names accepted by :func:`build_schedule` (declared once, in :mod:`plait.config`)."""
PLACEMENTS = ("adjacent", "lockstep")
"""Ways to place the communication actions (see the module doc)."""


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
    check_chunks(name, v)
    if name == "interleaved":
        check_interleaved(p, m, v)


# ------------------------------------------------------------------- communication


def with_comms(
    p: int, v: int, compute: Sequence[Sequence[Action]], placement: str = "adjacent"
) -> tuple[tuple[Action, ...], ...]:
    """Insert the point-to-point actions into each rank's compute order: ``"adjacent"``
    or ``"lockstep"`` placement (see the module doc)."""
    if placement == "adjacent":
        return _adjacent(p, v, compute)
    if placement == "lockstep":
        return _lockstep(p, v, compute)
    raise ConfigError(f"unknown comm placement {placement!r}; use one of {', '.join(PLACEMENTS)}")


def _adjacent(
    p: int, v: int, compute: Sequence[Sequence[Action]]
) -> tuple[tuple[Action, ...], ...]:
    """Each receive immediately before the compute that needs it, each send immediately
    after the compute that produced it."""
    last = p * v - 1
    out: list[tuple[Action, ...]] = []
    for r, acts in enumerate(compute):
        seq: list[Action] = []
        for a in acts:
            i, s = a.microbatch, a.stage
            if a.op is Op.FORWARD:
                if s > 0 and (s - 1) % p != r:
                    seq.append(Action(Op.RECV_ACT, i, s))
                seq.append(a)
                if s < last and (s + 1) % p != r:
                    seq.append(Action(Op.SEND_ACT, i, s))
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                if s < last and (s + 1) % p != r:
                    seq.append(Action(Op.RECV_GRAD, i, s))
                seq.append(a)
                if s > 0 and (s - 1) % p != r:
                    seq.append(Action(Op.SEND_GRAD, i, s))
            elif a.op is Op.BACKWARD_WEIGHT:
                seq.append(a)
            else:
                raise ValueError(f"with_comms takes compute actions only, got {a}")
        out.append(tuple(seq))
    return tuple(out)


def _lockstep(
    p: int, v: int, compute: Sequence[Sequence[Action]]
) -> tuple[tuple[Action, ...], ...]:
    """Lock-step rounds: in round t every rank runs its next compute action if
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


def _make(
    name: str, p: int, m: int, v: int, compute: Sequence[Sequence[Action]], placement: str
) -> Schedule:
    return Schedule(name, p, m, v, with_comms(p, v, compute, placement))


# ---------------------------------------------------------------------- schedules


def naive(p: int, m: int = 1, placement: str = "adjacent") -> Schedule:
    """No pipelining: each micro-batch runs forward through every stage, then backward,
    before the next one starts (m = 1 is plain model parallelism: the whole batch at once).
    """
    _check("naive", p, m, 1)
    compute = [
        [a for i in range(m) for a in (Action(Op.FORWARD, i, r), Action(Op.BACKWARD, i, r))]
        for r in range(p)
    ]
    return _make("naive", p, m, 1, compute, placement)


def gpipe(p: int, m: int, placement: str = "adjacent") -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards (in micro-batch order);
    a flush ends the step. Holds m micro-batches' activations per rank."""
    _check("gpipe", p, m, 1)
    compute = [
        [Action(Op.FORWARD, i, r) for i in range(m)] + [Action(Op.BACKWARD, i, r) for i in range(m)]
        for r in range(p)
    ]
    return _make("gpipe", p, m, 1, compute, placement)


def _one_f_one_b_order(p: int, m: int, r: int, back: Op) -> list[Action]:
    warmup = min(p - r - 1, m)
    order = [Action(Op.FORWARD, i, r) for i in range(warmup)]
    for k in range(m - warmup):
        order += [Action(Op.FORWARD, warmup + k, r), Action(back, k, r)]
    order += [Action(back, k, r) for k in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int, placement: str = "adjacent") -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs min(p - r - 1, m) warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.
    At most p - r micro-batches are in flight on rank r."""
    _check("1f1b", p, m, 1)
    compute = [_one_f_one_b_order(p, m, r, Op.BACKWARD) for r in range(p)]
    return _make("1f1b", p, m, 1, compute, placement)


def interleaved_1f1b(p: int, m: int, v: int, placement: str = "adjacent") -> Schedule:
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
    return _make("interleaved", p, m, v, compute, placement)


def zero_bubble(p: int, m: int, placement: str = "adjacent") -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2023): backward split into ``I`` (input gradient, on
    the critical path, sent upstream at once) and ``W`` (weight gradient, deferrable).

    Rank r runs min(p - r, m) warm-up forwards, then r rounds of ``I, F`` whose ``W`` are
    deferred, then ``I, W, F`` while forwards remain, then ``I, W`` and the deferred
    ``W`` last, where they fill what would be 1F1B's cool-down bubble. At most p
    micro-batches are held on any rank (1F1B's peak, on rank 0). With F = I = W and
    m >= p the step takes (3m + p - 1) F: each rank idles (p - 1) F instead of 1F1B's
    3(p - 1) F.
    """
    _check("zb", p, m, 1)
    compute = []
    for r in range(p):
        order: list[Action] = []
        done = {Op.FORWARD: 0, Op.BACKWARD_INPUT: 0, Op.BACKWARD_WEIGHT: 0}

        def run(
            *ops: Op, order: list[Action] = order, done: dict[Op, int] = done, r: int = r
        ) -> None:
            for op in ops:
                if done[op] < m:
                    order.append(Action(op, done[op], r))
                    done[op] += 1

        for _ in range(min(p - r, m)):
            run(Op.FORWARD)
        for _ in range(r):
            run(Op.BACKWARD_INPUT, Op.FORWARD)
        while done[Op.FORWARD] < m:
            run(Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.FORWARD)
        while done[Op.BACKWARD_INPUT] < m:
            run(Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
        while done[Op.BACKWARD_WEIGHT] < m:
            run(Op.BACKWARD_WEIGHT)
        compute.append(order)
    return _make("zb", p, m, 1, compute, placement)


# ------------------------------------------------------------------------ factory

_BUILDERS: dict[str, Callable[[int, int, int, str], Schedule]] = {
    "naive": lambda p, m, v, c: naive(p, m, c),
    "gpipe": lambda p, m, v, c: gpipe(p, m, c),
    "1f1b": lambda p, m, v, c: one_f_one_b(p, m, c),
    "interleaved": lambda p, m, v, c: interleaved_1f1b(p, m, v, c),
    "zb": lambda p, m, v, c: zero_bubble(p, m, c),
}


def build_schedule(name: str, p: int, m: int, v: int = 1, placement: str = "adjacent") -> Schedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for p ranks, m micro-batches and
    v chunks per rank, its communication placed ``"adjacent"`` (default) or
    ``"lockstep"``; raises ConfigError naming the numbers on bad input."""
    _check(name, p, m, v)
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"unknown comm placement {placement!r}; use one of {', '.join(PLACEMENTS)}"
        )
    return _BUILDERS[name](p, m, v, placement)
