"""Counted collectives and point-to-point operations on a mesh axis.

Every function takes an :class:`~plait.comm.group.AxisGroup` (``mesh.axis("dp")``);
peers are addressed by their index along the axis. Every call is recorded in the
group's :class:`~plait.comm.stats.CommStats` with the bus bytes of the convention in
:mod:`plait.comm.stats`. Reductions support ``"sum"``, ``"avg"``, ``"max"``, ``"min"``
and ``"product"``; ``"avg"`` is a sum divided by the group size (gloo has no AVG).
A group of one rank is the degenerate case: the result is what the collective would
return for one rank, and nothing is sent.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from plait.comm.group import AxisGroup, Handle, tensor_bytes
from plait.comm.stats import bus_bytes

ReduceOp = Literal["sum", "avg", "max", "min", "product"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# torch >= 2.13 names the single-tensor all-gather / reduce-scatter *_single and warns on
# the older *_tensor names (kept for the older torch versions the package range allows).
_all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
_reduce_scatter_single: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


def _reduce_op(op: str) -> dist.ReduceOp.RedOpType:
    if op not in _OPS:  # validated before calling: an unsupported op can break a gloo group
        raise ValueError(f"unknown reduction {op!r}; use one of {sorted(_OPS)}")
    return _OPS[op]


def _count(g: AxisGroup, op: str, nbytes: int, seconds: float = 0.0) -> None:
    g.stats.record(g.name, op, bus_bytes(op, nbytes, g.size), seconds)


def _run(
    g: AxisGroup, op: str, nbytes: int, fn: object, async_op: bool, then: object = None
) -> Handle | None:
    """Call ``fn(async_op)`` under the error guard, count it, and return a handle if async.
    Under a profiler the call is labelled ``plait.comm.<op>.<axis>`` (see docs/gpu.md)."""
    t0 = time.perf_counter()
    label = (
        torch.autograd.profiler.record_function(f"plait.comm.{op}.{g.name}")
        if torch.autograd._profiler_enabled()
        else contextlib.nullcontext()
    )
    with label, g.guard(op):
        work = fn(async_op)  # type: ignore[operator]
    if async_op:
        _count(g, op, nbytes)
        return Handle(work, g, op, then)  # type: ignore[arg-type]
    if then is not None:
        then()  # type: ignore[operator]
    _count(g, op, nbytes, time.perf_counter() - t0)
    return None


def _divide(t: torch.Tensor, n: int) -> object:
    def then() -> None:
        t.div_(n)

    return then


# ---------------------------------------------------------------- collectives


def all_reduce(
    t: torch.Tensor, g: AxisGroup, op: ReduceOp = "sum", async_op: bool = False
) -> Handle | None:
    """In place: every rank ends with the reduction of all ranks' ``t`` (AllReduce)."""
    rop = _reduce_op(op)
    then = _divide(t, g.size) if op == "avg" and g.size > 1 else None
    if g.pg is None:
        return _run(g, "all_reduce", tensor_bytes(t), lambda a: None, async_op)
    return _run(
        g,
        "all_reduce",
        tensor_bytes(t),
        lambda a: dist.all_reduce(t, op=rop, group=g.pg, async_op=a),
        async_op,
        then,
    )


