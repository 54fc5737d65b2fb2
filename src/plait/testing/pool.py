"""A pool of persistent worker processes that share a gloo world, for tests and benchmarks.

Starting fresh processes costs seconds per world (3-8 s for 2-8 ranks on a 2-core
machine); a pool starts its W workers once (forked from a forkserver that has already
imported torch and plait), joins them in one gloo world, then runs any number of *bodies*
on every rank: a body is a module-level function (or its address
``"package.module:function"``), called on each rank as ``fn(ctx, *args, **kwargs)`` with
a :class:`WorkerContext`. :meth:`WorkerPool.run` returns the per-rank results (picklable)
in rank order, or raises :class:`WorkerError` carrying every failing rank's traceback.
Nothing waits forever: a run that exceeds its time limit kills the pool (it restarts on
the next run) and names the silent ranks.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plait.mesh import Mesh, init_mesh

_PRELOAD = ["torch", "numpy", "plait", "plait.comm", "plait.mesh"]
"""Modules the forkserver imports once (plait.comm brings torch.distributed)."""


class WorkerError(RuntimeError):
    """One or more ranks failed a body; the message holds each rank's traceback."""

    def __init__(self, body: str, failures: dict[int, str]) -> None:
        self.failures = failures
        parts = [f"{body} failed on rank(s) {sorted(failures)}:"]
        for r, tb in sorted(failures.items()):
            parts.append(f"--- rank {r} ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


@dataclass
class WorkerContext:
    """What a body receives on each rank: its rank, the world size and cached meshes."""

    rank: int
    world_size: int
    comm_timeout_s: float
    _meshes: dict[tuple[Any, ...], Mesh] = field(default_factory=dict, repr=False)

    def mesh(
        self,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        timeout_s: float | None = None,
    ) -> Mesh:
        """A mesh over the pool's world, created once per layout and reused by later bodies.

        Its counters are reset at the start of every body.
        """
        t = self.comm_timeout_s if timeout_s is None else timeout_s
        key = (dp, tp, pp, cp, t)
        m = self._meshes.get(key)
        if m is None:
            m = init_mesh(dp=dp, tp=tp, pp=pp, cp=cp, timeout_s=t)
            self._meshes[key] = m
        return m

    def reset_stats(self) -> None:
        """Zero the counters of every cached mesh."""
        for m in self._meshes.values():
            m.stats.reset()


def body_address(body: str | Callable[..., Any]) -> str:
    """The ``"package.module:function"`` address of a body given as that string or as a
    module-level function (the workers import it by that address).

    Raises:
        TypeError: ``body`` is a lambda, a closure, a nested function, a method, a
            ``functools.partial`` or any other object the workers cannot import by name,
            or it is defined in ``__main__``.
    """
    if isinstance(body, str):
        return body
    qualname = getattr(body, "__qualname__", None)
    module = getattr(body, "__module__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(
            f"a pool body must be a module-level function or a 'package.module:function' "
            f"string (the workers import it by name), got {body!r}"
        )
    if "<" in qualname or "." in qualname:  # <lambda>, f.<locals>.g, Class.method
        raise TypeError(
            f"a pool body must be a module-level function (the workers import it by name), "
            f"got {qualname} from {module}; define it at the top level of its module"
        )
    if module == "__main__":
        raise TypeError(
            f"{qualname} is defined in __main__, which the workers cannot import; "
            "define it in an importable module"
        )
    found = getattr(sys.modules.get(module), qualname, None)
    if found is not None and found is not body:
        raise TypeError(
            f"{module}.{qualname} is not the function given (was it decorated or "
            "rebound?); the workers would run the module's attribute instead"
        )
    return f"{module}:{qualname}"


def _resolve(body: str) -> Callable[..., Any]:
    module, _, name = body.partition(":")
    if not name:
        raise ValueError(f"body must be 'package.module:function', got {body!r}")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{body} is not callable")
    return fn


def _worker_main(
    rank: int, world_size: int, init_method: str, comm_timeout_s: float, conn: mpc.Connection
) -> None:
    import torch

    from plait import comm

    torch.set_num_threads(1)
    comm.init_world("gloo", rank, world_size, init_method, timeout_s=comm_timeout_s)
    ctx = WorkerContext(rank=rank, world_size=world_size, comm_timeout_s=comm_timeout_s)
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        body, args, kwargs = msg
        ctx.reset_stats()
        try:
            result = _resolve(body)(ctx, *args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # report everything, the parent decides
            conn.send(("err", traceback.format_exc()))
    comm.destroy_world()
    conn.close()
    os._exit(0)  # avoids gloo's occasional abort at interpreter exit


class WorkerPool:
    """``world_size`` persistent ranks in one gloo world."""

    def __init__(
        self, world_size: int, comm_timeout_s: float = 60.0, start_timeout_s: float = 120.0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.comm_timeout_s = comm_timeout_s
        self.start_timeout_s = start_timeout_s
        self._procs: list[Any] = []
        self._conns: list[mpc.Connection] = []
        self._tmp: str | None = None

    @property
    def started(self) -> bool:
        """Whether the workers are running."""
        return bool(self._procs)

    def start(self) -> None:
        """Start the workers and wait until every rank has joined the world."""
        if self.started:
            return
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self._tmp = tempfile.mkdtemp(prefix="plait-pool-")
        init_method = f"file://{os.path.join(self._tmp, 'store')}"
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_method, self.comm_timeout_s, child),
                daemon=True,
                name=f"plait-pool-rank{rank}",
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect("start-up", self.start_timeout_s)

    def run(
        self,
        body: str | Callable[..., Any],
        *args: Any,
        timeout_s: float = 120.0,
        restart_after: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``body`` on every rank; return the results in rank order.

        ``body`` is a module-level function or its ``"package.module:function"``
        address; it is called as ``body(ctx, *args, **kwargs)`` on each rank (a
        function is sent as its ``"module:qualname"`` address, which every worker
        imports). ``restart_after`` discards the workers afterwards (for bodies that
        leave the process group broken on purpose, such as timeout tests).

        Raises:
            TypeError: ``body`` is a lambda, closure, nested function or method (see
                :func:`body_address`); raised before any rank runs.
            WorkerError: the body raised on one or more ranks (their tracebacks).
            TimeoutError: some rank gave no result within ``timeout_s``.
        """
        address = body_address(body)
        self.start()
        for c in self._conns:
            c.send((address, args, kwargs))
        try:
            results = self._collect(address, timeout_s)
        finally:
            if restart_after:
                self.close()
        return results

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        pending: dict[Any, int] = {c: r for r, c in enumerate(self._conns)}
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = mpc.wait(list(pending), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                silent = sorted(pending.values())
                self.close()
                raise TimeoutError(
                    f"{what}: rank(s) {silent} gave no result within {timeout_s:g} s; "
                    "the pool was stopped and restarts on the next run"
                )
            for c in ready:
                r = pending.pop(c)
                try:
                    kind, value = self._conns[r].recv()
                except EOFError:
                    code = self._procs[r].exitcode
                    failures[r] = f"worker process exited (exit code {code})"
                    continue
                if kind == "err":
                    failures[r] = str(value)
                else:
                    results[r] = value
        if failures:
            self.close()  # a failed body can leave the group unusable: start afresh
            raise WorkerError(what, failures)
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the store."""
        for c in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(None)
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
