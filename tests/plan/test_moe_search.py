"""ep as a searched dimension (issue 33): the MoE model's memory and time per layout,
the search ranking ep like the other axes, ``plait plan --search`` and ``--layout auto``.

* memory: the weights the planner counts equal :func:`plait.arch.param_count`
  of the built MoE model (ep 1, one rank), less the experts other ranks hold (ep > 1);
  under ZeRO the expert state is sharded over dp·cp/ep ranks, the rest over dp (by hand);
* time: the all-to-all term is m x MoE layers x the per-layer all-to-all of
  :mod:`plait.plan.moe`, 0 at ep 1; MFU counts active parameters;
* the search tries every ep dividing dp·cp and the experts (zero > 0 with ep > 1 too),
  agrees with the brute force, counts what it walks, and picks ep > 1 when the
  replicated experts do not fit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from plait.arch import param_count
from plait.cli import main
from plait.config import ModelConfig
from plait.plan.auto import choose_layout, layout_overrides
from plait.plan.hardware import hardware_preset
from plait.plan.layout import PRECISIONS, Layout, Runtime
from plait.plan.memory import memory_per_rank
from plait.plan.modelspec import ModelSpec, model_spec_preset
from plait.plan.moe import MoESpec
from plait.plan.moe_estimate import (
    a2a_layer_seconds,
    ep_choices,
    moe_estimate,
    moe_layers_on_stage,
    moe_memory,
)
from plait.plan.query import Query
from plait.plan.search import brute_force, search
from plait.plan.space import Rejections, Space, candidates, count_layouts
from tests.plan.queries import query

CFG = ModelConfig(
    dim=64, n_layers=4, n_heads=4, moe_experts=8, moe_top_k=2, moe_every=2, moe_shared_experts=1
)

FP32 = PRECISIONS["fp32"]
RT = Runtime()


def _moe() -> tuple[ModelSpec, MoESpec]:
    spec = ModelSpec.from_config(dataclasses.replace(CFG, moe_experts=0))
    moe = MoESpec.from_config(CFG)
    assert moe is not None
    return spec, moe


def test_weights_equal_the_built_model() -> None:
    spec, moe = _moe()
    mem = moe_memory(
        query(spec, Layout(micro_batch=2), FP32, RT, 32, moe=moe), Layout(micro_batch=2)
    )
    assert mem.params == 4 * param_count(CFG)  # fp32 weights, one rank holds all
    assert mem.grads == mem.params
    # ep 2 on 2 ranks: each holds half the routed experts, the rest whole
    half = moe_memory(
        query(spec, Layout(dp=2, micro_batch=2, ep=2), FP32, RT, 32, moe=moe),
        Layout(dp=2, micro_batch=2, ep=2),
    )
    assert half.params == 4 * (param_count(CFG) - moe.routed_params // 2)


def test_zero_shards_experts_over_their_replicas_by_hand() -> None:
    """dp4 ep2 ZeRO-3: expert state over dp·cp/ep = 2 ranks, the rest over dp = 4."""
    spec, moe = _moe()
    lay = Layout(dp=4, zero=3, micro_batch=2, ep=2)
    mem = moe_memory(query(spec, lay, FP32, RT, 32, moe=moe), lay)
    dense = memory_per_rank(query(spec, lay, FP32, RT, 32), lay)
    n = moe.moe_layers
    swiglu = 3 * spec.hidden * spec.ffn_hidden
    kept = moe.hidden * moe.experts + moe.shared * moe.expert_params
    routed = moe.experts // 2 * moe.expert_params
    want = dense.params + 4 * (
        math.ceil(n * kept / 4) + math.ceil(n * routed / 2) - math.ceil(n * swiglu / 4)
    )
    assert mem.params == pytest.approx(want)
    # AdamW's 8 bytes per parameter, sharded the same way
    want_opt = dense.optimizer + 8 * (
        math.ceil(n * kept / 4) + math.ceil(n * routed / 2) - math.ceil(n * swiglu / 4)
    )
    assert mem.optimizer == pytest.approx(want_opt)
    # ep 4: each rank holds 2 of 8 experts, no ZeRO sharding left for them (4/4 = 1)
    four = moe_memory(
        query(spec, dataclasses.replace(lay, ep=4), FP32, RT, 32, moe=moe),
        dataclasses.replace(lay, ep=4),
    )
    assert four.params - dense.params == pytest.approx(
        4 * (math.ceil(n * kept / 4) + n * 2 * moe.expert_params - math.ceil(n * swiglu / 4))
    )


def test_all_to_all_term_and_active_mfu() -> None:
    spec, moe = _moe()
    hw = hardware_preset("a100-80gb")
    lay = Layout(dp=4, micro_batch=2, microbatches=3, ep=4)
    e = moe_estimate(query(spec, lay, FP32, RT, 32, hw, moe=moe), lay)
    per = a2a_layer_seconds(query(spec, lay, FP32, RT, 32, hw, moe=moe), lay)
    link = hw.intra  # 4 ranks of a node
    assert per == pytest.approx(moe.a2a_seconds_per_layer(64, 4, 4, link.latency_s, link.bandwidth))
    assert e.time.ep_comm == pytest.approx(3 * moe_layers_on_stage(moe, 1) * per) and per > 0
    one = moe_estimate(
        query(spec, dataclasses.replace(lay, ep=1), FP32, RT, 32, hw, moe=moe),
        dataclasses.replace(lay, ep=1),
    )
    assert one.time.ep_comm == 0.0
    active = spec.flops_per_token(32) + moe.flops_delta_per_token()
    assert e.mfu == pytest.approx(active * e.tokens_per_s / (4 * hw.peak_flops))
    assert e.time.total == pytest.approx(sum(v for k, v in e.time.as_dict().items()
                                             if k not in ("total", "dp_comm_total")))  # fmt: skip


def _query(devices: int = 8, batch: int = 32) -> Query:
    spec = model_spec_preset("llama2-7b")
    moe = MoESpec(spec.hidden, 8, 2, spec.ffn_hidden // 2, 0, spec.n_layers, spec.ffn_hidden,
                  spec.n_layers)  # fmt: skip
    hw = hardware_preset("a100-80gb")
    return Query(spec, hw, devices, batch, 4096, PRECISIONS["bf16-mixed"], RT, 0.05, moe)


def test_search_tries_every_ep_and_ranks_them() -> None:
    q = _query()
    assert q.moe is not None
    seen = {(lay.dp * lay.cp, lay.ep, lay.zero > 0)
            for g in candidates(q, Space(), Rejections()) for lay in g}  # fmt: skip
    for data, _, _ in seen:
        eps = {ep for d, ep, _ in seen if d == data}
        assert eps == set(ep_choices(q.moe, Layout(dp=data)))
    assert (8, 8, True) in seen  # ZeRO with ep > 1 is considered
    walked = sum(len(g) for g in candidates(q, Space(), Rejections()))
    assert count_layouts(q, Space()) == walked
    r = search(q, top=5)
    # 19.7 B parameters: the experts do not fit replicated on 80 GB; the top rows split them
    assert r.ranked and all(e.layout.ep > 1 for e in r.ranked)
    assert all(e.moe is q.moe and e.fits for e in r.ranked)
    times = [e.time.total for e in r.ranked]
    assert times == sorted(times)


def test_search_agrees_with_brute_force() -> None:
    q = _query()
    space = Space(micro_batch=(1,), chunks=(2,), recompute=("none",))
    found = search(q, space, top=3)
    every = brute_force(q, space)
    assert found.ranked and every
    assert [e.time.total for e in found.ranked] == pytest.approx([e.time.total for e in every[:3]])
    assert found.ranked[0].layout == every[0].layout
    assert len({e.layout.ep for e in every}) > 1  # several ep fit and were ranked
    assert found.evaluated < len(every)  # pruned per (layout, ep) group


def test_plan_search_cli_shows_the_ep_column(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama2-7b", "--devices", "8", "--experts", "8", "--top-k", "2",
            "--global-batch", "32", "--search", "--top", "3"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert header.split()[:3] == ["#", "layout", "ep"]
    rows = [line for line in out.splitlines() if line[:2].strip() in ("1", "2", "3")]
    assert len(rows) == 3
    for row in rows:
        words = row.split()
        ep = int(next(words[i + 1] for i, w in enumerate(words) if w.startswith("rc=")))
        assert f" ep{ep} " in row
    assert "the search tried every ep" in out
    # one layout: the MoE model's figures at the given ep, its all-to-alls in the breakdown
    one = ["plan", "--model", "llama2-7b", "--experts", "8", "--devices", "8", "--dp", "8"]
    assert main([*one, "--ep", "4", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "expert-parallel all-to-alls" in out and " ep4 " in out


def test_layout_auto_chooses_ep_when_it_wins() -> None:
    q = _query()
    choice = choose_layout(q)
    assert choice.estimate.layout.ep > 1
    assert f"parallel.ep={choice.estimate.layout.ep}" in choice.overrides
    assert "parallel.ep=1" not in layout_overrides(Layout())


def test_auto_query_of_an_moe_config_and_the_ep_override_round_trip() -> None:
    """``--layout auto`` plans the config's experts, and ``parallel.ep`` written for a
    layout gives that layout back."""
    from plait.config.coerce import config_from_dict
    from plait.config.overrides import parse_override_flags
    from plait.config.toml_io import load_config_data
    from plait.plan.auto import auto_query
    from tests.tiny import tiny_args

    moe_flags = ["--model.moe_experts", "4", "--model.moe_top_k", "2"]
    lay = Layout(dp=2, micro_batch=2, microbatches=2, ep=2)
    flags = [*tiny_args(), *moe_flags, *(f"--{s}" for s in layout_overrides(lay))]
    overrides, _ = parse_override_flags(flags)
    cfg = config_from_dict(load_config_data(None, list(overrides)))
    assert Layout.from_config(cfg, 2).describe() == lay.describe()
    q = auto_query(cfg, 2, hardware_preset("a100-80gb"))
    assert q.moe == MoESpec.from_config(cfg.model) and q.moe is not None
    every = brute_force(q, Space(micro_batch=(2,), recompute=("none",)))
    assert {e.layout.ep for e in every} == {1, 2}  # both tried on 2 ranks, 4 experts
    # a tiny model fits replicated: the all-to-alls only cost, so ep 1 wins
    assert search(q, top=1).ranked[0].layout.ep == 1


def test_the_train_memory_check_counts_the_experts() -> None:
    """``plait train``'s check (plan.fit) predicts the MoE model's weights at its ep."""
    from plait.config.coerce import config_from_dict
    from plait.config.overrides import parse_override_flags
    from plait.config.toml_io import load_config_data
    from plait.plan.fit import check_fits
    from tests.tiny import tiny_args

    flags = [*tiny_args(), "--model.moe_experts", "4", "--model.moe_top_k", "2"]
    overrides, _ = parse_override_flags(flags)
    cfg = config_from_dict(load_config_data(None, list(overrides)))
    assert cfg.precision.dtype == "fp32"
    e = check_fits(cfg, 1, hardware_preset("a100-80gb")).estimate
    assert e.moe is not None and e.memory.params == 4 * param_count(cfg.model)