def all_gather(
    t: torch.Tensor, g: AxisGroup, async_op: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, Handle]:
    """Concatenate every rank's ``t`` along dim 0, in axis order (AllGather).

    ``out`` (optional): a contiguous ``(size · len(t), ...)`` tensor to gather into; ``t``
    may be this rank's own chunk of it (an in-place gather: no copy in or out).
    Returns the output, or ``(output, handle)`` when ``async_op``.
    """
    t = t.contiguous()
    shape = (g.size * t.shape[0], *t.shape[1:])
    if out is not None and (
        tuple(out.shape) != shape or not out.is_contiguous() or out.dtype != t.dtype
    ):
        raise ValueError(
            f"all_gather on axis '{g.name}': out must be a contiguous {t.dtype} tensor of "
            f"shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    res = out if out is not None else torch.empty(shape, dtype=t.dtype, device=t.device)
    if g.pg is None:
        if res.data_ptr() != t.data_ptr():
            res.copy_(t)
        h = _run(g, "all_gather", tensor_bytes(res), lambda a: None, async_op)
    else:
        h = _run(
            g,
            "all_gather",
            tensor_bytes(res),
            lambda a: _all_gather_single(res, t, group=g.pg, async_op=a),
            async_op,
        )
    return (res, h) if h is not None else res


def reduce_scatter(
    t: torch.Tensor, g: AxisGroup, op: ReduceOp = "sum", async_op: bool = False
) -> torch.Tensor | tuple[torch.Tensor, Handle]:
    """Reduce ``t`` over the group and keep chunk ``index`` of dim 0 (ReduceScatter).

    ``t.shape[0]`` must be divisible by the group size.
    """
    if t.shape[0] % g.size:
        raise ValueError(
            f"reduce_scatter on axis '{g.name}': dim 0 ({t.shape[0]}) is not divisible by "
            f"the group size {g.size}"
        )
    rop = _reduce_op(op)
    t = t.contiguous()
    out = torch.empty((t.shape[0] // g.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    then = _divide(out, g.size) if op == "avg" and g.size > 1 else None
    if g.pg is None:
        out.copy_(t)
        h = _run(g, "reduce_scatter", tensor_bytes(t), lambda a: None, async_op)
    else:
        h = _run(
            g,
            "reduce_scatter",
            tensor_bytes(t),
            lambda a: _reduce_scatter_single(out, t, op=rop, group=g.pg, async_op=a),
            async_op,
            then,
        )
    return (out, h) if h is not None else out


def all_to_all(
    t: torch.Tensor, g: AxisGroup, async_op: bool = False
) -> torch.Tensor | tuple[torch.Tensor, Handle]:
    """Chunk ``i`` of dim 0 goes to rank ``i``; the output stacks the chunks received
    from every rank in axis order (AllToAll). ``t.shape[0]`` must divide evenly."""
    if t.shape[0] % g.size:
        raise ValueError(
            f"all_to_all on axis '{g.name}': dim 0 ({t.shape[0]}) is not divisible by "
            f"the group size {g.size}"
        )
    t = t.contiguous()
    out = torch.empty_like(t)
    if g.pg is None:
        out.copy_(t)
        h = _run(g, "all_to_all", tensor_bytes(t), lambda a: None, async_op)
    else:
        h = _run(
            g,
            "all_to_all",
            tensor_bytes(t),
            lambda a: dist.all_to_all_single(out, t, group=g.pg, async_op=a),
            async_op,
        )
    return (out, h) if h is not None else out


def all_to_all_v(
    t: torch.Tensor, g: AxisGroup, send_splits: Sequence[int], recv_splits: Sequence[int]
) -> torch.Tensor:
    """Uneven AllToAll along dim 0: the first ``send_splits[0]`` rows of ``t`` go to rank
    0, the next ``send_splits[1]`` to rank 1, ...; the output stacks the
    ``recv_splits[i]`` rows received from each rank ``i`` in axis order. Counted as the
    bytes that leave this rank (the rows sent to the other ranks), which for even splits
    is the (N-1)/N · S of :func:`all_to_all`."""
    if len(send_splits) != g.size or len(recv_splits) != g.size:
        raise ValueError(
            f"all_to_all_v on axis '{g.name}': {len(send_splits)} send and "
            f"{len(recv_splits)} receive splits for a group of {g.size}"
        )
    if sum(send_splits) != t.shape[0]:
        raise ValueError(
            f"all_to_all_v on axis '{g.name}': send splits sum to {sum(send_splits)}, "
            f"the tensor has {t.shape[0]} rows"
        )
    t = t.contiguous()
    row = t.element_size() * math.prod(t.shape[1:])  # bytes of one row
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    away = (sum(send_splits) - send_splits[g.index]) * row
    t0 = time.perf_counter()
    if g.pg is None:
        out.copy_(t)
    else:
        with g.guard("all_to_all"):
            dist.all_to_all_single(
                out,
                t,
                output_split_sizes=list(recv_splits),
                input_split_sizes=list(send_splits),
                group=g.pg,
            )
    g.stats.record(g.name, "all_to_all", float(away), time.perf_counter() - t0)
    return out


def broadcast(t: torch.Tensor, g: AxisGroup, src: int = 0, async_op: bool = False) -> Handle | None:
    """In place: every rank ends with ``t`` of the rank at index ``src`` (Broadcast)."""
    if g.pg is None:
        return _run(g, "broadcast", tensor_bytes(t), lambda a: None, async_op)
    gsrc = g.global_rank(src)
    return _run(
        g,
        "broadcast",
        tensor_bytes(t),
        lambda a: dist.broadcast(t, gsrc, group=g.pg, async_op=a),
        async_op,
    )


def reduce(t: torch.Tensor, g: AxisGroup, dst: int = 0, op: ReduceOp = "sum") -> None:
    """In place on the rank at index ``dst``: the reduction of every rank's ``t`` (Reduce).
    Other ranks' ``t`` is left unspecified."""
    rop = _reduce_op(op)
    then = _divide(t, g.size) if op == "avg" and g.size > 1 and g.index == dst else None
    if g.pg is None:
        _run(g, "reduce", tensor_bytes(t), lambda a: None, False)
        return
    gdst = g.global_rank(dst)
    _run(
        g,
        "reduce",
        tensor_bytes(t),
        lambda a: dist.reduce(t, gdst, op=rop, group=g.pg, async_op=a),
        False,
        then,
    )


def gather(t: torch.Tensor, g: AxisGroup, dst: int = 0) -> list[torch.Tensor] | None:
    """The rank at index ``dst`` receives every rank's ``t`` (same shape) in axis order."""
    t = t.contiguous()
    total = tensor_bytes(t) * g.size
    if g.pg is None:
        _run(g, "gather", total, lambda a: None, False)
        return [t.clone()]
    out = [torch.empty_like(t) for _ in range(g.size)] if g.index == dst else None
    gdst = g.global_rank(dst)
    _run(
        g,
        "gather",
        total,
        lambda a: dist.gather(t, out, dst=gdst, group=g.pg, async_op=a),
        False,
    )
    return out


def scatter(
    out: torch.Tensor, g: AxisGroup, chunks: Sequence[torch.Tensor] | None = None, src: int = 0
) -> None:
    """In place: rank ``i`` receives ``chunks[i]`` of the rank at index ``src``."""
    total = tensor_bytes(out) * g.size
    if g.index == src and (chunks is None or len(chunks) != g.size):
        raise ValueError(f"scatter on axis '{g.name}': the source needs {g.size} chunks")
    if g.pg is None:
        assert chunks is not None
        out.copy_(chunks[0])
        _run(g, "scatter", total, lambda a: None, False)
        return
    lst = [c.contiguous() for c in chunks] if g.index == src and chunks is not None else None
    gsrc = g.global_rank(src)
    _run(
        g,
        "scatter",
        total,
        lambda a: dist.scatter(out, lst, src=gsrc, group=g.pg, async_op=a),
        False,
    )


def barrier(g: AxisGroup) -> None:
    """Block until every rank of the group has entered the barrier."""
    if g.pg is None:
        _run(g, "barrier", 0, lambda a: None, False)
        return
    _run(g, "barrier", 0, lambda a: dist.barrier(group=g.pg, async_op=a), False)


# ---------------------------------------------------------------- point to point


def send(t: torch.Tensor, g: AxisGroup, dst: int, tag: int = 0) -> None:
    """Send ``t`` to the rank at index ``dst`` along the axis (blocking).

    Messages between two ranks with the same ``tag`` are matched in the order posted.
    """
    gdst = g.global_rank(dst)
    _run(
        g,
        "send",
        tensor_bytes(t),
        lambda a: dist.send(t.contiguous(), gdst, group=g.pg, tag=tag),
        False,
    )


def _recv_buffer(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """gloo receives only into contiguous memory: a staging buffer and its copy-back."""
    if t.is_contiguous():
        return t, None
    buf = torch.empty_like(t, memory_format=torch.contiguous_format)

    def then() -> None:
        t.copy_(buf)

    return buf, then


def recv(t: torch.Tensor, g: AxisGroup, src: int, tag: int = 0) -> None:
    """Receive into ``t`` from the rank at index ``src`` along the axis (blocking)."""
    gsrc = g.global_rank(src)
    buf, then = _recv_buffer(t)
    _run(
        g,
        "recv",
        tensor_bytes(t),
        lambda a: dist.recv(buf, gsrc, group=g.pg, tag=tag),
        False,
        then,
    )


def recv_any(t: torch.Tensor, g: AxisGroup, tag: int = 0) -> int:
    """Receive into ``t`` from whichever rank of the axis sends first with ``tag``
    (blocking, at most the group timeout); returns the sender's axis index.

    The message must have exactly ``t``'s size: give every message that can arrive
    under one tag the same size.
    """
    if g.pg is None:
        raise ValueError(f"recv_any on axis '{g.name}': a group of one rank has no peers")
    buf, then = _recv_buffer(t)
    src: list[int] = []

    def fn(a: bool) -> None:
        src.append(int(dist.recv(buf, None, group=g.pg, tag=tag)))

    _run(g, "recv", tensor_bytes(t), fn, False, then)
    return g.ranks.index(src[0])


def isend(t: torch.Tensor, g: AxisGroup, dst: int, tag: int = 0) -> Handle:
    """Start sending ``t`` to index ``dst``; wait on the handle before reusing ``t``."""
    gdst = g.global_rank(dst)
    t = t.contiguous()  # gloo sends only contiguous memory (as in send)
    h = _run(g, "send", tensor_bytes(t), lambda a: dist.isend(t, gdst, group=g.pg, tag=tag), True)
    assert h is not None
    return h


def irecv(t: torch.Tensor, g: AxisGroup, src: int, tag: int = 0) -> Handle:
    """Start receiving into ``t`` from index ``src``; wait on the handle before reading."""
    gsrc = g.global_rank(src)
    buf, then = _recv_buffer(t)
    h = _run(
        g,
        "recv",
        tensor_bytes(t),
        lambda a: dist.irecv(buf, gsrc, group=g.pg, tag=tag),
        True,
        then,
    )
    assert h is not None
    return h


@dataclass
class P2P:
    """One message of a batch: ``kind`` is "send" or "recv", ``peer`` an axis index."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    tag: int = 0
    """Messages between two ranks are matched by tag, then in the order posted."""


def batch_isend_irecv(ops: Sequence[P2P], g: AxisGroup) -> list[Handle]:
    """Start a batch of sends and receives together (no ordering deadlock between them)."""
    if not ops:
        return []
    p2p = []
    thens: list[Callable[[], None] | None] = []
    for o in ops:
        if o.kind not in ("send", "recv"):
            raise ValueError(f"P2P kind must be 'send' or 'recv', got {o.kind!r}")
        peer = g.global_rank(o.peer)
        if o.kind == "send":  # gloo moves only contiguous memory
            p2p.append(dist.P2POp(dist.isend, o.tensor.contiguous(), peer, group=g.pg, tag=o.tag))
            thens.append(None)
        else:
            buf, then = _recv_buffer(o.tensor)
            p2p.append(dist.P2POp(dist.irecv, buf, peer, group=g.pg, tag=o.tag))
            thens.append(then)
    with g.guard("batch_isend_irecv"):
        works = dist.batch_isend_irecv(p2p)
    handles = []
    for o, w, then in zip(ops, works, thens, strict=True):
        _count(g, o.kind, tensor_bytes(o.tensor))
        handles.append(Handle(w, g, o.kind, then))
    return handles
