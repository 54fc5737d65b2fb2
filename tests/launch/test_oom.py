"""Out-of-memory deaths are named (issue 32): which rank, host or device memory, peaks.

End to end, a rank of ``plait train --nproc 2`` is SIGKILLed (as the kernel's
out-of-memory killer does) after it reported memory at the host limit the test sets
(``PLAIT_MEMORY_LIMIT``): the launcher prints the out-of-memory line naming the rank and
its peak, every rank's peak and what to try, and exits 3. Without the limit reached the
same kill is a plain ``killed by signal 9`` (exit 1). The kernel's record (cgroup
``oom_kill`` count, kernel log pid) and an allocation failure raised on a rank (CUDA's
``OutOfMemoryError`` built here; a real one on a GPU machine) are tested on the naming
function. Waits are on pipes and process exits, never sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.cli.common import EXIT_FAILURE, EXIT_OUT_OF_MEMORY, run_command
from plait.errors import OutOfMemoryError
from plait.launch import oom
from plait.launch.oom import RankMemory, name_oom
from tests.launch.test_local import _ranks, _wait_for_step
from tests.tiny import tiny_args

TINY = [*tiny_args(), "--log.log_every", "1", "--steps", "100000"]
GIB = 2**30


def _start(tmp: Path, limit: int | None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(oom.MEMORY_LIMIT_ENV, None)
    if limit is not None:
        env[oom.MEMORY_LIMIT_ENV] = str(limit)
    return subprocess.Popen(
        [sys.executable, "-m", "plait", "train", *TINY, "--nproc", "2"],
        cwd=tmp,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _kill_rank_1(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGKILL rank 1 once the ranks train (each reported its memory before its first
    step); the launcher's stdout and stderr."""
    _wait_for_step(proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)  # rank 1: the second child started
    return proc.communicate(timeout=180)


def test_a_rank_killed_at_the_memory_limit_is_named_out_of_memory(tmp_path: Path) -> None:
    """The limit (1 MiB) is below what any rank reported: the ranks were at the limit."""
    proc = _start(tmp_path, limit=2**20)
    _, err = _kill_rank_1(proc)
    assert proc.returncode == EXIT_OUT_OF_MEMORY, err[-3000:]
    lines = err.strip().splitlines()
    head = next(ln for ln in lines if "ran out of host memory" in ln)
    assert head.startswith("plait: out of memory: rank 1 ran out of host memory, peak ")
    assert "killed by signal 9 (SIGKILL)" in head and "of the host limit" in head
    assert "ranks 0 were stopped after it" in head
    for r in (0, 1):
        peak = next(ln for ln in lines if ln.startswith(f"  rank {r}: host peak "))
        assert float(peak.split("host peak ")[1].split(" GiB")[0]) > 0.01  # python + torch
    assert "`plait plan`" in err and "--parallel.zero 3" in err
    assert "Traceback" not in err


def test_a_rank_killed_far_below_the_limit_is_not_called_out_of_memory(tmp_path: Path) -> None:
    proc = _start(tmp_path, limit=1 << 50)  # 1 PiB: nowhere near
    _, err = _kill_rank_1(proc)
    assert proc.returncode == EXIT_FAILURE, err[-3000:]
    assert "rank 1: killed by signal 9" in err
    assert "out of memory" not in err


# ----------------------------------------------------------------- the naming rules

REPORTS = {
    0: RankMemory(0, 100, rss=3 * GIB, peak_rss=4 * GIB),
    1: RankMemory(1, 101, rss=9 * GIB, peak_rss=10 * GIB),
}
KILLED = {0: "killed by signal 15", 1: "killed by signal 9"}


def test_the_kernel_record_names_the_killed_rank() -> None:
    far = (1000 * GIB, "MemTotal")
    by_cgroup = name_oom(KILLED, REPORTS, 0, 1, set(), far)
    assert by_cgroup is not None
    assert str(by_cgroup).startswith("rank 1 ran out of host memory, peak 10.00 GiB")
    assert "oom_kill count went from 0 to 1" in str(by_cgroup)
    by_log = name_oom(KILLED, REPORTS, None, None, {101}, far)
    assert by_log is not None and "kernel log names pid 101" in str(by_log)
    assert "  rank 0: host peak 4.00 GiB (last 3.00 GiB)" in str(by_log)
    assert name_oom(KILLED, REPORTS, 1, 1, {55}, far) is None  # no record, far from limit
    near = (13 * GIB, "cgroup memory.limit_in_bytes")  # 12 GiB reported: 92 %
    by_limit = name_oom(KILLED, REPORTS, None, None, set(), near)
    assert by_limit is not None and "at 92% of the host limit 13.00 GiB" in str(by_limit)
    assert (
        name_oom({0: "ValueError: x", 1: "killed by signal 15"}, REPORTS, 0, 1, set(), near) is None
    )


def test_a_cuda_out_of_memory_error_on_a_rank_is_named() -> None:
    err = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert oom.is_out_of_memory(err) and oom.is_out_of_memory(MemoryError())
    assert not oom.is_out_of_memory(RuntimeError("shape mismatch"))
    named = oom.as_out_of_memory(err, 3, torch.device("cuda", 3))
    assert str(named).startswith("rank 3 ran out of device memory (cuda:3)")
    assert str(named).endswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    # the launcher's text of that rank's failure, as the elastic agent records it
    text = {3: f'OutOfMemoryError: {named} (at File "x.py", line 1)', 0: "killed by signal 15"}
    launcher = name_oom(
        text, {3: RankMemory(3, 7, GIB, 2 * GIB, 5 * GIB, 8 * GIB)}, 0, 0, set(), (0, "")
    )
    assert launcher is not None and str(launcher).startswith("rank 3 ran out of device memory")
    assert "device peak 5.00 GiB of 8.00 GiB" in str(launcher) and "(at File" not in str(launcher)


def test_out_of_memory_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    def boom(argv: object) -> int:
        raise OutOfMemoryError("rank 0 ran out of host memory")

    assert run_command(boom, []) == EXIT_OUT_OF_MEMORY == 3
    assert capsys.readouterr().err == "plait: out of memory: rank 0 ran out of host memory\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_out_of_memory_is_named() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.cuda.OutOfMemoryError) as e:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    assert oom.is_out_of_memory(e.value)
    named = str(oom.as_out_of_memory(e.value, 0, torch.device("cuda", 0)))
    assert named.startswith("rank 0 ran out of device memory (cuda:0) (device peak ")
    assert "CUDA out of memory" in named
