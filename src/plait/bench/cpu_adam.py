"""Measure the CPU optimizer step ZeRO-Offload runs on the host.

:func:`measure_cpu_adam` times one AdamW step over flat fp32 buffers (the offloaded
master shards) three ways: torch's fused CPU kernel (``fused=True``), ``foreach``, and
the per-parameter loop (``foreach=False``), each with torch's intra-op threads. It
returns parameters per second for each; the planner charges the offloaded step at the
fastest (``cpu_adam_params_per_s``, written by ``plait bench calibrate``). Torch is
imported inside the functions (the planner imports no torch).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

VARIANTS = ("fused", "foreach", "loop")
"""The AdamW implementations measured."""


def _step_time(variant: str, numel: int, tensors: int, reps: int) -> float:
    """Median seconds of one AdamW step of ``variant`` over ``tensors`` flat fp32 buffers
    totalling ``numel`` elements (state created by a warm-up step)."""
    import torch

    each = max(1, numel // tensors)
    params = [torch.nn.Parameter(torch.randn(each)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(each)
    kw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1}
    if variant == "fused":
        kw["fused"] = True
    else:
        kw["foreach"] = variant == "foreach"
    opt = torch.optim.AdamW(params, **kw)
    opt.step()  # allocates m and v
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu_adam(
    numel: int = 1 << 22, tensors: int = 8, reps: int = 5, threads: int | None = None
) -> dict[str, float]:
    """Parameters per second of one AdamW step for each of :data:`VARIANTS`
    (``threads``: torch's intra-op threads for the measurement, default unchanged)."""
    import torch

    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out = {}
        for v in VARIANTS:
            try:
                out[v] = numel / _step_time(v, numel, tensors, reps)
            except (RuntimeError, ValueError):  # fused CPU kernel missing (torch < 2.4)
                continue
        return out
    finally:
        torch.set_num_threads(old)


def cpu_adam_params_per_s(quick: bool = True) -> float:
    """The fastest AdamW variant's parameters per second on this host (calibration)."""
    rates = measure_cpu_adam(numel=1 << (20 if quick else 24), reps=3 if quick else 5)
    return max(rates.values())
