"""The parameter server on Ray: servers and workers as actors, weights by object reference.

The same protocol, consistency models and records as :mod:`plait.ps.server`, decided by
the same transport-free :class:`~plait.ps.core.ServerCore` (read :mod:`plait.ps.core` for
the semantics), with Ray's object store as the transport:

- server s is an asyncio actor holding shard s of the flattened parameters and an
  optimizer over it. Each time its version changes (an optimizer step) it ``ray.put``\\ s
  the shard once and keeps the :class:`ray.ObjectRef`; replies carry that reference, never
  the weights, so every worker reading version v shares the one copy in the object store
  (:attr:`RayPSRun.puts` counts the puts per version: 1 each).
- worker w is an actor with its own model replica: it fetches the shards by reference
  (``ray.get``), computes the gradient of its loss, and pushes shard s of the gradient to
  server s (``push``); the call returns when the server replies: ``(version, [ref], go)``.
- ``sync``: a server applies the mean of a step's gradients (summed in worker order,
  like the torch.distributed version) once all workers pushed it; a push is answered
  when its step is applied (all but the last to arrive wait: counted in ``blocked``).
  ``bounded`` with staleness s: a push of step c is answered once steps ``<= c-s`` are
  applied. ``async``: each gradient is one optimizer step the moment it arrives; server
  0 grants each worker one more step per reply until ``steps x workers`` gradients.
  Every applied gradient is an :class:`~plait.ps.core.Applied` record.

A worker's waits are bounded by ``timeout_s``; a server or worker that dies makes the
run fail with its role and index named.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.errors import CommTimeoutError, PlaitError
from plait.ps.core import (
    LossFn,
    MakeOptimizer,
    PSConfig,
    PSResult,
    ServerCore,
    flat_grad,
    flat_params,
    load_shard,
    shard_bounds,
)


def _tensor(arr: Any) -> torch.Tensor:
    """A read-only array from the object store as a tensor, without a copy (only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.as_tensor(arr)


@dataclass
class RayPSRun:
    """What :func:`train_parameter_server_ray` reports."""

    servers: list[PSResult]
    """One result per server (records, steps per worker, withheld replies)."""
    workers: list[PSResult]
    """One result per worker (losses, steps, seconds waiting for replies)."""
    puts: list[dict[int, int]] = field(default_factory=list)
    """Per server: version -> ``ray.put`` calls that published it (1 each)."""


class ShardServer:
    """Server s: a :class:`~plait.ps.core.ServerCore` and its published reference."""

    def __init__(
        self,
        index: int,
        shard: torch.Tensor,
        make_optimizer: MakeOptimizer,
        cfg: PSConfig,
        workers: int,
    ) -> None:
        self.puts: dict[int, int] = {}
        self.ref: Any = None
        self.core = ServerCore(index, shard, make_optimizer, cfg, workers, self._publish)
        self._publish()
        self._withheld: dict[int, asyncio.Future[None]] = {}

    def _publish(self) -> None:
        """``ray.put`` the current shard once for this version."""
        import ray

        version = self.core.version
        self.puts[version] = self.puts.get(version, 0) + 1
        self.ref = ray.put(self.core.w.detach().numpy().copy())

    async def weights(self) -> tuple[int, list[Any]]:
        """(version, [reference to the shard of that version])."""
        return self.core.version, [self.ref]

    async def push(
        self, worker: int, step: int, read: int, grad: Any
    ) -> tuple[int, list[Any], bool]:
        """Worker ``worker``'s gradient shard of its step ``step`` (computed on version
        ``read``); returns when answered: (version, [reference], whether to go on)."""
        go = self.core.push(worker, step, read, _tensor(grad))  # (shard,)
        for w in self.core.release():
            self._withheld.pop(w).set_result(None)
        if go is None:  # too far ahead: answered when a later push releases it
            answered = asyncio.get_running_loop().create_future()
            self._withheld[worker] = answered
            await answered
            go = True
        return self.core.version, [self.ref], go

    async def result(self) -> tuple[PSResult, dict[int, int], Any]:
        """(records, puts per version, the final shard)."""
        return self.core.finish(), dict(self.puts), self.core.w.detach().clone()


class PSWorker:
    """Worker w: a model replica that pulls shards by reference and pushes gradients."""

    def __init__(
        self,
        index: int,
        make_model: Callable[[], nn.Module],
        loss_fn: LossFn,
        bounds: list[tuple[int, int]],
        servers: list[Any],
        timeout_s: float,
    ) -> None:
        torch.set_num_threads(1)
        self.index, self.loss_fn, self.bounds = index, loss_fn, bounds
        self.servers, self.timeout_s = servers, timeout_s
        self.model = make_model()

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return list(ray.get(refs, timeout=self.timeout_s))
        except GetTimeoutError:
            raise CommTimeoutError(
                len(self.servers) + self.index,
                "ps",
                what,
                self.timeout_s,
                f"parameter-server worker {self.index} got no reply from the servers",
            ) from None

    def run(self) -> PSResult:
        """Train until server 0 says stop; this worker's losses and waits."""
        params = flat_params(self.model)
        res = PSResult("worker", self.index, 0)
        t0 = time.perf_counter()
        replies = [
            (v, ref, True)
            for v, ref in self._get([s.weights.remote() for s in self.servers], "the initial pull")
        ]
        res.wait_s += time.perf_counter() - t0
        go, step = True, 0
        while go:
            shards = self._get([r[1][0] for r in replies], "a weights fetch")
            for (lo, hi), arr in zip(self.bounds, shards, strict=True):
                load_shard(params, _tensor(arr), lo, hi)
            read = [int(r[0]) for r in replies]  # versions of the weights read
            self.model.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model, self.index, step)
            loss.backward()
            grad = flat_grad(params)  # (numel,)
            res.losses.append(float(loss.detach()))
            t0 = time.perf_counter()
            replies = self._get(
                [
                    s.push.remote(self.index, step, read[i], grad[lo:hi].numpy())
                    for i, (s, (lo, hi)) in enumerate(zip(self.servers, self.bounds, strict=True))
                ],
                f"the push of step {step}",
            )
            res.wait_s += time.perf_counter() - t0
            step += 1
            go = bool(replies[0][2])  # server 0 decides whether this worker goes on
        res.steps = step
        return res


