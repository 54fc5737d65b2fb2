"""Parameter-server training on plait's counted point-to-point messages.

Ranks ``0..k-1`` of the group are servers, the others workers (Li et al. 2014, "Scaling
Distributed Machine Learning with the Parameter Server"). The parameters are flattened
into one vector (one dtype) and split into k balanced contiguous shards; server s holds
shard s and an optimizer over it. A worker computes the gradient of its loss on the
weights it last received, pushes each shard of the gradient to its server and gets
back, as the reply, that server's current shard.

The consistency models (``sync``, ``async``, ``bounded`` staleness), the optimizer step
and the decision of when to answer a push live in the transport-free
:class:`~plait.ps.core.ServerCore` (read :mod:`plait.ps.core` for the semantics); this
module carries its messages.

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

import torch
from torch import nn

from plait.comm import ops
from plait.comm.group import AxisGroup, Handle
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

_HDR = 32  # bytes: int64 [kind, step or version, read version or go flag, spare]
_PUSH, _WEIGHTS = 1, 2


def _message(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A uint8 buffer of header + n elements, with its int64 header and payload views."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(_HDR + n * itemsize, dtype=torch.uint8)
    return buf, buf[:_HDR].view(torch.int64), buf[_HDR:].view(dtype)


def train_parameter_server(
    model: nn.Module,
    group: AxisGroup,
    loss_fn: LossFn,
    make_optimizer: MakeOptimizer,
    config: PSConfig,
) -> PSResult:
    """Run parameter-server training on every rank of ``group`` (SPMD: all call it).

    Servers take their initial shard from their own ``model``; workers' models are
    overwritten by the servers' weights first. ``make_optimizer`` builds the optimizer
    of one flat shard (so it must be element-wise, e.g. SGD or AdamW with one group).
    On return every rank's ``model`` holds the final weights. Buffers are not synced.
    """
    config.validate(group.size)
    params = flat_params(model)
    numel = sum(p.numel() for p in params)
    bounds = shard_bounds(numel, config.servers)
    if group.index < config.servers:
        result = _serve(params, group, make_optimizer, config, bounds)
    else:
        result = _work(model, params, group, loss_fn, config, bounds)
    _broadcast_final(params, group, bounds)
    return result


def _broadcast_final(
    params: list[nn.Parameter], g: AxisGroup, bounds: list[tuple[int, int]]
) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (numel,)
    for s, (lo, hi) in enumerate(bounds):
        shard = flat[lo:hi].clone()
        ops.broadcast(shard, g, src=s)
        load_shard(params, shard, lo, hi)


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
            load_shard(params, inc[s][2], lo, hi)
        read = [int(inc[s][1][1]) for s in range(k)]  # versions of the weights read
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, me, step)
        loss.backward()
        grad = flat_grad(params)  # (numel,)
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


class _Replies:
    """A server's reply buffers and the send in flight to each worker."""

    def __init__(self, core: ServerCore, g: AxisGroup, cfg: PSConfig) -> None:
        self.core, self.g, self.cfg = core, g, cfg
        shard = core.w.detach()
        self.bufs = [_message(shard.numel(), shard.dtype) for _ in range(core.workers)]
        self.handles: list[Handle | None] = [None] * core.workers

    def send(self, worker: int, go: bool) -> None:
        """Send the current shard to ``worker`` (its previous reply has arrived: the
        worker received it before pushing again)."""
        h = self.handles[worker]
        if h is not None:
            h.wait()
        buf, hdr, payload = self.bufs[worker]
        hdr.copy_(torch.tensor([_WEIGHTS, self.core.version, int(go), 0]))
        payload.copy_(self.core.w.detach())
        self.handles[worker] = ops.isend(buf, self.g, self.cfg.servers + worker, tag=self.cfg.tag)

    def wait(self) -> None:
        """Wait for every reply in flight."""
        for h in self.handles:
            if h is not None:
                h.wait()


def _serve(
    params: list[nn.Parameter],
    g: AxisGroup,
    make_optimizer: MakeOptimizer,
    cfg: PSConfig,
    bounds: list[tuple[int, int]],
) -> PSResult:
    lo, hi = bounds[g.index]
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (numel,)
    core = ServerCore(g.index, flat[lo:hi], make_optimizer, cfg, g.size - cfg.servers)
    replies = _Replies(core, g, cfg)
    for w in range(core.workers):
        replies.send(w, True)  # initial weights, version 0
    inbuf, hdr, payload = _message(hi - lo, flat.dtype)
    for _ in range(cfg.steps * core.workers):  # gradients in the whole run, in every mode
        src = ops.recv_any(inbuf, g, tag=cfg.tag)
        worker = src - cfg.servers
        kind, step, read = (int(v) for v in hdr[:3])
        if kind != _PUSH or not 0 <= worker < core.workers:
            raise RuntimeError(f"parameter server {g.index}: unexpected message from {src}")
        go = core.push(worker, step, read, payload)
        if go is not None:
            replies.send(worker, go)
        for w in core.release():
            replies.send(w, True)
    replies.wait()
    load_shard(params, core.w.detach(), lo, hi)
    return core.finish()
