"""The parameter server without a transport: its configuration, state, step and grants.

Both transports (:mod:`plait.ps.server` on plait's counted point-to-point messages,
:mod:`plait.ps.ray_server` on Ray actors) move messages and nothing else; what a server
does with a pushed gradient and when it answers is decided here, once.

Consistency (``version`` = optimizer steps a server has applied; the *staleness* of an
applied gradient = the server's version when applying it minus the version the worker
read; every applied gradient is recorded in :attr:`PSResult.records`):

- ``sync``: the server waits for the gradient of step c from every worker, applies
  their mean in one optimizer step, then answers all of them: the same update as data
  parallelism over the same global batch (staleness always 0).
- ``async``: each gradient is one optimizer step the moment it arrives (not divided by
  the number of workers) and is answered at once; workers never wait for each other.
  The run ends after ``steps x workers`` gradients in total: server 0 grants each
  worker one more step per reply until the budget is used, so fast workers do more.
- ``bounded`` with staleness s (stale synchronous parallel, Ho et al. 2013): gradients
  are aggregated per step as in ``sync``, but a worker may start step c+1 once steps
  ``<= c-s`` are applied (at most s steps ahead of the slowest); otherwise its reply
  is withheld (counted in :attr:`PSResult.blocked`) until they are. Staleness never
  exceeds s and ``s = 0`` is ``sync`` exactly.

The parameters are flattened into one vector (one dtype) and split into k balanced
contiguous shards (:func:`shard_bounds`); server s holds shard s and an optimizer over it
(:class:`ServerCore`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from plait.collectives.costs import block_start
from plait.errors import ConfigError

Mode = Literal["sync", "async", "bounded"]
MODES: tuple[str, ...] = ("sync", "async", "bounded")

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer of one flat shard (element-wise, e.g. SGD or AdamW, one group)."""

LossFn = Callable[[nn.Module, int, int], torch.Tensor]
"""``loss_fn(model, worker index, step)``: the scalar loss of that worker's batch."""


@dataclass(frozen=True)
class PSConfig:
    """How a parameter-server run is laid out and synchronised."""

    servers: int = 1
    """k: server ranks (axis indices 0..k-1), each owning one shard of the parameters."""
    mode: Mode = "sync"
    """Consistency model: 'sync', 'async' or 'bounded'."""
    staleness: int = 0
    """s for 'bounded': a worker runs at most s steps ahead of the slowest (>= 0)."""
    steps: int = 10
    """Steps per worker ('sync', 'bounded'); 'async' applies steps x workers gradients."""
    tag: int = 7
    """Message tag of the protocol."""

    def validate(self, world: int) -> None:
        """Raise :class:`ConfigError` when the run cannot work on ``world`` ranks."""
        if self.mode not in MODES:
            raise ConfigError(f"parameter server mode {self.mode!r} unknown; use one of {MODES}")
        if self.staleness < 0:
            raise ConfigError(f"staleness must be >= 0 (0 is synchronous), got {self.staleness}")
        if self.staleness and self.mode != "bounded":
            raise ConfigError(f"staleness={self.staleness} needs mode='bounded', not {self.mode!r}")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if world < 2:
            raise ConfigError(
                f"a parameter server needs at least 2 ranks (1 server and 1 worker), got "
                f"{world}; use --nproc 2 or more"
            )
        if not 1 <= self.servers < world:
            raise ConfigError(
                f"{self.servers} server(s) on {world} rank(s): need 1 <= servers < world so "
                f"at least one rank is a worker; use servers between 1 and {world - 1}"
            )


@dataclass(frozen=True)
class Applied:
    """One gradient a server applied."""

    worker: int
    """Worker index (0..W-1; the worker is axis index ``servers + worker``)."""
    step: int
    """The worker's step that produced the gradient."""
    read_version: int
    """The server version of the weights the gradient was computed on."""
    version: int
    """The server version the gradient was applied to (updates applied before it)."""

    @property
    def staleness(self) -> int:
        """Updates applied between the worker's read and this application."""
        return self.version - self.read_version


@dataclass
class PSResult:
    """What one server or worker reports after a parameter-server run."""

    role: Literal["server", "worker"]
    index: int
    """Server index or worker index."""
    steps: int
    """Server: optimizer steps applied. Worker: gradients pushed."""
    records: list[Applied] = field(default_factory=list)
    """Server: every applied gradient, in order."""
    worker_steps: list[int] = field(default_factory=list)
    """Server: gradients received from each worker."""
    blocked: list[int] = field(default_factory=list)
    """Server: replies withheld from each worker (it was too far ahead or, in 'sync',
    not the last to arrive)."""
    losses: list[float] = field(default_factory=list)
    """Worker: its loss at each of its steps."""
    wait_s: float = 0.0
    """Worker: seconds spent waiting for replies."""

    def max_staleness(self) -> int:
        """The largest staleness among :attr:`records` (0 without records)."""
        return max((a.staleness for a in self.records), default=0)

    def staleness_histogram(self) -> dict[int, int]:
        """Staleness -> number of applied gradients."""
        hist: dict[int, int] = {}
        for a in self.records:
            hist[a.staleness] = hist.get(a.staleness, 0) + 1
        return dict(sorted(hist.items()))


