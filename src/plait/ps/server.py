"""Parameter-server training on plait's counted point-to-point messages.

Ranks ``0..k-1`` of the group are servers, the others workers (Li et al. 2014, "Scaling
Distributed Machine Learning with the Parameter Server"). The parameters are flattened
into one vector (one dtype) and split into k balanced contiguous shards; server s holds
shard s and an optimizer over it. A worker computes the gradient of its loss on the
weights it last received, pushes each shard of the gradient to its server and gets
back, as the reply, that server's current shard.

Consistency (``version`` = optimizer steps a server has applied; the *staleness* of an
applied gradient = the server's version when applying it minus the version the worker
read; every applied gradient is recorded in :attr:`PSResult.records`):

- ``sync``: the server waits for the gradient of step c from every worker, applies
  their mean in one optimizer step, then replies to all: the same update as data
  parallelism over the same global batch (staleness always 0).
- ``async``: each gradient is one optimizer step the moment it arrives (not divided by
  the number of workers) and the reply goes straight back; workers never wait for each
  other. The run ends after ``steps x workers`` gradients in total: server 0 grants
  each worker one more step per reply until the budget is used, so fast workers do more.
- ``bounded`` with staleness s (stale synchronous parallel, Ho et al. 2013): gradients
  are aggregated per step as in ``sync``, but a worker may start step c+1 once steps
  ``<= c-s`` are applied (at most s steps ahead of the slowest); otherwise its reply
  is withheld (counted in :attr:`PSResult.blocked`). Staleness never exceeds s and
  ``s = 0`` is ``sync`` exactly.

Deadlock-freedom: each worker has at most one message in flight to each server and
posts the receive of the reply before sending; servers never block on a send (replies
are ``isend``) and block only in :func:`plait.comm.recv_any`, which any push satisfies.
A withheld reply waits only for gradients of earlier steps, which workers that are not
waiting (computing, or themselves further behind) will push. All messages use one tag;
between a worker and a server they alternate push/reply, so FIFO matching pairs them,
and every message to server s has the same size (required by any-source receives).
Every wait is bounded by the group timeout. At the end the servers broadcast their
shards, so every rank's model holds the final weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from plait.collectives.costs import block_start
from plait.comm import ops
from plait.comm.group import AxisGroup, Handle
from plait.errors import ConfigError

Mode = Literal["sync", "async", "bounded"]
MODES: tuple[str, ...] = ("sync", "async", "bounded")
_HDR = 32  # bytes: int64 [kind, step or version, read version or go flag, spare]
_PUSH, _WEIGHTS = 1, 2


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
    """What one rank reports after :func:`train_parameter_server`."""

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


LossFn = Callable[[nn.Module, int, int], torch.Tensor]
"""``loss_fn(model, worker index, step)``: the scalar loss of that worker's batch."""


def _flat_params(model: nn.Module) -> list[nn.Parameter]:
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


def _bounds(numel: int, k: int) -> list[tuple[int, int]]:
    return [(block_start(s, numel, k), block_start(s + 1, numel, k)) for s in range(k)]


def _message(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A uint8 buffer of header + n elements, with its int64 header and payload views."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(_HDR + n * itemsize, dtype=torch.uint8)
    return buf, buf[:_HDR].view(torch.int64), buf[_HDR:].view(dtype)


def train_parameter_server(
    model: nn.Module,
    group: AxisGroup,
    loss_fn: LossFn,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    config: PSConfig,
) -> PSResult:
    """Run parameter-server training on every rank of ``group`` (SPMD: all call it).

    Servers take their initial shard from their own ``model``; workers' models are
    overwritten by the servers' weights first. ``make_optimizer`` builds the optimizer
    of one flat shard (so it must be element-wise, e.g. SGD or AdamW with one group).
    On return every rank's ``model`` holds the final weights. Buffers are not synced.
    """
    config.validate(group.size)
    params = _flat_params(model)
    numel = sum(p.numel() for p in params)
    bounds = _bounds(numel, config.servers)
    if group.index < config.servers:
        result = _serve(params, group, make_optimizer, config, bounds)
    else:
        result = _work(model, params, group, loss_fn, config, bounds)
    _broadcast_final(params, group, bounds, result)
    return result


def _load(params: list[nn.Parameter], flat: torch.Tensor, lo: int, hi: int) -> None:
    """Copy elements [lo, hi) of the flat parameter vector from ``flat`` (hi - lo,)."""
    off = 0
    with torch.no_grad():
        for p in params:
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                p.view(-1)[a - off : b - off].copy_(flat[a - lo : b - lo])
            off += p.numel()


def _broadcast_final(
    params: list[nn.Parameter], g: AxisGroup, bounds: list[tuple[int, int]], res: PSResult
) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (numel,)
    for s, (lo, hi) in enumerate(bounds):
        shard = flat[lo:hi].clone()
        ops.broadcast(shard, g, src=s)
        _load(params, shard, lo, hi)


def _work(
    model: nn.Module,
    params: list[nn.Parameter],
    g: AxisGroup,
    loss_fn: LossFn,
    cfg: PSConfig,
    bounds: list[tuple[int, int]],
) -> PSResult:
    k, dtype = cfg.servers, params[0].dtype
    me = g.index - k
    out = [_message(hi - lo, dtype) for lo, hi in bounds]
    inc = [_message(hi - lo, dtype) for lo, hi in bounds]
    res = PSResult("worker", me, 0)
    t0 = time.perf_counter()
    hs = [ops.irecv(inc[s][0], g, s, tag=cfg.tag) for s in range(k)]  # initial weights
    for h in hs:
        h.wait()
    res.wait_s += time.perf_counter() - t0
    go, step = True, 0
    while go:
        for s, (lo, hi) in enumerate(bounds):
            _load(params, inc[s][2], lo, hi)
        read = [int(inc[s][1][1]) for s in range(k)]  # versions of the weights read
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, me, step)
        loss.backward()
        grad = torch.cat(  # (numel,)
            [
                p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                for p in params
            ]
        )
        res.losses.append(float(loss.detach()))
        for s, (lo, hi) in enumerate(bounds):
            out[s][1].copy_(torch.tensor([_PUSH, step, read[s], 0]))
            out[s][2].copy_(grad[lo:hi])
        recvs = [ops.irecv(inc[s][0], g, s, tag=cfg.tag) for s in range(k)]  # reply first
        sends = [ops.isend(out[s][0], g, s, tag=cfg.tag) for s in range(k)]
        t0 = time.perf_counter()
        for h in sends + recvs:
            h.wait()
        res.wait_s += time.perf_counter() - t0
        step += 1
        go = bool(int(inc[0][1][2]))  # server 0 decides whether this worker goes on
    res.steps = step
    return res


