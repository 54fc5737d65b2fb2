"""``plait train --ray``: the same losses as ``--nproc``, restart from the last checkpoint.

The session's Ray instance (``ray_instance`` in tests/conftest.py: 4 CPUs, temporary
files under /tmp/plait-ray-<id>, shut down at the end) runs the ranks; its
``worker_process_setup_hook`` (``ray_faults.py``) lets a test kill a chosen rank at a
chosen step by writing a control file. The command
runs in this process (``plait.cli.main``), so ``launch_ray`` finds Ray initialised and
uses that instance. References: the same tiny run on the session's gloo pool (the
``--nproc`` code path after the launch: :class:`Trainer` on a mesh of the same layout,
one thread per rank), compared step by step within a relative 1e-4. Not exact: MKL's
float32 matmul may pick a kernel by the buffers' memory alignment (no ``MKL_CBWR``), so a
Ray worker process that ran earlier tests can differ from the pool in the last bits
(CI saw 3e-7 at step 1, 5.5e-6 by step 3 after Adam); a wrong rank order, batch or
layout moves the loss by 1e-2 or more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from plait.cli import main as plait_main
from plait.config import Config
from plait.launch.ray_backend import restart_config
from plait.testing import WorkerContext, WorkerPool
from tests.tiny import read_metrics, tiny_args

M = "tests.launch.test_ray_backend"
BASE = [
    *tiny_args(max_bytes=100_000),
    *["--train.warmup_steps", "2", "--launch.threads", "1", "--log.log_every", "1"],
]
LOSS_RTOL = 1e-4  # see the module docstring: last-bit differences, grown by Adam
LAYOUTS = {"dp2": (2, []), "pp2": (2, ["--pp", "2"]), "dp2xtp2": (4, ["--tp", "2"])}


def _args(layout: str, steps: int, tmp: Path, *extra: str) -> list[str]:
    n, flags = LAYOUTS[layout]
    return [
        "train",
        "--ray",
        *BASE,
        *flags,
        *("--nproc", str(n), "--steps", str(steps), "--metrics", str(tmp / "m.jsonl")),
        *extra,
    ]


def _body_reference(ctx: WorkerContext, layout: str, steps: int) -> list[float]:
    from plait.config.overrides import parse_override_flags
    from plait.config.toml_io import load_config
    from plait.train.trainer import Trainer

    _, flags = LAYOUTS[layout]
    overrides, rest = parse_override_flags([*BASE, *flags, "--steps", str(steps)])
    assert rest == []
    cfg = load_config(None, overrides)
    cfg.log.progress = "none"
    p = cfg.parallel
    mesh = ctx.mesh(dp=ctx.world_size // (p.tp * p.pp), tp=p.tp, pp=p.pp)
    return Trainer(cfg, mesh, show_progress=False).run().losses


def _reference(pools: Callable[[int], WorkerPool], layout: str, steps: int) -> list[float]:
    n, _ = LAYOUTS[layout]
    return list(pools(n).run(f"{M}:_body_reference", layout, steps)[0])


def test_restart_resumes_only_from_a_checkpoint_written_since_the_launch(tmp_path: Path) -> None:
    from plait.checkpoint import read_latest

    ck = tmp_path / "ck"
    cfg = Config()
    cfg.train.checkpoint_dir = str(ck)
    assert restart_config(cfg, None) is cfg  # nothing saved yet: start as the first attempt
    (ck / "step_2").mkdir(parents=True)
    (ck / "latest").write_text("step_2")
    assert read_latest(ck) == ck / "step_2"
    assert restart_config(cfg, None).train.resume == "latest"
    assert restart_config(cfg, str(read_latest(ck))) is cfg  # an older run's checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ray_gives_the_losses_of_nproc(
    ray_instance: Path, pools: Callable[[int], WorkerPool], tmp_path: Path, layout: str
) -> None:
    assert plait_main(_args(layout, 3, tmp_path)) == 0
    got = [row["loss"] for row in read_metrics(tmp_path / "m.jsonl")]
    assert got == pytest.approx(_reference(pools, layout, 3), rel=LOSS_RTOL)


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes(
    ray_instance: Path,
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ray_instance.write_text(json.dumps({"rank": 1, "step": 5}))
    extra = ["--train.checkpoint_every", "2", "--train.checkpoint_dir", str(tmp_path / "ck")]
    code = plait_main(_args("dp2", 6, tmp_path, *extra, "--launch.max_restarts", "1"))
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert not ray_instance.exists()  # rank 1 did die at step 5
    assert "rank 1 died; restarting every rank (restart 1 of 1), from the latest" in out.out
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # 5, 6: after the resume
    assert [r["loss"] for r in rows] == pytest.approx(_reference(pools, "dp2", 6), rel=LOSS_RTOL)


@pytest.mark.slow
def test_without_restarts_the_dead_rank_is_named(
    ray_instance: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ray_instance.write_text(json.dumps({"rank": 1, "step": 2}))
    code = plait_main(_args("dp2", 3, tmp_path))
    err = capsys.readouterr().err
    assert code == 1
    assert "rank 1: died: its Ray actor's process exited" in err


_NO_RAY = (
    "import importlib.abc, sys\n"
    "class NoRay(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'ray' or name.startswith('ray.'):\n"
    "            raise ImportError('blocked: ' + name)\n"
    "sys.meta_path.insert(0, NoRay())\n"
    "from plait.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_without_ray_one_line_says_how_to_install_it() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _NO_RAY, "train", "--ray", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "plait: error: launch.backend = 'ray' needs Ray, which is not installed: "
        "pip install 'plait[ray]'"
    ]


def test_a_bad_address_is_one_line_and_exit_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--ray", "--launch.ray_address", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: launch.ray_address 127.0.0.1:9")


def test_relative_paths_are_made_absolute_against_the_driver(tmp_path: Path) -> None:
    from plait.launch.ray_backend import absolute_paths

    cfg = Config()
    cfg.train.checkpoint_dir, cfg.log.metrics, cfg.train.resume = "ck", "m.jsonl", "latest"
    got = absolute_paths(cfg, tmp_path)
    assert got.train.checkpoint_dir == str(tmp_path / "ck")
    assert got.log.metrics == str(tmp_path / "m.jsonl")
    assert got.train.resume == "latest" and got.data.source == "stdlib"
    assert absolute_paths(got, Path("/elsewhere")).train.checkpoint_dir == str(tmp_path / "ck")