def flat_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``model``, checked to share one floating dtype."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("parameter server: the model has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not params[0].is_floating_point():
        raise ConfigError(
            f"parameter server: every trainable parameter must share one floating dtype, "
            f"got {sorted(str(d) for d in dtypes)}"
        )
    return params


def shard_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of ``k`` balanced contiguous shards of a ``numel`` vector."""
    return [(block_start(s, numel, k), block_start(s + 1, numel, k)) for s in range(k)]


def load_shard(params: list[nn.Parameter], flat: torch.Tensor, lo: int, hi: int) -> None:
    """Copy elements [lo, hi) of the flat parameter vector from ``flat`` (hi - lo,)."""
    off = 0
    with torch.no_grad():
        for p in params:
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                p.view(-1)[a - off : b - off].copy_(flat[a - lo : b - lo])
            off += p.numel()


def flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    """The gradients of ``params`` as one vector (numel,); zeros where there is none."""
    return torch.cat(
        [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
            for p in params
        ]
    )


class ServerCore:
    """One server's shard, optimizer and version, and the grant policy of its replies.

    The transport feeds it each pushed gradient (:meth:`push`) and sends the replies it
    decides: :meth:`push` answers the pushing worker now (whether it may go on) or
    withholds the answer; :meth:`release` then names the withheld workers whose answer
    may now go (each with ``go=True``). ``on_step`` runs after every optimizer step
    (the Ray server publishes the new shard there).
    """

    def __init__(
        self,
        index: int,
        shard: torch.Tensor,
        make_optimizer: MakeOptimizer,
        cfg: PSConfig,
        workers: int,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        self.cfg, self.workers, self.on_step = cfg, workers, on_step
        self.w = nn.Parameter(shard.clone())  # (shard,)
        self.opt = make_optimizer([self.w])
        self.version = 0
        self.granted = workers  # async: every worker may compute one gradient
        self.res = PSResult("server", index, 0)
        self.res.worker_steps = [0] * workers
        self.res.blocked = [0] * workers
        self.pending: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}
        """Step -> worker -> (gradient, version read): steps not yet complete."""
        self.withheld: list[tuple[int, int]] = []
        """(worker, its next step) whose reply waits for older steps, in push order."""

    def apply(self, grads: list[torch.Tensor], records: list[Applied]) -> None:
        """One optimizer step on the mean of ``grads`` (summed in the given order)."""
        acc = grads[0].clone()
        for gr in grads[1:]:
            acc += gr
        if len(grads) > 1:
            acc /= len(grads)
        self.w.grad = acc
        self.opt.step()
        self.w.grad = None
        self.res.records.extend(records)
        self.version += 1
        if self.on_step is not None:
            self.on_step()

    def go_on(self, next_step: int) -> bool:
        """Whether the worker whose push is answered may compute another gradient."""
        if self.cfg.mode != "async":
            return next_step < self.cfg.steps
        if self.granted < self.cfg.steps * self.workers:
            self.granted += 1
            return True
        return False

    def push(self, worker: int, step: int, read: int, grad: torch.Tensor) -> bool | None:
        """Take ``worker``'s gradient shard of its ``step`` (computed on version ``read``;
        copied when kept). Returns whether the worker may go on, to answer it now, or
        None when its answer is withheld (too far ahead; see :meth:`release`)."""
        self.res.worker_steps[worker] += 1
        if self.cfg.mode == "async":
            self.apply([grad], [Applied(worker, step, read, self.version)])
            return self.go_on(step + 1)
        self.pending.setdefault(step, {})[worker] = (grad.clone(), read)
        while len(self.pending.get(self.version, {})) == self.workers:  # a complete step
            got = self.pending.pop(self.version)
            order = sorted(got)  # sum in worker order: deterministic
            recs = [Applied(w, self.version, got[w][1], self.version) for w in order]
            self.apply([got[w][0] for w in order], recs)
        if step + 1 >= self.cfg.steps:
            return False
        if self.may_start(step + 1):
            return True
        self.res.blocked[worker] += 1
        self.withheld.append((worker, step + 1))
        return None

    def may_start(self, step: int) -> bool:
        """Whether a worker may compute ``step``: steps ``<= step-1-s`` are applied."""
        return self.version >= step - self.cfg.staleness

    def release(self) -> list[int]:
        """The withheld workers that may now go on (their answer is ``go=True``), in the
        order they were withheld; they are no longer withheld."""
        ready = [w for w, n in self.withheld if self.may_start(n)]
        self.withheld = [(w, n) for w, n in self.withheld if not self.may_start(n)]
        return ready

    def finish(self) -> PSResult:
        """This server's result, once every push was answered and applied."""
        if self.withheld or self.pending:
            raise RuntimeError(
                f"parameter server {self.res.index}: run ended with withheld replies "
                f"{self.withheld} and incomplete steps {sorted(self.pending)}"
            )
        self.res.steps = self.version
        return self.res
