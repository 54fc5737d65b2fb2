"""Out-of-memory deaths, named: which rank, host or device memory, its peak, what to try.

A rank killed by the kernel's out-of-memory killer dies of SIGKILL and leaves no error of
its own; the launcher would only say ``killed by signal 9``. So every rank of
:func:`~plait.launch.local.launch_local` writes its memory to a small file in a folder the
launcher made (``PLAIT_MEMORY_DIR``), at start and every ``interval_s`` after
(:class:`MemoryReporter`): its pid, resident set size (``VmRSS``), peak resident set
(``VmHWM``) and, on CUDA, the device's peak allocated bytes and its capacity. When a rank
dies of signal 9, the launcher (:func:`name_oom`) calls it out of host memory when

* the kernel says so: the rank's pid in a readable kernel log (``dmesg``: "Killed process
  <pid>"), or the ``oom_kill`` count of the launcher's memory cgroup (v2
  ``memory.events``, v1 ``memory.oom_control``) went up during the run; or
* the ranks' last reported resident memory together reached :data:`NEAR_LIMIT` of the
  host memory limit (:func:`host_memory_limit`: ``launch.host_memory_gb`` when set,
  else the cgroup's limit, else ``MemTotal``).

A rank that raises an allocation failure (``torch.cuda.OutOfMemoryError``, ``MemoryError``,
torch's "can't allocate memory") re-raises it as :class:`~plait.errors.OutOfMemoryError`
(:func:`as_out_of_memory`), which the launcher reports the same way. Either report names
the rank (with its resident memory at the kill when the kernel log gives it), prints
every rank's peak host and device memory and suggests what to try; the
exit status is :data:`~plait.cli.common.EXIT_OUT_OF_MEMORY` (3).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from plait.errors import OutOfMemoryError

MEMORY_DIR_ENV = "PLAIT_MEMORY_DIR"
"""The folder the ranks write their memory records into (set by the launcher)."""
NEAR_LIMIT = 0.8
"""A SIGKILLed rank is out of memory when the ranks' last reported RSS together reached
this share of the host limit (memory grows between reports)."""
HINT = (
    "try: `plait plan` to find a layout that fits this model on these devices; "
    "ZeRO-3 (--parallel.zero 3) to shard weights, gradients and optimizer state; "
    "CPU offload (--parallel.offload optimizer, or params with ZeRO-3); more ranks or "
    "machines; a smaller micro-batch or activation recomputation"
)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory as it last reported it (bytes; device 0 when on the CPU)."""

    rank: int
    pid: int
    rss: int
    peak_rss: int
    device_peak: int = 0
    device_total: int = 0


