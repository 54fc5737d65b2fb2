"""The local launcher under a hostile user: signals, kill -9, errors after the launch.

* SIGTERM to the launcher reaches every rank; they save at the next step boundary, and
  the launcher prints one line naming the checkpoint and exits 0 (no traceback).
* SIGTERM to one rank stops the whole run at a step boundary, which it reports.
* ``kill -9`` of the launcher takes its ranks with it (parent-death signal).
* A bad input found by the ranks after the launch is reported once, exit status 2.

Each test waits on events (a progress line on the pipe, a process's exit through a
pidfd), never by sleeping.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from plait.checkpoint import CheckpointReader, read_latest
from plait.checkpoint.folder import LOCK_NAME
from tests.tiny import tiny_args

TINY = [*tiny_args(), "--log.log_every", "1"]
LONG = ["--steps", "100000", "--train.eval_every", "0"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "plait", *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _wait_for_step(proc: subprocess.Popen[str]) -> list[str]:
    """Lines of stdout up to the first progress line (the ranks are in the loop)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step"):
            return seen
    raise AssertionError("the run ended before its first step: " + "".join(seen))


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return sorted(out)


def _ranks(launcher: int) -> list[int]:
    """The rank processes under the launcher (python children running plait)."""
    found = []
    for c in _children(launcher):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"plait" in cmd:
            found.append(c)
    return found


def _wait_gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not our child) exits within ``timeout`` s (pidfd poll)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def test_sigterm_to_the_launcher_saves_and_exits_0(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    args = ["train", *TINY, *LONG, "--nproc", "2", "--train.checkpoint_dir", str(ck)]
    proc = _start(args, tmp_path)
    _wait_for_step(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "death signal" not in err
    latest = read_latest(ck)
    assert latest is not None
    step = CheckpointReader(latest).step  # verified
    assert 0 < step < 100000
    lines = out.strip().splitlines()
    assert lines[-1] == (
        f"plait: stopped by SIGTERM; the ranks saved checkpoint {latest} (--resume goes on)"
    )
    assert f"plait: stopped early at step {step} of 100000" in out
    assert not (ck / LOCK_NAME).exists()  # released


def test_sigterm_to_one_rank_stops_all_and_says_so(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    args = ["train", *TINY, *LONG, "--nproc", "2", "--train.checkpoint_dir", str(ck)]
    proc = _start(args, tmp_path)
    _wait_for_step(proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    latest = read_latest(ck)
    assert latest is not None
    step = CheckpointReader(latest).step
    assert f"plait: stopped early at step {step} of 100000 (" in out
    assert f"checkpoint {latest}" in out


def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    args = ["train", *TINY, *LONG, "--nproc", "2", "--train.checkpoint_dir", str(tmp_path)]
    proc = _start(args, tmp_path)
    _wait_for_step(proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    proc.kill()  # SIGKILL: no handler, no forwarding
    proc.wait(timeout=30)
    for r in ranks:
        assert _wait_gone(r, 60), f"rank process {r} outlived its launcher"
    proc.communicate()


def test_ranks_die_with_a_killed_torchrun(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "plait", "train", *TINY, *LONG],
        cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    _wait_for_step(proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    proc.kill()
    proc.wait(timeout=30)
    for r in ranks:
        assert _wait_gone(r, 60), f"rank process {r} outlived torchrun"
    proc.communicate()


def test_bad_input_after_launch_is_reported_once_with_exit_2(tmp_path: Path) -> None:
    """The parent's checks are bypassed (launch_local directly): each rank finds the
    out-of-vocabulary id itself; the launcher prints it once and exits 2."""
    data = tmp_path / "tokens.npy"
    ids = np.arange(4000, dtype=np.uint16) % 200
    ids[1234] = 300  # the tiny model's vocabulary is 256
    np.save(data, ids)
    code = (
        "import sys\n"
        "from plait.cli.common import run_command\n"
        "from plait.launch.local import launch_local\n"
        "sys.exit(run_command(lambda a: launch_local(2, a), sys.argv[1:]))\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-c", code, "train", *TINY, "--steps", "2", "--data", str(data)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plait: error:")]
    assert len(errors) == 1, r.stderr
    assert "tokens.npy: token id 300 (at position 1,234)" in errors[0]
    assert "model.vocab_size = 256" in errors[0]
    assert r.stderr.count("token id 300") == 1
