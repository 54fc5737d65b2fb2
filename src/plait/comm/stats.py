"""Per-rank communication counters: calls, bus bytes and seconds per (mesh axis, operation).

Bus bytes follow the convention of nccl-tests, with S the size in bytes of the full
tensor the operation is about and N the size of the group:

=================  =====================  ===========================================
operation          bus bytes              S is
=================  =====================  ===========================================
all_reduce         2(N-1)/N · S           the tensor reduced
all_gather         (N-1)/N · S            the gathered (output) tensor
reduce_scatter     (N-1)/N · S            the input tensor (before scattering)
all_to_all         (N-1)/N · S            the input tensor
gather, scatter    (N-1)/N · S            the concatenation of all ranks' pieces
broadcast, reduce  S                      the tensor
send, recv         S                      the message
barrier            0
=================  =====================  ===========================================

A group of one rank moves nothing: the call is counted with 0 bytes.
Seconds are the wall time spent blocked in the call (for an asynchronous operation,
the time spent in ``wait()``): exposed communication, not the time on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OpStats:
    """Totals of one operation on one mesh axis."""

    calls: int = 0
    bytes: float = 0.0
    seconds: float = 0.0


def bus_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bus bytes of ``op`` on a tensor of ``nbytes`` bytes in a group of ``group_size``."""
    n = group_size
    if n <= 1 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n * nbytes
    if op in ("broadcast", "reduce", "send", "recv"):
        return float(nbytes)
    raise ValueError(f"no bus-byte convention for operation {op!r}")


class CommStats:
    """Counters of one rank, keyed by (axis, operation)."""

    def __init__(self) -> None:
        self._ops: dict[tuple[str, str], OpStats] = {}
        self.enabled = True

    def record(self, axis: str, op: str, nbytes: float, seconds: float = 0.0) -> None:
        """Count one call of ``op`` on ``axis`` moving ``nbytes`` bus bytes."""
        if not self.enabled:
            return
        s = self._ops.setdefault((axis, op), OpStats())
        s.calls += 1
        s.bytes += nbytes
        s.seconds += seconds

    def add_seconds(self, axis: str, op: str, seconds: float) -> None:
        """Add blocked time to an operation already counted (asynchronous waits)."""
        if self.enabled:
            self._ops.setdefault((axis, op), OpStats()).seconds += seconds

    def get(self, axis: str, op: str) -> OpStats:
        """A copy of the totals of ``op`` on ``axis`` (zeros when never called)."""
        s = self._ops.get((axis, op))
        return OpStats(s.calls, s.bytes, s.seconds) if s is not None else OpStats()

    def total_bytes(self, axis: str | None = None) -> float:
        """Bus bytes over all operations, on one axis or all."""
        return sum(s.bytes for (a, _), s in self._ops.items() if axis is None or a == axis)

    def total_seconds(self, axis: str | None = None) -> float:
        """Blocked seconds over all operations, on one axis or all."""
        return sum(s.seconds for (a, _), s in self._ops.items() if axis is None or a == axis)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A plain copy: ``{"axis/op": {"calls", "bytes", "seconds"}}``."""
        return {
            f"{a}/{o}": {"calls": s.calls, "bytes": s.bytes, "seconds": s.seconds}
            for (a, o), s in sorted(self._ops.items())
        }

    def reset(self) -> None:
        """Forget every count."""
        self._ops.clear()
