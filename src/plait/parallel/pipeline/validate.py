"""Prove a pipeline schedule sound before it runs.

:func:`validate` checks a :class:`~plait.parallel.pipeline.actions.Schedule` and raises
:class:`ScheduleError` listing the first violations, or returns nothing. It checks:

1. **Shape.** One action list per rank; micro-batches in ``0 .. m-1``; stages in
   ``0 .. p*v-1``; every action on the rank that holds its stage (``stage % p``).
2. **Coverage.** Every (micro-batch, stage) has exactly one forward and exactly one
   backward: either one ``B``, or one ``I`` and one ``W`` (never a mix).
3. **Order on a rank.** The backward (``B`` or ``I``) comes after the forward of the same
   micro-batch on the same stage, ``W`` after its ``I`` -- so it runs on the weights that
   produced the forward (weights change only after the step).
4. **Communication.** Each forward whose previous stage is on another rank is preceded
   by exactly one ``RECV_F`` of it and each forward whose next stage is on another rank
   followed by exactly one ``SEND_F``; likewise ``RECV_B`` before and ``SEND_B`` after
   each ``B`` / ``I``; no other communication. So every send has exactly one matching
   receive on the peer rank (``SEND_F(i, s)`` with ``RECV_F(i, s+1)``, ``SEND_B(i, s)``
   with ``RECV_B(i, s-1)``), and conversely.
5. **Channel order** (``ordered_channels=True``, the default): on every (sender,
   receiver) pair the receives are posted in the order of the sends, so messages can be
   matched without tags.
6. **No deadlock**: :func:`~plait.parallel.pipeline.simulate.simulate` replays the
   schedule under the runtime's blocking semantics (read its module doc): a rank runs
   its actions in order, a batch of adjacent communication actions completes once the
   matching sends of its receives are posted (sends never block; with
   ``rendezvous=True`` they do, the stricter model). The schedule deadlocks if some rank
   can never finish; the error names each blocked rank's batch and the missing matches.
"""

from __future__ import annotations

from collections import defaultdict

from plait.parallel.pipeline.actions import Action, Op, Schedule
from plait.parallel.pipeline.schedules import peer
from plait.parallel.pipeline.simulate import ScheduleError, simulate

__all__ = ["ScheduleError", "deadlock", "validate"]


def validate(schedule: Schedule, ordered_channels: bool = True, rendezvous: bool = False) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is sound (see module doc)."""
    problems = _shape(schedule)
    if not problems:
        problems = _coverage_and_order(schedule)
    if not problems and ordered_channels:
        problems = _channel_order(schedule)
    if not problems:
        problems = deadlock(schedule, rendezvous)
    if problems:
        raise ScheduleError(schedule.name, problems)


def _shape(sch: Schedule) -> list[str]:
    p, m, vs = sch.stages, sch.microbatches, sch.virtual_stages
    out: list[str] = []
    if p < 1 or m < 1 or sch.chunks < 1:
        return [f"stages={p}, microbatches={m}, chunks={sch.chunks} must all be >= 1"]
    if len(sch.actions) != p:
        return [f"{len(sch.actions)} action lists for {p} ranks"]
    for r, acts in enumerate(sch.actions):
        for k, a in enumerate(acts):
            if not 0 <= a.microbatch < m:
                out.append(f"rank {r} action {k} {a}: micro-batch outside 0..{m - 1}")
            elif not 0 <= a.stage < vs:
                out.append(f"rank {r} action {k} {a}: stage outside 0..{vs - 1}")
            elif a.stage % p != r:
                out.append(f"rank {r} action {k} {a}: stage {a.stage} is on rank {a.stage % p}")
    return out


def _needs(a: Action, p: int, last: int) -> tuple[Action | None, Action | None]:
    """(the receive that must precede, the send that must follow) compute action ``a``."""
    i, s, r = a.microbatch, a.stage, a.stage % p
    if a.op is Op.FORWARD:
        before = Action(Op.RECV_ACT, i, s) if s > 0 and (s - 1) % p != r else None
        after = Action(Op.SEND_ACT, i, s) if s < last and (s + 1) % p != r else None
        return before, after
    if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        before = Action(Op.RECV_GRAD, i, s) if s < last and (s + 1) % p != r else None
        after = Action(Op.SEND_GRAD, i, s) if s > 0 and (s - 1) % p != r else None
        return before, after
    return None, None


def _coverage_and_order(sch: Schedule) -> list[str]:
    p, last = sch.stages, sch.virtual_stages - 1
    out: list[str] = []
    for r, acts in enumerate(sch.actions):
        where: dict[Action, list[int]] = defaultdict(list)
        for k, a in enumerate(acts):
            where[a].append(k)
        for a, ks in where.items():
            if len(ks) > 1:
                out.append(f"rank {r}: {a} appears {len(ks)} times (positions {ks})")
        required: set[Action] = set()
        for s in range(r, last + 1, p):
            for i in range(sch.microbatches):
                f = Action(Op.FORWARD, i, s)
                b, ig, w = (
                    Action(o, i, s) for o in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
                )
                if f not in where:
                    out.append(f"rank {r}: no forward {f}")
                split = ig in where or w in where
                if split and b in where:
                    out.append(f"rank {r}: micro-batch {i} stage {s} has both B and I/W")
                elif split and not (ig in where and w in where):
                    out.append(f"rank {r}: micro-batch {i} stage {s} has only one of I, W")
                elif not split and b not in where:
                    out.append(f"rank {r}: no backward {b}")
                back = ig if split else b
                if f in where and back in where and where[back][0] < where[f][0]:
                    out.append(
                        f"rank {r}: backward {back} (position {where[back][0]}) "
                        f"before its forward {f} (position {where[f][0]})"
                    )
                if split and ig in where and w in where and where[w][0] < where[ig][0]:
                    out.append(f"rank {r}: {w} (position {where[w][0]}) before {ig}")
                for c in (f, back):
                    if c not in where:
                        continue
                    before, after = _needs(c, p, last)
                    for n, must_precede in ((before, True), (after, False)):
                        if n is None:
                            continue
                        required.add(n)
                        if n not in where:
                            kind = "receive" if must_precede else "send"
                            out.append(f"rank {r}: {c} has no {kind} {n}")
                        elif (where[n][0] < where[c][0]) != must_precede:
                            rel = "after" if must_precede else "before"
                            out.append(f"rank {r}: {n} is {rel} {c}")
        for a in where:
            if a.op.is_comm and a not in required:
                out.append(f"rank {r}: {a} matches no compute action needing it")
    return out


def _channel_order(sch: Schedule) -> list[str]:
    p = sch.stages
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for r, acts in enumerate(sch.actions):
        for a in acts:
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                sends[(r, peer(a, p)[0])].append(a)
            elif a.op.is_comm:
                q, match = peer(a, p)
                recvs[(q, r)].append(match)
    out = []
    for (src, dst), ss in sorted(sends.items()):
        rs = recvs.get((src, dst), [])
        for k, (s, rm) in enumerate(zip(ss, rs, strict=False)):
            if s != rm:
                out.append(
                    f"rank {src} -> rank {dst}: send #{k} is {s} but receive #{k} on "
                    f"rank {dst} expects {rm}"
                )
                break
    return out


def deadlock(sch: Schedule, rendezvous: bool = False) -> list[str]:
    """Replay ``sch`` (:func:`~plait.parallel.pipeline.simulate.simulate`); ``[]`` when
    every rank finishes, else one line per blocked rank naming its batch and the matches
    never posted."""
    try:
        simulate(sch, rendezvous=rendezvous)
    except ScheduleError as e:
        return e.problems
    return []
