"""``plait train --nproc MIN:MAX``: ranks SIGKILLed for good, the job goes on replanned;
ranks given back, the job grows.

Each case starts 4 local ranks (through the zygote) of the tiny built-in model with a
global batch of 12, kills ranks of the first world on entry to a step (the fixture
``elastic_entry.py``; no restart budget), and checks that the job finishes on the
survivors' layout, says so in one line (old -> new layout, why, step, seconds), and that
its loss at every step equals an uninterrupted one-process run's on the same global
batches: float32, rtol 1e-5 (the layouts differ only in summation order: dp and
accumulation averaging, tp partial sums; measured differences are ~1e-7 relative, a lost
or repeated step changes the loss by > 1e-3).

* ZeRO-3 dp4, rank 2 killed at step 5, memory copies every 2 steps: ZeRO-3 dp3
  (micro-batch 2 x 2 accumulation) resumes from the memory copies of step 4 (each rank's
  flat shards, resharded 4 -> 3), no disk. Plain dp recovers from memory in
  ``benchmarks/elastic_recovery.py --tiny`` (3 -> 2 ranks, run by the suite).
* tp2xdp2, rank 1 killed at step 3 before any memory copy (every 4): the survivors'
  best layout is tp2xdp1 on 2 ranks (3 is no multiple of tp2), resumed from the disk
  checkpoint of step 2, the fallback named in the line.
* grow: ``--nproc 2:4 --launch.start_ranks 2 --layout auto`` starts on the planner's
  layout for 2 ranks; once step 2 is done the launcher gets SIGUSR1 (the ranks are back;
  sent by the fixture), the ranks save at the next step boundary and the job goes on
  from that checkpoint on the planner's layout for 4 ranks.

:func:`~plait.launch.elastic.replan_auto` (the planner's choice per world) is checked
in-process with a stand-in planner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait import init_mesh
from plait.config.coerce import config_from_dict
from plait.config.overrides import parse_override_flags
from plait.config.toml_io import load_config_data
from plait.errors import ConfigError
from plait.launch.elastic import replan_auto
from plait.train.trainer import Trainer
from tests.tiny import read_metrics, tiny_args

ENTRY = Path(__file__).with_name("elastic_entry.py")
STEPS = 6
RUN = [*tiny_args(), "--global-batch", "12", "--steps", str(STEPS), "--log.log_every", "1"]


def reference_losses() -> list[float]:
    """The uninterrupted run: one process, the same flags, no files."""
    overrides, rest = parse_override_flags([*RUN, "--metrics", "none"])
    assert not rest
    cfg = config_from_dict(load_config_data(None, overrides))
    return Trainer(cfg, init_mesh(), show_progress=False).run().losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses()


CASES = {
    "zero3-dp4-memory": (
        ["--nproc", "3:4", "--zero", "3", "--train.memory_checkpoint_every", "2"], "2", 5
    ),
    "tp2xdp2-disk": (
        ["--nproc", "2:4", "--tp", "2", "--train.memory_checkpoint_every", "4",
         "--train.checkpoint_every", "2"],
        "1",
        3,
    ),
}  # fmt: skip


GROW = [
    *["--nproc", "2:4", "--launch.start_ranks", "2", "--train.checkpoint_dir", "ck"],
    *["--layout", "auto"],  # the planner picks the layout of each world
]


@pytest.mark.parametrize("case", [*sorted(CASES), "grow"])
def test_job_shrinks_or_grows_and_keeps_its_losses(
    case: str, tmp_path: Path, reference: list[float]
) -> None:
    flags, kill, at = CASES[case] if case != "grow" else (GROW, "-1", 1)
    metrics = tmp_path / "m.jsonl"
    args = [*RUN, *flags, "--metrics", str(metrics), "--log.dir", str(tmp_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if case == "grow":
        env["PLAIT_TEST_GROW_AT"] = "2"
    proc = subprocess.run(
        [sys.executable, str(ENTRY), kill, str(at), "train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("plait: elastic:")]
    assert len(lines) == 1, proc.stdout[-3000:]
    line = lines[0]
    if case == "grow":  # the planner's dp2 layout until SIGUSR1 after step 2, then its dp4
        assert line.startswith("plait: elastic: dp2 -> dp4 on 4 ranks (micro-batch "), line
        assert "ranks are back (SIGUSR1) after step" in line, line
        assert "resuming from ck/step_0000000" in line, line
    else:
        assert f"rank {kill} killed by signal 9 after step {at - 1}" in line, line
        if case == "zero3-dp4-memory":
            want = "plait: elastic: dp4 -> dp3 on 3 ranks (micro-batch 2 x 2"
            assert line.startswith(want), line
            assert "from the memory copies of step 4 at step 4 (0 step(s)" in line, line
        else:
            want = "plait: elastic: tp2xdp2 -> tp2xdp1 on 2 ranks (micro-batch 6 x 2"
            assert line.startswith(want), line
            assert "from the disk checkpoint" in line, line
            assert "no memory copy was complete" in line, line
            assert "at step 2 (0 step(s)" in line, line
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    got = [r["loss"] for r in rows]
    assert got == pytest.approx(reference, rel=1e-5), (got, reference)


def test_replan_auto_takes_the_largest_world_the_planner_accepts() -> None:
    def choose(n: int) -> tuple[list[str], list[str]]:
        if n == 3:
            raise ConfigError("no layout fits")
        sets = [f"parallel.dp={n // 2}", "parallel.tp=2", "train.micro_batch=2"]
        return sets, ["train", *(f"--{s}" for s in sets)]

    got, argv = replan_auto(choose, 12, 3, 2)
    assert (got.world, got.name, got.micro_batch, got.accumulation) == (2, "tp2xdp1", 2, 6)
    assert argv == ["train", "--parallel.dp=1", "--parallel.tp=2", "--train.micro_batch=2"]
    with pytest.raises(ConfigError, match="3 ranks: no layout fits"):
        replan_auto(choose, 12, 3, 3)