def _status_bytes(field: str, text: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def own_memory(rank: int) -> RankMemory:
    """This process's memory now (``/proc/self/status``; CUDA's peak when in use)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    dev_peak = dev_total = 0
    torch = sys.modules.get("torch")  # never imported for this (the launcher has none)
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            dev_peak = int(torch.cuda.max_memory_allocated())
            dev_total = int(
                torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            )
    except Exception:  # a report must never fail the rank
        pass
    return RankMemory(
        rank,
        os.getpid(),
        _status_bytes("VmRSS", status),
        _status_bytes("VmHWM", status),
        dev_peak,
        dev_total,
    )


class MemoryReporter:
    """A daemon thread that writes this rank's :class:`RankMemory` into ``folder`` as
    ``rank<r>.json`` (atomically) now and every ``interval_s``; :meth:`report` writes at
    once (a milestone), :meth:`stop` ends the thread."""

    def __init__(self, folder: Path, rank: int, interval_s: float = 0.5) -> None:
        self.folder, self.rank, self.interval_s = folder, rank, interval_s
        self._stop = threading.Event()
        self.report()
        self._thread = threading.Thread(target=self._loop, name="plait-memory", daemon=True)
        self._thread.start()

    def report(self) -> None:
        """Write the current record (errors writing are ignored: it is a diagnostic)."""
        path = self.folder / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(asdict(own_memory(self.rank))))
            os.replace(tmp, path)
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.report()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def start_reporter(rank: int, environ: dict[str, str] | None = None) -> MemoryReporter | None:
    """A :class:`MemoryReporter` for this rank when its launcher asked for one."""
    folder = (os.environ if environ is None else environ).get(MEMORY_DIR_ENV)
    return MemoryReporter(Path(folder), rank) if folder and Path(folder).is_dir() else None


def read_reports(folder: Path) -> dict[int, RankMemory]:
    """Every rank's last record in ``folder`` (unreadable ones left out)."""
    out: dict[int, RankMemory] = {}
    for p in sorted(folder.glob("rank*.json")):
        try:
            r = RankMemory(**json.loads(p.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[r.rank] = r
    return out


# ----------------------------------------------------------------- the kernel's record


def _cgroup_dirs() -> list[Path]:
    """The memory cgroup folders of this process (v2 unified, v1 memory controller)."""
    out: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for ln in lines:
        _, controllers, path = ln.split(":", 2)
        if controllers == "":
            out.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
    return out


def _read_int(path: Path, key: str | None = None) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    if key is None:
        text = text.strip()
        return int(text) if text.isdigit() else None
    m = re.search(rf"^{key} (\d+)$", text, re.M)
    return int(m.group(1)) if m else None


def cgroup_oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills in this process's memory cgroup (None:
    not readable)."""
    for d in _cgroup_dirs():
        for f in ("memory.events", "memory.oom_control"):
            n = _read_int(d / f, "oom_kill")
            if n is not None:
                return n
    return None


def uptime_s() -> float:
    """Seconds since boot (the kernel log's clock; 0 when unreadable)."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def kernel_killed_pids(since_s: float = 0.0) -> dict[int, int]:
    """Pids the kernel log names as killed for memory at or after ``since_s`` seconds
    since boot, each with its resident bytes at the kill (anon + file + shmem RSS; 0 when
    the line does not say); empty when dmesg is not readable."""
    try:
        text = subprocess.run(
            ["dmesg"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[int, int] = {}
    for m in re.finditer(r"^\[\s*([\d.]+)\].*Killed process (\d+)(.*)$", text, re.M):
        if float(m.group(1)) >= since_s:
            kb = re.findall(r"(?:anon|file|shmem)-rss:(\d+)kB", m.group(3))
            out[int(m.group(2))] = sum(int(k) for k in kb) * 1024
    return out


def host_memory_limit(given: int | None = None) -> tuple[int, str]:
    """(bytes, where from) of the host memory the ranks may use together: ``given``
    (``launch.host_memory_gb``) when set, else the memory cgroup's limit, else MemTotal."""
    if given is not None:
        return given, "launch.host_memory_gb"
    total = (
        _status_bytes("MemTotal", Path("/proc/meminfo").read_text())
        if Path("/proc/meminfo").exists()
        else 0
    )
    for d in _cgroup_dirs():
        for f in ("memory.max", "memory.limit_in_bytes"):
            n = _read_int(d / f)
            if n is not None and 0 < n < (total or n + 1):
                return n, f"cgroup {f}"
    return total, "MemTotal"


# ----------------------------------------------------------------- the report


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def peak_table(reports: dict[int, RankMemory]) -> str:
    """One line per rank: its peak host memory and (on CUDA) device memory."""
    lines = []
    for r in sorted(reports):
        m = reports[r]
        dev = (
            f", device peak {_gib(m.device_peak)} of {_gib(m.device_total)}"
            if m.device_total
            else ""
        )
        lines.append(f"  rank {r}: host peak {_gib(m.peak_rss)} (last {_gib(m.rss)}){dev}")
    return "\n".join(lines) if lines else "  (no rank reported its memory)"


def name_oom(
    failures: dict[int, str],
    reports: dict[int, RankMemory],
    kills_before: int | None,
    kills_after: int | None,
    killed_pids: dict[int, int],
    limit: tuple[int, str],
) -> OutOfMemoryError | None:
    """The out-of-memory error to report for ``failures`` (rank -> text), or None when no
    rank died of memory (see the module docstring for the rules)."""
    raised = [r for r in sorted(failures) if failures[r].startswith("OutOfMemoryError: ")]
    if raised:
        r = raised[0]
        text = failures[r].partition(": ")[2].split(" (at File ")[0]
        head = text if text.startswith("rank") else f"rank {r}: {text}"
        return OutOfMemoryError(f"{head}\npeak memory per rank:\n{peak_table(reports)}\n{HINT}")
    killed = [r for r in sorted(failures) if failures[r] == "killed by signal 9"]
    if not killed:
        return None
    limit_bytes, source = limit
    together = sum(m.rss for m in reports.values())
    why, at_kill = "", 0
    for r in killed:
        pid = reports[r].pid if r in reports else None
        if pid is not None and pid in killed_pids:
            why = f"the kernel log names pid {pid} as killed for memory"
            victim, at_kill = r, killed_pids[pid]
            break
    else:
        victim = max(killed, key=lambda r: reports[r].rss if r in reports else -1)
        if kills_before is not None and kills_after is not None and kills_after > kills_before:
            why = f"the memory cgroup's oom_kill count went from {kills_before} to {kills_after}"
        elif limit_bytes and together >= NEAR_LIMIT * limit_bytes:
            why = (
                f"the ranks' last reported memory together, {_gib(together)}, was at "
                f"{together / limit_bytes:.0%} of the host limit {_gib(limit_bytes)} ({source})"
            )
    if not why:
        return None
    peak = ""
    if at_kill:
        peak = f", {_gib(at_kill)} resident when killed"
    elif victim in reports:
        peak = f", last reported peak {_gib(reports[victim].peak_rss)}"
    others = [r for r in sorted(failures) if r != victim]
    rest = f"; then the launcher stopped rank(s) {', '.join(map(str, others))}" if others else ""
    return OutOfMemoryError(
        f"rank {victim} ran out of host memory{peak}: killed by signal 9 (SIGKILL) by the "
        f"kernel's out-of-memory killer ({why}){rest}\n"
        f"host memory limit {_gib(limit_bytes)} ({source}); peak memory per rank:\n"
        f"{peak_table(reports)}\n{HINT}"
    )


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure (host or CUDA device)."""
    if isinstance(e, (MemoryError, OutOfMemoryError)):
        return True
    if type(e).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError
        return True
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in str(e) or "CUDA error: out of memory" in str(e)
    )


def as_out_of_memory(e: BaseException, rank: int, device: Any) -> OutOfMemoryError:
    """``e`` (an allocation failure on ``rank``) as an :class:`OutOfMemoryError` that says
    which memory, the rank's peak and the failed allocation's message."""
    m = own_memory(rank)
    cuda = type(e).__name__ == "OutOfMemoryError" or "CUDA" in str(e)
    where = f"device memory ({device})" if cuda else "host memory"
    peak = (
        f"device peak {_gib(m.device_peak)} of {_gib(m.device_total)}"
        if cuda and m.device_total
        else f"host peak {_gib(m.peak_rss)}"
    )
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return OutOfMemoryError(f"rank {rank} ran out of {where} ({peak}): {first}")
