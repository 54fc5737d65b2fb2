"""The CPU optimizer step of ZeRO-Offload: torch's fused, vectorised, multi-threaded AdamW.

ZeRO-Offload (Ren et al. 2021) steps the fp32 masters on the host; its cost is bounded by
host memory bandwidth (AdamW reads the master, gradient, m and v and writes the master,
m and v: 28 bytes per parameter in fp32). PyTorch (>= 2.4) ships a fused CPU kernel
for Adam/AdamW (``fused=True`` on CPU tensors: one vectorised pass per tensor, the
tensor split over the intra-op threads), which is what plait uses; ``foreach`` (a few
whole-list passes) and the per-parameter loop are the fallbacks. The three were measured
by :mod:`plait.bench.cpu_adam` (``benchmarks/offload.py`` prints the table; figures in
``benchmarks/RESULTS.md``): the fused kernel is the fastest, so no extension of our own
is built.

:func:`host_optimizer` rebuilds the user's optimizer over the offloaded master segments:
Adam and AdamW become their fused CPU variant (the same update, to float rounding:
the fused kernel evaluates the same formula in a different order); any other element-wise
optimizer is rebuilt as it is.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

FUSED_CPU = ("Adam", "AdamW")
"""Optimizer classes rebuilt with ``fused=True`` on the host."""


def fused_cpu_supported() -> bool:
    """Whether this torch has the fused CPU Adam/AdamW kernel (torch >= 2.4)."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def host_optimizer(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and defaults over the host ``groups``:
    fused (``foreach``/``capturable``/``differentiable`` off) for Adam and AdamW when
    torch supports it, else unchanged."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if cls.__name__ in FUSED_CPU and "fused" in accepted and fused_cpu_supported():
        kwargs.update(fused=True, foreach=False, capturable=False, differentiable=False)
        for g in groups:
            for key in ("foreach", "capturable", "differentiable"):
                g.pop(key, None)
            g["fused"] = True
    return cls(groups, **kwargs)


def adamw_bytes_per_param(dtype_bytes: int = 4) -> int:
    """Host memory traffic of one AdamW update per parameter: reads master, gradient,
    m, v; writes master, m, v (seven ``dtype_bytes`` accesses)."""
    return 7 * dtype_bytes
