"""All-gather, reduce-scatter and all-to-all written only with plait's counted
point-to-point operations (part of :mod:`plait.collectives.algorithms`).

Each returns the same tensor as the library collective it mirrors and a
:class:`~plait.collectives.support.Report` (closed form; measured traffic with
``measure=True``).
"""

from __future__ import annotations

from typing import Literal

import torch

from plait.collectives.support import (
    Meter,
    Report,
    check_same_shape,
    exchange_step,
    ring_all_gather_phase,
    ring_reduce_scatter_phase,
)
from plait.comm.group import AxisGroup

Op = Literal["sum", "avg"]


def _chunked_input(t: torch.Tensor, g: AxisGroup, what: str, check: bool) -> torch.Tensor:
    if check:
        check_same_shape(t, g, what)
    if t.dim() == 0 or t.shape[0] % g.size:
        dim0 = t.shape[0] if t.dim() else "a scalar"
        raise ValueError(f"{what} on axis '{g.name}': dim 0 ({dim0}) is not divisible by {g.size}")
    return t.detach().contiguous()


def ring_all_gather(
    t: torch.Tensor,
    g: AxisGroup,
    *,
    pipeline: int = 1,
    check_shapes: bool = True,
    measure: bool = False,
) -> tuple[torch.Tensor, Report]:
    """Ring all-gather: (m, ...) on each rank -> (N·m, ...), ranks in axis order
    (as :func:`plait.comm.all_gather`). N-1 steps of S bytes."""
    if check_shapes:
        check_same_shape(t, g, "ring_all_gather")
    x = t.detach().contiguous()
    shape = (g.size * x.shape[0], *x.shape[1:]) if x.dim() else (g.size,)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)  # (N·m, ...)
    chunks = list(out.view(-1).split(x.numel())) if x.numel() else [out.view(-1)] * g.size
    chunks[g.index].copy_(x.view(-1))
    meter = Meter(g, g.size - 1)
    ring_all_gather_phase(chunks, g, meter, 0, pipeline)
    return out, meter.report("ring_all_gather", x, measure)


def ring_reduce_scatter(
    t: torch.Tensor,
    g: AxisGroup,
    op: Op = "sum",
    *,
    pipeline: int = 1,
    check_shapes: bool = True,
    measure: bool = False,
) -> tuple[torch.Tensor, Report]:
    """Ring reduce-scatter: (N·m, ...) -> this rank's reduced chunk (m, ...) (as
    :func:`plait.comm.reduce_scatter`; the input is left unchanged). N-1 steps."""
    if op not in ("sum", "avg"):
        raise ValueError(f"ring_reduce_scatter: reduction {op!r} is not supported")
    x = _chunked_input(t, g, "ring_reduce_scatter", check_shapes)
    work = x.clone().view(-1)  # (N·m·inner,)
    piece = work.numel() // g.size
    chunks = [work[c * piece : (c + 1) * piece] for c in range(g.size)]
    meter = Meter(g, g.size - 1)
    ring_reduce_scatter_phase(chunks, g, meter, 0, pipeline)
    out = chunks[g.index].view(x.shape[0] // g.size, *x.shape[1:]).clone()  # (m, ...)
    if op == "avg" and g.size > 1:
        out.div_(g.size)
    return out, meter.report("ring_reduce_scatter", x, measure)


def direct_all_to_all(
    t: torch.Tensor, g: AxisGroup, *, check_shapes: bool = True, measure: bool = False
) -> tuple[torch.Tensor, Report]:
    """Direct all-to-all: chunk i of dim 0 goes to rank i; the output stacks the chunks
    received from every rank in axis order (as :func:`plait.comm.all_to_all`). One step
    of N-1 simultaneous messages per rank."""
    x = _chunked_input(t, g, "direct_all_to_all", check_shapes)
    out = torch.empty_like(x)  # (N·m, ...)
    n, i = g.size, g.index
    m = x.shape[0] // n
    src = [x.narrow(0, j * m, m) for j in range(n)]  # (m, ...) each
    dst = [out.narrow(0, j * m, m) for j in range(n)]
    dst[i].copy_(src[i])
    meter = Meter(g, 1 if n > 1 else 0)
    if n > 1:
        exchange_step(src, dst, g, meter, 0)
    return out, meter.report("direct_all_to_all", x, measure)