class _Server:
    """State of one server: its shard, optimizer, version and reply buffers."""

    def __init__(
        self,
        shard: torch.Tensor,
        g: AxisGroup,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        cfg: PSConfig,
    ) -> None:
        self.g, self.cfg = g, cfg
        self.workers = g.size - cfg.servers
        self.w = nn.Parameter(shard.clone())  # (shard,)
        self.opt = make_optimizer([self.w])
        self.version = 0
        self.granted = self.workers  # async: every worker may compute one gradient
        self.replies = [_message(shard.numel(), shard.dtype) for _ in range(self.workers)]
        self.handles: list[Handle | None] = [None] * self.workers
        self.res = PSResult("server", g.index, 0)
        self.res.worker_steps = [0] * self.workers
        self.res.blocked = [0] * self.workers

    def reply(self, worker: int, go: bool) -> None:
        """Send the current shard to ``worker`` (its previous reply has arrived: the
        worker received it before pushing again)."""
        h = self.handles[worker]
        if h is not None:
            h.wait()
        buf, hdr, payload = self.replies[worker]
        hdr.copy_(torch.tensor([_WEIGHTS, self.version, int(go), 0]))
        payload.copy_(self.w.detach())
        self.handles[worker] = ops.isend(buf, self.g, self.cfg.servers + worker, tag=self.cfg.tag)

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

    def go_on(self, next_step: int) -> bool:
        """Whether the worker whose push is answered may compute another gradient."""
        if self.cfg.mode != "async":
            return next_step < self.cfg.steps
        if self.granted < self.cfg.steps * self.workers:
            self.granted += 1
            return True
        return False


def _serve(
    params: list[nn.Parameter],
    g: AxisGroup,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    cfg: PSConfig,
    bounds: list[tuple[int, int]],
) -> PSResult:
    lo, hi = bounds[g.index]
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (numel,)
    sv = _Server(flat[lo:hi], g, make_optimizer, cfg)
    for w in range(sv.workers):
        sv.reply(w, True)  # initial weights, version 0
    inbuf, hdr, payload = _message(hi - lo, flat.dtype)
    expected = cfg.steps * sv.workers  # gradients in the whole run, in every mode
    s = cfg.staleness
    pending: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}  # step -> worker -> (grad, read)
    withheld: list[tuple[int, int]] = []  # (worker, next step) awaiting older steps
    for _ in range(expected):
        src = ops.recv_any(inbuf, g, tag=cfg.tag)
        worker = src - cfg.servers
        kind, step, read = (int(v) for v in hdr[:3])
        if kind != _PUSH or not 0 <= worker < sv.workers:
            raise RuntimeError(f"parameter server {g.index}: unexpected message from {src}")
        sv.res.worker_steps[worker] += 1
        if cfg.mode == "async":
            sv.apply([payload], [Applied(worker, step, read, sv.version)])
            sv.reply(worker, sv.go_on(step + 1))
            continue
        pending.setdefault(step, {})[worker] = (payload.clone(), read)
        while len(pending.get(sv.version, {})) == sv.workers:  # a complete step
            got = pending.pop(sv.version)
            order = sorted(got)  # sum in worker order: deterministic
            recs = [Applied(w, sv.version, got[w][1], sv.version) for w in order]
            sv.apply([got[w][0] for w in order], recs)
        if step + 1 >= cfg.steps:
            sv.reply(worker, False)
        elif sv.version >= step + 1 - s:
            sv.reply(worker, True)
        else:
            sv.res.blocked[worker] += 1
            withheld.append((worker, step + 1))
        ready = [(w, n) for w, n in withheld if sv.version >= n - s]
        withheld = [(w, n) for w, n in withheld if sv.version < n - s]
        for w, _n in ready:
            sv.reply(w, True)
    for h in sv.handles:
        if h is not None:
            h.wait()
    assert not withheld and not pending, "every push was answered and applied"
    sv.res.steps = sv.version
    _load(params, sv.w.detach(), lo, hi)
    return sv.res
