"""Out-of-memory deaths are named (issue 32): which rank, host or device memory, peaks.

End to end, where the test may make a memory cgroup (root, cgroup v1 or v2), ``plait
train --nproc 2`` runs in one with a limit its ranks' model cannot fit: the kernel's
out-of-memory killer kills a rank, and the launcher names it from the cgroup's
``oom_kill`` count (or the kernel log). Everywhere, a rank of ``plait train --nproc 2`` is
SIGKILLed (as the kernel's
out-of-memory killer does) after it reported memory at the host limit the test sets
(``--launch.host_memory_gb``): the launcher prints the out-of-memory line naming the rank and
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
    given = [] if limit is None else ["--launch.host_memory_gb", str(limit / GIB)]
    return subprocess.Popen(
        [sys.executable, "-m", "plait", "train", *TINY, *given, "--nproc", "2"],
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
    assert head.startswith(
        "plait: out of memory: rank 1 ran out of host memory, last reported peak "
    )
    assert "killed by signal 9 (SIGKILL)" in head and "of the host limit" in head
    assert head.endswith("; then the launcher stopped rank(s) 0")
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


def _memory_cgroup(tmp: Path, limit: int) -> Path | None:
    """A fresh memory cgroup below this process's with ``limit`` bytes (None: cannot)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, knob = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        elif controllers == "":
            base, knob = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
        else:
            continue
        cg = base / f"plait-oom-{tmp.name}"
        try:
            cg.mkdir()
        except OSError:
            continue
        try:
            (cg / knob).write_text(str(limit))
            return cg
        except OSError:
            cg.rmdir()
    return None


def test_a_rank_killed_by_the_kernel_for_memory_is_named(tmp_path: Path) -> None:
    """A model of ~100 M parameters (fp32 weights, gradients, Adam: ~1.6 GB per rank)
    under a cgroup limit of 1.5 GB for the launcher and both ranks."""
    cg = _memory_cgroup(tmp_path, 1536 * 2**20)
    if cg is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable cgroupfs)")
    big = ["--model.dim", "1024", "--model.n_layers", "8", "--model.n_heads", "8"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait", "train", *TINY, *big, "--nproc", "2"],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: (cg / "cgroup.procs").write_text(str(os.getpid())),
        )
        _, err = proc.communicate(timeout=300)
    finally:
        cg.rmdir()
    assert proc.returncode == EXIT_OUT_OF_MEMORY, err[-3000:]
    head = next(ln for ln in err.splitlines() if "ran out of host memory" in ln)
    assert head.startswith("plait: out of memory: rank ")
    assert "oom_kill count went from 0 to 1" in head or "kernel log names pid" in head
    if "kernel log" in head:  # the resident bytes at the kill: the model did not fit
        assert float(head.split("memory, ")[1].split(" GiB")[0]) > 0.5
    assert "  rank 0: host peak " in err and "  rank 1: host peak " in err


# ----------------------------------------------------------------- the naming rules

REPORTS = {
    0: RankMemory(0, 100, rss=3 * GIB, peak_rss=4 * GIB),
    1: RankMemory(1, 101, rss=9 * GIB, peak_rss=10 * GIB),
}
KILLED = {0: "killed by signal 15", 1: "killed by signal 9"}


def test_the_kernel_record_names_the_killed_rank() -> None:
    far = (1000 * GIB, "MemTotal")
    by_cgroup = name_oom(KILLED, REPORTS, 0, 1, {}, far)
    assert by_cgroup is not None
    assert str(by_cgroup).startswith("rank 1 ran out of host memory, last reported peak 10.00 GiB")
    assert "oom_kill count went from 0 to 1" in str(by_cgroup)
    by_log = name_oom(KILLED, REPORTS, None, None, {101: 11 * GIB}, far)
    assert by_log is not None and "kernel log names pid 101" in str(by_log)
    assert str(by_log).startswith("rank 1 ran out of host memory, 11.00 GiB resident when killed")
    assert "  rank 0: host peak 4.00 GiB (last 3.00 GiB)" in str(by_log)
    assert name_oom(KILLED, REPORTS, 1, 1, {55: GIB}, far) is None  # no record, far from limit
    near = (13 * GIB, "cgroup memory.limit_in_bytes")  # 12 GiB reported: 92 %
    by_limit = name_oom(KILLED, REPORTS, None, None, {}, near)
    assert by_limit is not None and "at 92% of the host limit 13.00 GiB" in str(by_limit)
    assert name_oom({0: "ValueError: x", 1: "killed by signal 15"}, REPORTS, 0, 1, {}, near) is None


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
        text, {3: RankMemory(3, 7, GIB, 2 * GIB, 5 * GIB, 8 * GIB)}, 0, 0, {}, (0, "")
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
