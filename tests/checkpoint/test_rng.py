"""A resume restores every RNG (torch, Python, NumPy) and the sampler exactly as saved.

Each RNG is moved away from where a fresh start would leave it before the save, and
scrambled before the resume, so a restore that forgets one of them (or hands rank r
another rank's states) fails. The saved states are compared with the ones captured at
the moment of the save, and the restored ones with the saved ones.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait import init_mesh
from plait.checkpoint import CheckpointReader, TrainState, step_dirname
from plait.checkpoint.format import rank_filename
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import config

M = "tests.checkpoint.test_rng"


def _states() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state().clone(),
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].copy(), *np_state[2:]),
    }


def _check(root: str, rank: int, mesh_of: Any) -> dict[str, Any]:
    """Train 2 steps saving at 2 (every RNG moved by a rank-dependent amount first),
    scramble, resume; returns what was captured, saved and restored."""
    tr = Trainer(config(root, steps=2, every=2), mesh_of(), show_progress=False)
    torch.rand(3 + rank)
    for _ in range(5 + rank):
        random.random()
    np.random.rand(7 + rank)
    captured: dict[str, Any] = {}
    after = tr.checkpoints.after_step

    def after_step(state: TrainState, done: int, last: int, stop: bool) -> Any:
        if done == 2:
            captured.update(_states())
        return after(state, done, last, stop)

    tr.checkpoints.after_step = after_step  # type: ignore[method-assign]
    tr.run()
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    resumed = Trainer(config(root, steps=4, every=2, resume="latest"), mesh_of(), False)
    restored = _states()
    reader = CheckpointReader(Path(root) / step_dirname(2))
    f = rank_filename(rank)
    saved = {
        "torch": reader.tensor(f, "rng/torch"),
        "python": tuple(int(x) for x in reader.tensor(f, "rng/python").tolist()),
        "numpy": reader.tensor(f, "rng/numpy").numpy().astype(np.uint32),
    }
    return {
        "captured": captured,
        "saved": saved,
        "restored": restored,
        "sampler_saved": reader.meta["sampler"],
        "sampler_restored": resumed.sampler.state_dict(),
        "start": resumed.start_step,
    }


def _assert_round_trip(r: dict[str, Any]) -> None:
    cap, saved, got = r["captured"], r["saved"], r["restored"]
    assert torch.equal(saved["torch"], cap["torch"])  # saved what it had at the save
    assert torch.equal(got["torch"], cap["torch"])  # and restored it
    assert saved["python"] == cap["python"][1]
    assert got["python"] == cap["python"]  # version, state and cached gauss
    assert np.array_equal(saved["numpy"], cap["numpy"][1])
    assert got["numpy"][0] == cap["numpy"][0] and got["numpy"][2:] == cap["numpy"][2:]
    assert np.array_equal(got["numpy"][1], cap["numpy"][1])
    assert r["start"] == 2
    assert r["sampler_saved"] == {
        "step": 2,
        "order": "feistel",
        **{k: r["sampler_saved"][k] for k in ("seed", "num_samples", "global_batch")},
    }
    assert r["sampler_restored"] == r["sampler_saved"]


def test_one_process_restores_rng_and_sampler_as_saved(tmp_path: Path) -> None:
    _assert_round_trip(_check(str(tmp_path / "ck"), 0, init_mesh))


def _body(ctx: WorkerContext, root: str) -> dict[str, Any]:
    return _check(root, ctx.rank, lambda: ctx.mesh(dp=ctx.world_size))


def test_each_rank_gets_its_own_rng_back(pools: Any, tmp_path: Path) -> None:
    pool: WorkerPool = pools(2)
    results = pool.run(f"{M}:_body", str(tmp_path / "ck"))
    for r in results:
        _assert_round_trip(r)
    a, b = (r["captured"]["torch"] for r in results)
    assert not torch.equal(a, b)  # the ranks' states differ, so a swap would show
