"""``plait train --layout auto``: on 4 CPU ranks it picks the search's top layout, trains,
and matches one process; a model that fits nowhere is refused (exit 2) with the closest
option; ``plait plan --search`` with the same inputs ranks the same layout first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import main
from plait.config.coerce import config_from_dict
from plait.config.toml_io import load_config_data
from plait.errors import ConfigError
from plait.plan.auto import auto_query, choose_layout, layout_overrides
from plait.plan.layout import Layout
from plait.plan.profile_toml import load_hardware
from plait.plan.search import search
from tests.tiny import read_metrics, run_plait, tiny_args

HW = "a100-80gb"
"""A preset profile: the choice must not depend on this machine's load."""


def _cfg(world: int, extra: list[str] | None = None):  # type: ignore[no-untyped-def]
    from plait.config.overrides import parse_override_flags

    overrides, _ = parse_override_flags([*tiny_args(), *(extra or [])])
    return config_from_dict(load_config_data(None, list(overrides)))


def test_auto_equals_the_search_top_row(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(4)
    q = auto_query(cfg, 4, load_hardware(HW))
    choice = choose_layout(q)
    assert choice.rank == 0 and choice.estimate.layout == search(q).ranked[0].layout
    # the same inputs through `plait plan --search --json`
    args = [
        "plan", "--search", "--json", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--ffn", str(cfg.model.hidden_dim), "--vocab", str(cfg.model.vocab_size),
        "--seq-len", "32", "--devices", "4", "--global-batch", "8", "--precision", "fp32",
        "--runtime", "plait", "--hardware", HW,
    ]  # fmt: skip
    assert main(args) == 0
    top = json.loads(capsys.readouterr().out)["top"][0]["layout"]
    top.pop("world")
    assert Layout(**top) == choice.estimate.layout
    assert len(choice.lines) == 3 and choice.lines[2].startswith("why: ")


def test_layout_overrides_round_trip() -> None:
    """The settings written for a layout give that layout back (what a rank runs)."""
    from plait.plan.layout import Layout as L

    for lay in (
        L(dp=2, tp=2, zero=1, micro_batch=2, microbatches=2, sequence_parallel=True),
        L(dp=1, pp=2, micro_batch=1, microbatches=8, schedule="gpipe"),
        L(dp=2, cp=2, zero=3, micro_batch=4, recompute="full"),
    ):
        cfg = _cfg(lay.world, [f"--{s}" for s in layout_overrides(lay)])
        assert Layout.from_config(cfg, lay.world).describe() == lay.describe()


def test_auto_on_four_ranks_trains_and_matches_one_process(tmp_path: Path) -> None:
    one, four = tmp_path / "one.jsonl", tmp_path / "four.jsonl"
    base = [*tiny_args(), "--log.log_every", "1", "--steps", "3"]
    assert main(["train", *base, "--nproc", "1", "--metrics", str(one)]) == 0
    r = run_plait(
        ["train", *base, "--nproc", "4", "--layout", "auto", "--hardware", HW,
         "--metrics", str(four)],
        tmp_path, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("plait: ")]
    chose = next(i for i, ln in enumerate(lines) if "--layout auto chose" in ln)
    assert lines[chose + 1].startswith("plait: predicted") and "why:" in lines[chose + 2]
    want = choose_layout(auto_query(_cfg(4), 4, load_hardware(HW))).estimate.layout
    assert want.describe() in lines[chose]
    a, b = read_metrics(four), read_metrics(one)
    # fp32, the same global batch and initial weights: the losses of one process
    assert [x["loss"] for x in a] == pytest.approx([x["loss"] for x in b], rel=1e-5)
    assert [x["grad_norm"] for x in a] == pytest.approx([x["grad_norm"] for x in b], rel=1e-5)


def test_fits_nowhere_exits_2_with_the_closest_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataclasses import replace

    from plait.plan.profile_toml import dump_hardware

    tiny_mem = tmp_path / "small.toml"
    hw = replace(load_hardware(HW), name="tiny-device", memory_bytes=50_000.0)
    tiny_mem.write_text(dump_hardware(hw), encoding="utf-8")
    args = ["train", *tiny_args(), "--nproc", "4", "--layout", "auto", "--hardware", str(tiny_mem)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no layout of the model fits 4 x tiny-device" in err
    assert "the closest option is dp" in err
    with pytest.raises(ConfigError, match="closest option"):
        choose_layout(auto_query(_cfg(4), 4, hw))


def test_auto_refuses_a_layout_given_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *tiny_args(), "--nproc", "4", "--layout", "auto", "--tp", "2"]) == 2
    assert "--layout auto chooses parallel.tp itself" in capsys.readouterr().err
    assert main(["train", *tiny_args(), "--nproc", "1", "--hardware", HW]) == 2
