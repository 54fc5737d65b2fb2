"""Process groups: joining the world, one group per mesh axis, and error translation.

This module and :mod:`plait.comm.ops` are the only places in plait that call
``torch.distributed``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.comm.stats import CommStats
from plait.errors import CommError, CommTimeoutError

_TIMEOUT_MARKERS = ("timed out", "timeout")


def init_world(
    backend: str,
    rank: int,
    world_size: int,
    init_method: str = "env://",
    timeout_s: float = 300.0,
) -> None:
    """Join the default process group (the world). ``env://`` reads torchrun's variables."""
    if dist.is_initialized():
        raise CommError("the process group is already initialised in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method == "env://" and attempt is not None:
        # A job restarted by the elastic agent meets in the agent's store again, where the
        # previous attempt's addresses are still published (gloo then connects to dead
        # ranks: "connection refused"); keys under a per-attempt prefix avoid them.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=rank == 0 and not agent_store,
            timeout=timeout,
        )
        prefixed = dist.PrefixStore(f"plait/attempt{attempt}/", store)
        dist.init_process_group(
            backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
        )
        return
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (and any ``env://`` launcher: Slurm with torchrun, Ray Train, ...) sets
for each process it starts."""


def launched_world() -> tuple[int, int] | None:
    """``(rank, world size)`` that a launcher gave this process, or None when it was not
    started by one (the launcher's variables are the world's description, as
    ``torch.distributed.device_mesh.init_device_mesh`` reads them too)."""
    if not all(os.environ.get(k) for k in LAUNCHER_VARIABLES):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_launched_world(device_type: str, timeout_s: float = 300.0) -> bool:
    """Join the launcher's world when there is one and no process group exists yet:
    NCCL on CUDA, gloo otherwise. Returns whether it joined (and then leaves the world
    at exit). Without a launcher, or with a group already joined, it does nothing."""
    if world_initialized():
        return False
    launched = launched_world()
    if launched is None:
        return False
    rank, size = launched
    backend = "nccl" if device_type == "cuda" else "gloo"
    init_world(backend, rank, size, "env://", timeout_s=timeout_s)
    atexit.register(destroy_world)
    return True


def init_method_tcp(host: str, port: int) -> str:
    """The ``init_method`` of a world that meets at rank 0's ``host:port`` (the workers'
    own addresses, e.g. Ray actors), instead of torchrun's ``env://`` variables."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def world_initialized() -> bool:
    """Whether this process has joined a world."""
    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    """This process's rank in the world (0 without a world)."""
    return dist.get_rank() if world_initialized() else 0


def world_size() -> int:
    """The number of ranks in the world (1 without a world)."""
    return dist.get_world_size() if world_initialized() else 1


def world_backend() -> str:
    """The backend of the world group ('gloo', 'nccl'; 'none' without a world)."""
    return str(dist.get_backend()) if world_initialized() else "none"


def destroy_world() -> None:
    """Leave the world (no-op without one)."""
    if world_initialized():
        dist.destroy_process_group()


@dataclass
class AxisGroup:
    """The ranks along one mesh axis (or a combination of axes) that contain this rank.

    ``ranks`` are global ranks in axis order; peers are addressed by their index in it
    (the coordinate along the axis). A group of one rank has no process group and every
    operation on it is a counted no-op.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    timeout_s: float
    stats: CommStats = field(repr=False)
    pg: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's position in the group (its coordinate along the axis)."""
        return self.ranks.index(self.rank)

    def global_rank(self, index: int) -> int:
        """Global rank of the group member at ``index``."""
        if not 0 <= index < self.size:
            raise ValueError(f"peer index {index} outside axis '{self.name}' of size {self.size}")
        return self.ranks[index]

    @contextlib.contextmanager
    def guard(self, op: str) -> Iterator[None]:
        """Turn backend failures inside the block into errors naming rank, axis and op."""
        try:
            yield
        except (CommTimeoutError, CommError):
            raise
        except RuntimeError as e:  # gloo/NCCL report everything as RuntimeError subclasses
            raise translate_error(e, self, op) from e


def translate_error(e: BaseException, group: AxisGroup, op: str) -> Exception:
    """Map a backend error to :class:`CommTimeoutError` or :class:`CommError`."""
    text = str(e)
    if any(m in text.lower() for m in _TIMEOUT_MARKERS):
        return CommTimeoutError(group.rank, group.name, op, group.timeout_s, text.strip()[:200])
    return CommError(
        f"rank {group.rank}: {op} on mesh axis '{group.name}' failed: {text.strip()[:300]} "
        "(a peer rank probably exited)"
    )


def new_axis_group(
    name: str, members: Sequence[int], rank: int, timeout_s: float, stats: CommStats
) -> AxisGroup:
    """Build the :class:`AxisGroup` for ``members`` (global ranks) containing ``rank``.

    Only the members call this (local synchronisation), so different groups of the same
    axis can be created by their own members independently.
    """
    ranks = tuple(members)
    pg = None
    if len(ranks) > 1:
        if not world_initialized():
            raise CommError(f"axis '{name}' spans {len(ranks)} ranks but no world is initialised")
        pg = dist.new_group(
            list(ranks),
            timeout=datetime.timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
    return AxisGroup(name=name, ranks=ranks, rank=rank, timeout_s=timeout_s, stats=stats, pg=pg)


class Handle:
    """An asynchronous operation in flight; :meth:`wait` blocks, counts the time and
    translates errors. ``then`` runs after completion (e.g. averaging)."""

    def __init__(
        self,
        work: dist.Work | None,
        group: AxisGroup,
        op: str,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._group = group
        self._op = op
        self._then = then
        self._done = False

    def wait(self) -> None:
        """Block until the operation completes (at most the group timeout)."""
        if self._done:
            return
        t0 = time.perf_counter()
        if self._work is not None:
            with self._group.guard(self._op):
                self._work.wait()
        if self._then is not None:
            self._then()
        self._done = True
        self._group.stats.add_seconds(self._group.name, self._op, time.perf_counter() - t0)

    def is_completed(self) -> bool:
        """Whether the operation finished (without blocking)."""
        return self._done or self._work is None or bool(self._work.is_completed())


def tensor_bytes(t: torch.Tensor) -> int:
    """Size of a tensor's data in bytes."""
    return t.numel() * t.element_size()
