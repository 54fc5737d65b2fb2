"""The planner's time for ZeRO-Offload's host step: the two-pass flow by hand, the eager
overlap, and which of the two a config takes (pure: no process group)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.config import Config, ParallelConfig, PrecisionConfig, TrainConfig
from plait.plan.hardware import PRESETS
from plait.plan.layout import PRECISIONS, Layout
from plait.plan.offload_time import (
    SCALE_COST,
    eager_exposed,
    offload_step_time,
    two_pass_timeline,
)
from tests.plan.queries import query

# rate 1 parameter/s; link 8 B/s with 4-byte gradients: d = n/2; 2-byte weights: u = n/4
SHARDS = [4, 8, 2, 4]


def test_two_pass_flow_by_hand() -> None:
    """Copies, host steps and copies back of four units through a ring of two buffers:

    k  d    D = max(D-1, H-2) + d   a   H = max(H-1, D) + a   u    B = max(B-1, H) + u
    0  2    2                       4   6                     1    7
    1  4    6                       8   14                    2    16
    2  1    max(6, H0=6) + 1 = 7    2   max(14, 7) + 2 = 16   .5   16.5
    3  2    max(7, H1=14) + 2 = 16  4   max(16, 16) + 4 = 20  1    21

    (unit 3's copy waits for unit 1's step to free its buffer); + the norm, 0.5 s."""
    t = two_pass_timeline(SHARDS, 1.0, 8.0, 4, 2, 0.5, scaled=False)
    assert t.copied == (2, 6, 7, 16)
    assert t.stepped == (6, 14, 16, 20)
    assert t.back == (7, 16, 16.5, 21)
    assert t.total == 21.5
    assert t.busy == 0.5 + 9 + 18 + 4.5  # no overlap: norm + copies + steps + copies back


def test_two_pass_flow_copy_back_on_the_worker() -> None:
    """The CPU-only form: the copy back is part of the worker's step.

    k  D                      H = max(H-1, D) + a + u
    0  2                      2 + 4 + 1 = 7
    1  6                      max(7, 6) + 8 + 2 = 17
    2  max(6, H0=7) + 1 = 8   max(17, 8) + 2 + .5 = 19.5
    3  max(8, H1=17) + 2 = 19 max(19.5, 19) + 4 + 1 = 24.5"""
    t = two_pass_timeline(SHARDS, 1.0, 8.0, 4, 2, scaled=False, copy_back_on_worker=True)
    assert t.copied == (2, 6, 8, 19)
    assert t.stepped == t.back == (7, 17, 19.5, 24.5)
    assert t.total == 24.5


def test_two_pass_scales_on_the_host() -> None:
    """One unit of 7 parameters: copy 3.5 s, unscale/clip 7·8/28 = 2 s, AdamW 7 s, back
    1.75 s, one after the other."""
    assert abs(SCALE_COST * 7 - 2.0) < 1e-12
    t = two_pass_timeline([7], 1.0, 8.0, 4, 2)
    assert t.total == pytest.approx(3.5 + 2 + 7 + 1.75)


def test_step_time_picks_the_path() -> None:
    """``offload_step_time``: eager (the overlap with backward) without the norm's
    dependence on one rank; the two-pass flow with clipping, and under pp (the units land
    after the schedule: no overlap with backward) without the host scaling."""
    hw = replace(PRESETS["h100-80gb"], cpu_adam_params_per_s=2e9, host_link_bytes_per_s=40e9)
    prec = PRECISIONS["bf16-mixed"]
    shards = [100_000_000, 200_000_000, 200_000_000, 150_000_000]
    s = sum(shards)
    norm = s * 2 / hw.optimizer_bandwidth
    eager = Layout(zero=2, offload="optimizer", offload_two_pass=False)
    backward = 0.2
    # eager: max(0.325/4, 0.325 + 0.0325 - 0.2) + 0.0325
    want = max(s / 2e9 / 4, s / 2e9 + s * 2 / 40e9 - backward) + s * 2 / 40e9
    assert eager_exposed(shards, 2e9, 40e9, prec, backward) == pytest.approx(want)
    assert offload_step_time(shards, eager, hw, prec, backward) == pytest.approx(want)
    clipped = replace(eager, offload_two_pass=True)
    flow = two_pass_timeline(shards, 2e9, 40e9, 2, 2, norm)
    got = offload_step_time(shards, clipped, hw, prec, backward)
    assert got == pytest.approx(flow.total)
    # step-bound here: the first copy, every step (AdamW + scale), the last copy back
    steps = (1 + SCALE_COST) * s / 2e9
    assert got == pytest.approx(norm + shards[0] * 2 / 40e9 + steps + shards[-1] * 2 / 40e9)
    assert got > offload_step_time(shards, eager, hw, prec, backward)
    piped = replace(eager, pp=2, microbatches=4)
    flat = two_pass_timeline(shards, 2e9, 40e9, 2, 2, norm, scaled=False)
    assert offload_step_time(shards, piped, hw, prec, backward) == pytest.approx(flat.total)


def test_the_delayed_update_hides_under_the_next_step() -> None:
    """``offload_delay``: the host's whole flow (gradients down, AdamW, weights up; with
    the norm and the unscale/clip pass when two-pass) runs under the next step's device
    work ``step_s``; only what exceeds it is exposed (0 when the device step is longer)."""
    hw = replace(PRESETS["h100-80gb"], cpu_adam_params_per_s=2e9, host_link_bytes_per_s=40e9)
    prec = PRECISIONS["bf16-mixed"]
    shards = [100_000_000, 200_000_000, 200_000_000, 150_000_000]
    s = sum(shards)
    delayed = Layout(zero=2, offload="optimizer", offload_two_pass=False, offload_delay=True)
    host = s / 2e9 + s * (2 + 2) / 40e9  # 0.325 + 0.065
    assert offload_step_time(shards, delayed, hw, prec, 0.2, 0.1) == pytest.approx(host - 0.1)
    assert offload_step_time(shards, delayed, hw, prec, 0.2, 1.0) == 0.0
    clipped = replace(delayed, offload_two_pass=True)
    extra = s * 2 / hw.optimizer_bandwidth + SCALE_COST * s / 2e9
    got = offload_step_time(shards, clipped, hw, prec, 0.2, 0.1)
    assert got == pytest.approx(host + extra - 0.1)
    eager = replace(delayed, offload_delay=False)
    assert got < offload_step_time(shards, replace(eager, offload_two_pass=True), hw, prec, 0.2)


@pytest.mark.parametrize(
    ("clip", "dtype", "nonfinite", "two_pass"),
    [
        (1.0, "fp32", "error", True),  # the default: clipping at 1
        (0.0, "fp32", "error", False),
        (0.0, "fp16", "error", True),  # loss scaling: unscaled after the norm
        (0.0, "bf16", "skip", True),  # a skipped step could not be undone
    ],
)
def test_layout_from_config_knows_the_path(
    clip: float, dtype: str, nonfinite: str, two_pass: bool
) -> None:
    cfg = Config(
        parallel=ParallelConfig(zero=2, offload="optimizer"),
        train=TrainConfig(grad_clip=clip),
        precision=PrecisionConfig(dtype=dtype, nonfinite=nonfinite),  # type: ignore[arg-type]
    )
    assert Layout.from_config(cfg, 1).offload_two_pass is two_pass


def test_estimate_takes_the_slowest_stage_host_step() -> None:
    """Under pp every stage steps its own shards after the schedule: the estimate's
    optimizer time is the largest stage's two-pass flow (here the last stage, which holds
    the head and the final norm besides its blocks)."""
    from plait.plan.estimate import step_time
    from plait.plan.layout import RUNTIMES
    from plait.plan.modelspec import ModelSpec
    from plait.plan.units import shard_numel, stage_units

    hw = PRESETS["h100-80gb"]
    spec = ModelSpec.from_params(1_000_000_000, seq=1024)
    prec = PRECISIONS["bf16-mixed"]
    layout = Layout(pp=2, zero=1, microbatches=4, offload="optimizer", offload_two_pass=False)
    t = step_time(query(spec, layout, prec, RUNTIMES["plait"], 1024, hw), layout)
    per_stage = [
        offload_step_time(
            [shard_numel(u, 1) for u in stage_units(spec, 1, 2, s)], layout, hw, prec, 0.0
        )
        for s in (0, 1)
    ]
    assert per_stage[0] != per_stage[1]
    assert t.optimizer == pytest.approx(max(per_stage))
