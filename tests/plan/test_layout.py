"""The planner's :class:`Layout` speaks the config's vocabulary, and
:meth:`Layout.from_config` is the layout a run of a config uses."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from plait.config import Config, ParallelConfig
from plait.config.coerce import config_from_dict
from plait.errors import ConfigError
from plait.plan.layout import FROM_ELSEWHERE, FROM_PARALLEL, RUNTIME_ONLY, Layout


def _cfg(**sections: dict[str, Any]) -> Config:
    return config_from_dict(sections)


def test_layout_fields_use_the_config_names() -> None:
    """Every layout decision the config also makes has the config's name."""
    layout = {f.name for f in dataclasses.fields(Layout)}
    parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
    shared = {"dp", "tp", "pp", "cp", "zero", "zero_shard_size", "microbatches", "chunks"}
    assert shared | {"sequence_parallel"} <= layout & parallel
    assert not layout & {"shard_group", "shard_size", "micro_batches", "virtual_stages"}


def test_from_config_data_parallel_with_accumulation() -> None:
    cfg = _cfg(train={"global_batch": 16, "micro_batch": 2, "recompute": "full"})
    layout = Layout.from_config(cfg, 4)
    assert (layout.dp, layout.tp, layout.pp, layout.cp) == (4, 1, 1, 1)
    assert (layout.micro_batch, layout.microbatches, layout.global_batch) == (2, 2, 16)
    assert layout.recompute == "full" and layout.zero == 0 and layout.zero_shard_size is None


def test_from_config_zero_tensor_and_sequence_parallel() -> None:
    cfg = _cfg(parallel={"tp": 2, "sequence_parallel": True, "zero": 3, "zero_shard_size": 2})
    layout = Layout.from_config(cfg, 8)
    assert (layout.dp, layout.tp, layout.zero, layout.zero_shard_size) == (4, 2, 3, 2)
    assert layout.sequence_parallel and layout.shard_factor == 2
    assert layout.describe() == "dp4 tp2 pp1 cp1 zero3 F2 mb4x1 sp rc=none"
    # zero_shard_size means nothing without ZeRO; sequence parallelism nothing without tp
    plain = Layout.from_config(_cfg(parallel={"zero_shard_size": 1, "sequence_parallel": True}), 2)
    assert plain.zero_shard_size is None and not plain.sequence_parallel


@pytest.mark.parametrize(
    ("schedule", "chunks", "expect"),
    [
        ("1f1b", 1, ("1f1b", 1)),
        ("gpipe", 1, ("gpipe", 1)),
        ("interleaved", 2, ("interleaved", 2)),
        ("zb", 1, ("1f1b", 1)),  # zero-bubble and naive are counted as 1F1B (over-estimate)
        ("naive", 1, ("1f1b", 1)),
    ],
)
def test_from_config_pipeline(schedule: str, chunks: int, expect: tuple[str, int]) -> None:
    cfg = _cfg(
        parallel={"pp": 2, "pipeline_schedule": schedule, "chunks": chunks, "microbatches": 4},
        train={"global_batch": 16},
    )
    layout = Layout.from_config(cfg, 4)
    assert (layout.dp, layout.pp, layout.microbatches, layout.micro_batch) == (2, 2, 4, 2)
    assert (layout.schedule, layout.chunks) == expect
    assert layout.global_batch == cfg.train.global_batch


def test_from_config_refuses_the_wrong_world_size() -> None:
    with pytest.raises(ConfigError, match=r"= 2 ranks does not match the world size 3"):
        Layout.from_config(_cfg(parallel={"dp": 2}), 3)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dp": 0}, r"layout dp must be positive, got 0"),
        ({"microbatches": 0}, r"layout microbatches must be positive"),
        ({"zero": 4}, r"layout zero must be 0, 1, 2 or 3, got 4"),
        ({"dp": 4, "zero": 1, "zero_shard_size": 3}, r"\(F = 3\) must divide the data"),
        ({"chunks": 2}, r"schedule '1f1b' runs one model chunk per rank, got chunks=2"),
        ({"sequence_parallel": True}, r"sequence parallelism needs tp > 1"),
    ],
)
def test_layout_refusals(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        Layout(**kwargs)


def unmapped(parallel_fields: set[str]) -> set[str]:
    """ParallelConfig fields that the one mapping neither maps to the layout nor lists
    as runtime-only."""
    return parallel_fields - set(FROM_PARALLEL) - set(RUNTIME_ONLY)


def test_every_parallel_field_is_mapped_or_runtime_only() -> None:
    parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
    layout = {f.name for f in dataclasses.fields(Layout)}
    assert not unmapped(parallel), (
        f"ParallelConfig fields {sorted(unmapped(parallel))} are neither in "
        "plait.plan.layout.FROM_PARALLEL nor in RUNTIME_ONLY: say what the planner makes of them"
    )
    assert unmapped(parallel | {"new_option"}) == {"new_option"}  # the check can fail
    assert not set(FROM_PARALLEL) & set(RUNTIME_ONLY)
    assert set(FROM_PARALLEL) | set(RUNTIME_ONLY) <= parallel  # no stale names
    # every layout field comes from exactly one place
    assert set(FROM_PARALLEL.values()) | set(FROM_ELSEWHERE) == layout
    assert not set(FROM_PARALLEL.values()) & set(FROM_ELSEWHERE)


def test_parallel_settings_give_the_layout_back() -> None:
    """The mapping read backwards: the settings of a layout, in a config, give it back."""
    for lay in (
        Layout(dp=4, tp=2, zero=3, zero_shard_size=2, micro_batch=2, sequence_parallel=True),
        Layout(dp=2, pp=2, zero=2, microbatches=4, schedule="interleaved", chunks=2),
        Layout(dp=2, cp=2, cp_attention="ulysses", ep=2, recompute="selective"),
    ):
        settings = {k: v for k, v in lay.parallel_settings().items() if v is not None}
        cfg = _cfg(
            parallel=settings,
            train={"global_batch": lay.global_batch, "micro_batch": lay.micro_batch,
                   "recompute": lay.recompute, "grad_clip": 1.0},
        )  # fmt: skip
        assert Layout.from_config(cfg, lay.world) == lay
