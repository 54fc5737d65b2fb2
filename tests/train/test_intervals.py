"""``train.checkpoint_every = auto``: the trainer times a save at its second step and
saves every Young's interval sqrt(2 C M) from then on (one process, the tiny model)."""

from __future__ import annotations

import math
from pathlib import Path

from plait import init_mesh
from plait.checkpoint.format import list_steps
from plait.train.trainer import Trainer
from tests.tiny import tiny_config


def test_auto_interval_follows_young(tmp_path: Path) -> None:
    """M = 0.36 ms: the interval rounds to one step, so every step after the timed save
    of step 2 is saved (the sole case with a visible interval that timing cannot flip)."""
    mtbf_hours = 1e-7
    cfg = tiny_config(steps=4)
    cfg.train.eval_every = 0
    cfg.train.checkpoint_dir, cfg.train.checkpoint_every = str(tmp_path), "auto"
    cfg.train.keep_checkpoints = 10
    cfg.launch.mtbf_hours = mtbf_hours
    tr = Trainer(cfg, init_mesh(), show_progress=False)
    tr.run()
    (iv,) = tr.intervals.chosen
    by_hand = max(1, round(math.sqrt(2 * iv.save_s * mtbf_hours * 3600) / iv.step_s))
    assert iv.kind == "disk" and iv.save_s > 0 and tr.checkpoints.every == iv.steps == by_hand
    assert [s for s, _ in list_steps(tmp_path)] == [2, 3, 4]
