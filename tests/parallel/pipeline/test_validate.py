"""The schedule validator: every built schedule passes; hand-broken ones are rejected."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op, Schedule
from plait.parallel.pipeline.schedules import SCHEDULES, build_schedule, gpipe, one_f_one_b
from plait.parallel.pipeline.validate import ScheduleError, deadlock, validate

F, B = Op.FORWARD, Op.BACKWARD
SF, RF, SB, RB = Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD


def grid() -> list[tuple[str, int, int, int]]:
    out = []
    for name in SCHEDULES:
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 3, 4, 5, 8, 16):
                for v in (1, 2, 3) if name == "interleaved" else (1,):
                    if name == "interleaved" and (m % p or (v > 1 and p < 2)):
                        continue
                    out.append((name, p, m, v))
    return out


@pytest.mark.parametrize(("name", "p", "m", "v"), grid())
def test_every_schedule_is_sound(name: str, p: int, m: int, v: int) -> None:
    validate(build_schedule(name, p, m, v))
    # the lock-step placement also survives unbuffered (rendezvous) sends
    validate(build_schedule(name, p, m, v, placement="lockstep"), rendezvous=True)


def with_rank(s: Schedule, r: int, acts: list[Action]) -> Schedule:
    actions = list(s.actions)
    actions[r] = tuple(acts)
    return replace(s, actions=tuple(actions))


def problems(s: Schedule, **kw: bool) -> str:
    with pytest.raises(ScheduleError) as e:
        validate(s, **kw)
    assert isinstance(e.value, ConfigError)
    return str(e.value)


def test_rejects_backward_before_its_forward() -> None:
    s = gpipe(2, 2)
    r1 = list(s.actions[1])  # RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1
    k = r1.index(Action(B, 0, 1))
    f0 = r1.index(Action(F, 0, 1))
    r1[f0 - 1 : f0 + 1], r1[k : k + 2] = r1[k : k + 2], r1[f0 - 1 : f0 + 1]
    msg = problems(with_rank(s, 1, r1))
    assert "backward B0@s1" in msg and "before its forward F0@s1" in msg


def test_rejects_a_send_without_a_receive() -> None:
    s = one_f_one_b(2, 2)
    r1 = [a for a in s.actions[1] if a != Action(RF, 1, 1)]
    msg = problems(with_rank(s, 1, r1))
    assert "F1@s1 has no receive RECV_F1@s1" in msg
    # an extra send that nobody needs
    r0 = [*s.actions[0], Action(SF, 1, 0)]
    assert "appears 2 times" in problems(with_rank(s, 0, r0))


def test_rejects_missing_or_duplicated_work() -> None:
    s = gpipe(2, 2)
    r0 = [a for a in s.actions[0] if a != Action(B, 1, 0)]
    assert "no backward B1@s0" in problems(with_rank(s, 0, r0))
    r0 = [a for a in s.actions[0] if a not in (Action(F, 1, 0), Action(SF, 1, 0))]
    assert "no forward F1@s0" in problems(with_rank(s, 0, r0))
    mixed = [*s.actions[0], Action(Op.BACKWARD_WEIGHT, 0, 0)]
    assert "only one of I, W" in problems(with_rank(s, 0, mixed)) or "both B and I/W" in (
        problems(with_rank(s, 0, mixed))
    )


def test_rejects_actions_on_the_wrong_rank_or_out_of_range() -> None:
    s = gpipe(2, 1)
    assert "stage 1 is on rank 1" in problems(with_rank(s, 0, [*s.actions[0], Action(F, 0, 1)]))
    assert "micro-batch outside 0..0" in problems(
        with_rank(s, 0, [*s.actions[0], Action(F, 5, 0)])
    )
    assert "3 action lists for 2 ranks" in problems(replace(s, actions=(*s.actions, ())))


def test_rejects_a_deadlocking_order() -> None:
    # rank 0 waits for the gradient of micro-batch 0 before it has sent the activation
    # rank 1 needs to compute it: every action is there, each comm next to its compute
    s = gpipe(2, 1)  # F0 SEND_F0 RECV_B0 B0 / RECV_F0 F0 B0 SEND_B0
    r0 = [Action(RB, 0, 0), Action(F, 0, 0), Action(SF, 0, 0), Action(B, 0, 0)]
    broken = with_rank(s, 0, r0)
    msg = problems(broken, ordered_channels=False)
    assert "deadlock: rank 0 waits in batch [RECV_B0@s0]" in msg
    assert "deadlock: rank 1 waits in batch [RECV_F0@s1]" in msg
    # two micro-batches: rank 0 runs one micro-batch at a time (naive), rank 1 GPipe's
    # order: rank 0 waits for B0's gradient before sending F1, rank 1 for F1 before B0
    naive_r0 = build_schedule("naive", 2, 2).actions[0]
    msg = problems(with_rank(gpipe(2, 2), 0, list(naive_r0)))
    assert "rank 0 waits in batch [SEND_F0@s0 RECV_B0@s0] for SEND_B0@s1 on rank 1" in msg
    assert "rank 1 waits in batch [RECV_F1@s1] for SEND_F1@s0 on rank 0" in msg
    # receiving in the other order than sent is fine with buffered sends, a deadlock
    # with unbuffered (rendezvous) ones: rank 0 cannot finish sending F0
    s = gpipe(2, 2)
    r1 = list(s.actions[1])
    r1[0:2], r1[2:4] = r1[2:4], r1[0:2]  # RECV_F1 F1 RECV_F0 F0 ...
    validate(with_rank(s, 1, r1), ordered_channels=False)
    msg = problems(with_rank(s, 1, r1), ordered_channels=False, rendezvous=True)
    assert "rank 0 waits in batch [SEND_F0@s0] for RECV_F0@s1 on rank 1" in msg


def test_channel_order_is_checked_and_can_be_waived() -> None:
    s = gpipe(2, 2)
    r1 = list(s.actions[1])  # receive the gradients' sends in the other order
    i, j = r1.index(Action(B, 0, 1)), r1.index(Action(B, 1, 1))
    r1[i : i + 2], r1[j : j + 2] = r1[j : j + 2], r1[i : i + 2]
    s2 = with_rank(s, 1, r1)
    msg = problems(s2)
    assert "rank 1 -> rank 0: send #0 is SEND_B1@s1 but receive #0" in msg
    validate(s2, ordered_channels=False)  # with tags the order does not matter


def test_rendezvous_semantics_are_stricter() -> None:
    # with unbuffered sends, interleaved 1F1B's one-sided placement blocks: rank 0 waits
    # to send an activation that rank 1 receives only after sending a gradient
    s = build_schedule("interleaved", 2, 4, 2)
    validate(s)
    assert deadlock(s, rendezvous=True)
    assert "deadlock" in problems(s, rendezvous=True)
    validate(build_schedule("1f1b", 4, 8), rendezvous=True)
    validate(build_schedule("gpipe", 4, 8), rendezvous=True)


def test_error_lists_only_the_first_violations() -> None:
    s = gpipe(2, 16)
    r1 = [a for a in s.actions[1] if a.op is not RF]
    with pytest.raises(ScheduleError) as e:
        validate(with_rank(s, 1, r1))
    assert len(e.value.problems) == 16
    assert "and 8 more" in str(e.value)
