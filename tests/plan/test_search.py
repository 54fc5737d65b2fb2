"""Layout search: rejection reasons, agreement with brute force, the explanation."""

from __future__ import annotations

import dataclasses

import pytest

from plait.errors import ConfigError
from plait.plan.hardware import PRESETS
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.modelspec import MODEL_SPECS, ModelSpec
from plait.plan.query import Query
from plait.plan.search import brute_force, search, with_layout
from plait.plan.space import Space, mesh_problem

MIXED = PRECISIONS["bf16-mixed"]


def _query(model: str | ModelSpec, hw: str, devices: int, batch: int, seq: int) -> Query:
    spec = MODEL_SPECS[model] if isinstance(model, str) else model
    return Query(spec, PRESETS[hw], devices, batch, seq, MIXED, RUNTIMES["plait"])


def test_a_model_too_large_for_replication_is_rejected_for_memory() -> None:
    # Llama 2 70B: 16 bytes/param is ~1.1 TB; pure data parallelism on 8 x 40 GB cannot fit
    q = _query("llama2-70b", "a100-40gb", 8, 8, 4096)
    r = search(q, Space(tp=(1,), pp=(1,), cp=(1,)), top=3)
    assert r.ranked == []
    assert set(r.rejections.counts) == {"memory"}
    assert "GiB per rank >" in r.rejections.examples["memory"][0]
    assert "No layout" in r.explanation


def test_non_divisible_layouts_are_rejected_with_the_reason() -> None:
    spec = ModelSpec("odd", 12, 768, 12, 12, 3072, 50257, "gpt", 1024)  # 12 heads
    q = _query(spec, "a100-80gb", 16, 40, 1024)
    r = search(q, Space(pp=(1,), cp=(1,), zero=(0,), recompute=("none",)), top=3)
    div = r.rejections.examples["divisibility"]
    assert any("tp=8 does not divide the 12 heads" in m for m in div)
    assert mesh_problem(q, 1, 1, 1) == (
        "divisibility",
        "global batch 40 is not divisible by dp=16",
    )
    assert all(e.layout.tp != 8 and e.layout.dp != 16 for e in r.ranked)
    assert mesh_problem(q, 8, 1, 1) == (
        "divisibility",
        "tp=8 does not divide the 12 heads and MLP width 3072",
    )


def test_tensor_parallelism_beyond_a_node_is_rejected_for_topology() -> None:
    q = _query("llama2-13b", "h100-80gb", 32, 32, 4096)
    problem = mesh_problem(q, 16, 1, 1)
    assert problem is not None and problem[0] == "topology"
    assert "exceeds a node of 8" in problem[1]
    r = search(q, Space(tp=(8, 16), pp=(1,), cp=(1,), micro_batch=(1,)), top=2)
    assert r.rejections.counts["topology"] == 1
    assert all(e.layout.tp == 8 for e in r.ranked)


@pytest.mark.parametrize(
    ("model", "hw", "devices", "batch", "seq"),
    [("gpt2-355m", "a100-40gb", 8, 32, 1024), ("llama2-7b", "a100-80gb", 16, 32, 4096)],
)
def test_search_agrees_with_brute_force(
    model: str, hw: str, devices: int, batch: int, seq: int
) -> None:
    q = _query(model, hw, devices, batch, seq)
    space = Space(micro_batch=(1, 2), chunks=(2,))
    found = search(q, space, top=3)
    every = brute_force(q, space)
    assert found.ranked and every
    keys = [(e.time.total, e.memory.total) for e in every[:3]]
    got = [(e.time.total, e.memory.total) for e in found.ranked]
    assert len(got) == len(keys)  # approx compares flat sequences (pytest >= 9.2)
    assert [x for pair in got for x in pair] == pytest.approx([x for k in keys for x in k])
    assert found.ranked[0].layout == every[0].layout or keys[0] == keys[1]
    # pruning skipped work without changing the answer
    assert found.evaluated < len(every)


def test_every_ranked_layout_fits_and_is_sorted() -> None:
    q = _query("llama2-13b", "a100-80gb", 16, 64, 4096)
    r = search(q, top=5)
    times = [e.time.total for e in r.ranked]
    assert times == sorted(times)
    assert all(e.fits and e.layout.world == 16 and e.layout.global_batch == 64 for e in r.ranked)
    best = r.ranked[0]
    assert best.layout.describe() in r.explanation
    assert "runner-up" in r.explanation


def test_the_search_prefers_less_communication_on_a_slow_network() -> None:
    q = _query("gpt2-1.5b", "a100-80gb", 16, 64, 1024)  # two nodes
    slow = dataclasses.replace(
        q.hardware, inter=dataclasses.replace(q.hardware.inter, bandwidth=1e8)
    )
    fast_best = search(q, top=1).ranked[0]
    slow_best = search(dataclasses.replace(q, hardware=slow), top=1).ranked[0]
    assert slow_best.time.total > fast_best.time.total
    assert slow_best.time.dp_comm + slow_best.time.tp_comm < 0.5 * slow_best.time.total


def test_with_layout_refuses_mismatches() -> None:
    q = _query("gpt2-124m", "a100-80gb", 8, 16, 1024)
    with pytest.raises(ConfigError, match=r"= 4 ranks does not match the 8 devices.*ask for 4 dev"):
        with_layout(q, Layout(dp=4, micro_batch=4))
    with pytest.raises(ConfigError, match="is not the global batch 16"):
        with_layout(q, Layout(dp=8, micro_batch=4))
    e = with_layout(q, Layout(dp=8, micro_batch=2))
    assert e.fits and e.tokens_per_s > 0


@pytest.mark.parametrize(
    ("model", "devices", "batch"),
    [("llama2-7b", 16, 64), ("llama2-70b", 64, 512), ("gpt2-124m", 12, 36)],
)
def test_count_layouts_is_what_the_walk_yields(model: str, devices: int, batch: int) -> None:
    """The up-front count that bounds the search equals the layouts enumerated."""
    from plait.plan.space import Rejections, candidates, count_layouts

    q = _query(model, "a100-80gb", devices, batch, 2048)
    walked = sum(len(g) for g in candidates(q, Space(), Rejections()))
    assert walked > 0 and count_layouts(q, Space()) == walked


def test_divisors_of_large_counts_are_fast_and_right() -> None:
    from plait.plan.space import divisors

    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    big = divisors(1_000_000_000)  # 2^9 5^9: trial division to sqrt only
    assert len(big) == 100 and big[0] == 1 and big[-1] == 1_000_000_000
    assert all(1_000_000_000 % d == 0 for d in big) and big == sorted(big)