def train_parameter_server_ray(
    model: nn.Module,
    make_model: Callable[[], nn.Module],
    loss_fn: LossFn,
    make_optimizer: MakeOptimizer,
    config: PSConfig,
    workers: int,
    timeout_s: float = 300.0,
    cpus_per_actor: float = 1.0,
) -> RayPSRun:
    """Parameter-server training with ``config.servers`` server actors and ``workers``
    worker actors on the Ray instance this process is connected to.

    Servers take their initial shards from ``model``; each worker builds its replica
    with ``make_model`` (overwritten by the first pull). On return ``model`` holds the
    final weights. ``make_optimizer`` builds the optimizer of one flat shard (element-wise,
    e.g. SGD or AdamW with one group). Raises :class:`~plait.errors.PlaitError` naming a
    server or worker that died or failed.
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    config.validate(config.servers + workers)
    params = flat_params(model)
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (numel,)
    bounds = shard_bounds(flat.numel(), config.servers)
    server_cls: Any = ray.remote(ShardServer).options(num_cpus=cpus_per_actor)
    worker_cls: Any = ray.remote(PSWorker).options(num_cpus=cpus_per_actor)
    servers: list[Any] = [
        server_cls.remote(s, flat[lo:hi].clone(), make_optimizer, config, workers)
        for s, (lo, hi) in enumerate(bounds)
    ]
    actors: list[Any] = [
        worker_cls.remote(w, make_model, loss_fn, bounds, servers, timeout_s)
        for w in range(workers)
    ]
    try:
        runs = {a.run.remote(): f"worker {w}" for w, a in enumerate(actors)}
        done: list[PSResult] = []
        for ref, who in runs.items():
            try:
                done.append(ray.get(ref))
            except RayTaskError as e:
                raise PlaitError(f"parameter server on Ray: {who} failed: {e.cause}") from None
            except RayActorError:
                raise PlaitError(f"parameter server on Ray: {who} died") from None
        outs = ray.get([s.result.remote() for s in servers])
    finally:
        for a in [*actors, *servers]:
            ray.kill(a, no_restart=True)
    for (lo, hi), (_, _, shard) in zip(bounds, outs, strict=True):
        load_shard(params, shard, lo, hi)
    return RayPSRun([o[0] for o in outs], done, [o[1] for o in outs])
