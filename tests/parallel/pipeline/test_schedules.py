"""Pipeline schedules as data: shapes, orders, comm placement and bad input."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Action, Op
from plait.parallel.pipeline.schedules import (
    SCHEDULES,
    build_schedule,
    comm_steps,
    gpipe,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    peer,
    zero_bubble,
)

F, B, BI, BW = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def seq(text: str) -> list[str]:
    return text.split()


def compute(actions: tuple[Action, ...]) -> list[str]:
    return [f"{a.op.value}{a.microbatch}" for a in actions if a.op.is_compute]


def test_gpipe_runs_all_forwards_then_all_backwards() -> None:
    s = gpipe(3, 4)
    assert (s.name, s.stages, s.microbatches, s.chunks) == ("gpipe", 3, 4, 1)
    for r in range(3):
        assert compute(s.actions[r]) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]


def test_1f1b_warmup_steady_cooldown() -> None:
    s = one_f_one_b(4, 6)
    assert compute(s.actions[0]) == seq("F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5")
    assert compute(s.actions[2]) == seq("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5")
    assert compute(s.actions[3]) == seq("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")
    # m < p: warm-up is capped by m
    assert compute(one_f_one_b(4, 2).actions[0]) == seq("F0 F1 B0 B1")


def test_naive_runs_one_microbatch_at_a_time() -> None:
    s = naive(3, 2)
    assert compute(s.actions[1]) == ["F0", "B0", "F1", "B1"]
    assert naive(2).microbatches == 1


def test_interleaved_megatron_order() -> None:
    s = interleaved_1f1b(2, 4, 2)  # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    r0 = [str(a) for a in s.actions[0] if a.op.is_compute]
    # warm-up (p - r - 1)*2 + (v - 1)*p = 4 forwards: micro-batches 0,1 on chunk 0 then 1
    assert r0[:4] == ["F0@s0", "F1@s0", "F0@s2", "F1@s2"]
    # steady 1F1B: the first backward is micro-batch 0 on the last chunk
    assert r0[4:6] == ["F2@s0", "B0@s2"]
    assert {a.stage for a in s.actions[1]} == {1, 3}
    # m == p: all forwards are warm-up
    r = [a.op for a in interleaved_1f1b(2, 2, 2).actions[0] if a.op.is_compute]
    assert r == [F] * 4 + [B] * 4


def test_zero_bubble_splits_backward_and_defers_w() -> None:
    s = zero_bubble(4, 8)
    for r, acts in enumerate(s.actions):
        ops = [a.op for a in acts if a.op.is_compute]
        assert B not in ops and ops.count(BI) == ops.count(BW) == ops.count(F) == 8
        # ZB-H1: p - r warm-up forwards, then r rounds of I, F with W deferred
        assert ops[: 4 - r] == [F] * (4 - r)
        assert ops[4 - r : 4 + r] == [BI, F] * r
    # then I, W, F while forwards remain: W runs r micro-batches behind its I
    assert compute(s.actions[3])[:10] == seq("F0 I0 F1 I1 F2 I2 F3 I3 W0 F4")
    assert compute(s.actions[0])[4:7] == ["I0", "W0", "F4"]
    # the last rank runs its deferred W last, after the final I (filling 1F1B's cool-down)
    assert compute(s.actions[3])[-5:] == seq("I7 W4 W5 W6 W7")


def test_comm_actions_sit_next_to_their_compute() -> None:
    s = one_f_one_b(3, 3)
    acts = s.actions[1]
    for k, a in enumerate(acts):
        if a.op is F:
            assert acts[k - 1] == Action(Op.RECV_ACT, a.microbatch, 1)
            assert acts[k + 1] == Action(Op.SEND_ACT, a.microbatch, 1)
        if a.op is B:
            assert acts[k - 1] == Action(Op.RECV_GRAD, a.microbatch, 1)
            assert acts[k + 1] == Action(Op.SEND_GRAD, a.microbatch, 1)
    # first and last stage talk only to one side; one stage alone does not talk at all
    assert {a.op for a in s.actions[0] if a.op.is_comm} == {Op.SEND_ACT, Op.RECV_GRAD}
    assert {a.op for a in s.actions[2] if a.op.is_comm} == {Op.RECV_ACT, Op.SEND_GRAD}
    assert all(a.op.is_compute for a in gpipe(1, 3).actions[0])
    # zero-bubble: I carries the gradient, W moves nothing
    zb = zero_bubble(2, 3).actions[1]
    assert all(zb[k + 1].op is Op.SEND_GRAD for k, a in enumerate(zb) if a.op is BI)
    assert all(k + 1 == len(zb) or zb[k + 1].op is not Op.SEND_GRAD
               for k, a in enumerate(zb) if a.op is BW)


def test_lockstep_placement_posts_receives_in_the_round_of_their_send() -> None:
    s = build_schedule("interleaved", 2, 4, 2, placement="lockstep")
    adjacent = build_schedule("interleaved", 2, 4, 2)
    for r in range(2):  # same compute order, same comm actions, other positions
        assert [a for a in s.actions[r] if a.op.is_compute] == [
            a for a in adjacent.actions[r] if a.op.is_compute
        ]
        assert sorted(s.actions[r]) == sorted(adjacent.actions[r])
    assert s.actions != adjacent.actions
    # rank 1 posts the receive of F2@s1's input in the round rank 0 sends it (together
    # with B0@s3's send), three computes before F2@s1; adjacent: right before F2@s1
    lock, adj = ([str(a) for a in x.actions[1]] for x in (s, adjacent))
    k = lock.index("B0@s3")
    assert lock[k : k + 4] == ["B0@s3", "SEND_B0@s3", "RECV_F2@s1", "F1@s3"]
    assert adj[adj.index("F2@s1") - 1] == "RECV_F2@s1"


def test_comm_steps_batch_adjacent_comms() -> None:
    acts = one_f_one_b(2, 2).actions[0]  # F0 S F1 S R B0 R B1
    steps = comm_steps(acts)
    assert [len(st) for st in steps] == [1, 1, 1, 2, 1, 1, 1]
    assert steps[3] == (Action(Op.SEND_ACT, 1, 0), Action(Op.RECV_GRAD, 0, 0))
    assert all(a.op.is_comm for a in steps[3])


def test_peer_matches_sends_and_receives() -> None:
    assert peer(Action(Op.SEND_ACT, 3, 2), 4) == (3, Action(Op.RECV_ACT, 3, 3))
    assert peer(Action(Op.RECV_ACT, 3, 3), 4) == (2, Action(Op.SEND_ACT, 3, 2))
    assert peer(Action(Op.SEND_GRAD, 1, 4), 4) == (3, Action(Op.RECV_GRAD, 1, 3))
    assert peer(Action(Op.RECV_GRAD, 1, 3), 4) == (0, Action(Op.SEND_GRAD, 1, 4))
    with pytest.raises(ValueError):
        peer(Action(F, 0, 0), 2)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_microbatch_and_stage_appears_once_each_way(name: str) -> None:
    p, m, v = 4, 8, (2 if name == "interleaved" else 1)
    s = build_schedule(name, p, m if name != "naive" else 3, v)
    seen: dict[tuple[Op, int, int], int] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            assert a.stage % p == r
            seen[(a.op, a.microbatch, a.stage)] = seen.get((a.op, a.microbatch, a.stage), 0) + 1
    assert set(seen.values()) == {1}
    fwd = sum(1 for k in seen if k[0] is F)
    assert fwd == s.microbatches * p * v


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "words"),
    [
        ("interleaved", 4, 2, 2, ["2 micro-batches", "4 stages", "use 4"]),
        ("interleaved", 4, 6, 2, ["6 micro-batches", "use 4 or 8"]),
        ("interleaved", 1, 4, 2, ["at least 2 pipeline ranks"]),
        ("interleaved", 2, 4, 0, ["chunks per rank must be >= 1, got 0"]),
        ("1f1b", 2, 4, 2, ["chunks=2", "interleaved"]),
        ("gpipe", 0, 4, 1, ["stages must be >= 1, got 0"]),
        ("zb", 2, 0, 1, ["micro-batches per step must be >= 1, got 0"]),
        ("pipedream", 2, 4, 1, ["unknown pipeline schedule 'pipedream'", "1f1b"]),
        ("1f1b/eager", 2, 4, 1, ["unknown comm placement 'eager'", "lockstep"]),
    ],
)
def test_bad_input_is_a_config_error_naming_the_numbers(
    name: str, p: int, m: int, v: int, words: list[str]
) -> None:
    name, _, placement = name.partition("/")
    with pytest.raises(ConfigError) as e:
        build_schedule(name, p, m, v, placement or "adjacent")
    for w in words:
        assert w in str(e.value)
