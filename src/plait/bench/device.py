"""Calibrate one accelerator: ``plait bench calibrate --device cuda``.

One process measures the device's rates in the planner's own conventions and writes them
over the matching datasheet preset (:func:`plait.plan.fit.cuda_hardware`: links, peak
FLOP/s for MFU, node size), with the memory the device reports:

* ``matmul``: a linear layer in training (forward and both gradient GEMMs, ``3·2·M·K·N``
  FLOPs) in the compute dtype at several sizes ``(M·K·N)^(1/3)``;
* ``attention``: causal scaled-dot-product attention forward + backward at several
  sequence lengths (FLOPs ``3 x 4·b·s²·a·d``, the causal mask not discounted, as
  :mod:`plait.plan.compute` charges it);
* ``elementwise``: the chain of a block's memory-bound layers in training (norm, rotary,
  SwiGLU's product, residual) charged as :func:`plait.bench.measure.measure_elementwise`
  charges it, at several tensor sizes;
* ``optimizer_bandwidth``: AdamW + gradient clipping, 40 bytes per fp32 parameter;
* the launch overhead of one kernel and the training step of a tiny block, reported (a
  GPU's launches run ahead of its kernels, so the profile charges neither:
  ``op_overhead_s`` and ``block_overhead_s`` stay 0).

Every time is the median over repetitions after a warm-up, the device synchronised
before the clock is read. The same code runs on ``cpu`` (the tests run it there, tiny).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.plan.hardware import Curve, Hardware

GPU_LINEAR = (1024, 2048, 4096, 8192)
GPU_ATTENTION = (512, 1024, 2048, 4096, 8192)
GPU_ELEMENTWISE = (2**20, 2**22, 2**24, 2**26)
ATTN_HEADS, ATTN_HEAD_DIM = 16, 128


@dataclass(frozen=True)
class DeviceRates:
    """What :func:`measure_device` measured (seconds per point and the rates)."""

    matmul: Curve
    """FLOP/s of a linear layer in training by size."""
    attention: Curve
    """Causal attention forward + backward FLOP/s by sequence length."""
    elementwise: Curve
    """Memory-bound bytes/s by tensor bytes."""
    optimizer_bandwidth: float
    """AdamW + clipping bytes/s."""
    launch_s: float
    """Seconds of one tiny kernel (launch and dispatch)."""
    tiny_block_s: float
    """Seconds of the tiny block's forward + backward."""


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def median_s(fn: Callable[[], object], reps: int) -> float:
        fn()
        sync()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(max(time.perf_counter() - t0, 1e-9))
        return statistics.median(out)

    return median_s


def measure_device(
    device: str,
    dtype: Any,
    linear: Sequence[int] = GPU_LINEAR,
    attention: Sequence[int] = GPU_ATTENTION,
    elementwise: Sequence[int] = GPU_ELEMENTWISE,
    reps: int = 10,
    optimizer_params: int = 2**24,
) -> DeviceRates:
    """Measure ``device`` in ``dtype`` (e.g. ``torch.bfloat16`` on a GPU)."""
    import torch
    import torch.nn.functional as F

    from plait.bench.measure import MEMORY_BOUND_ELEMENTS, measure_tiny_block

    t = _timer(device)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    mm = []
    for n in linear:
        x = torch.randn(4 * n, n, requires_grad=True, **kw)
        w = torch.randn(n, n, requires_grad=True, **kw)
        g = torch.randn(4 * n, n, **kw)

        def lin(x: Any = x, w: Any = w, g: Any = g) -> None:
            (x @ w.t()).backward(g)

        sec = t(lin, reps)
        size = (4.0 * n**3) ** (1.0 / 3.0)
        mm.append((size, 3 * 2.0 * size**3 / sec))
    at = []
    for s in attention:
        q, k, v = (
            torch.randn(1, ATTN_HEADS, s, ATTN_HEAD_DIM, requires_grad=True, **kw) for _ in range(3)
        )
        g = torch.randn(1, ATTN_HEADS, s, ATTN_HEAD_DIM, **kw)

        def attn(q: Any = q, k: Any = k, v: Any = v, g: Any = g) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

        at.append((float(s), 3 * 4.0 * s * s * ATTN_HEADS * ATTN_HEAD_DIM / t(attn, reps)))
    ew = []
    esize = torch.empty((), dtype=dtype).element_size()
    for n in elementwise:
        rows = max(1, n // 128)
        x = torch.randn(rows, 128, requires_grad=True, **kw)
        w = torch.ones(128, requires_grad=True, **kw)
        c, sn = torch.rand(1, 64, **kw), torch.rand(1, 64, **kw)
        g = torch.randn(rows, 128, **kw)

        def chain(x: Any = x, w: Any = w, c: Any = c, sn: Any = sn, g: Any = g) -> None:
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
            y1, y2 = y.chunk(2, dim=-1)
            r = torch.cat((y1 * c - y2 * sn, y1 * sn + y2 * c), dim=-1)
            (F.silu(r) * y + x).backward(g)

        nbytes = float(esize * rows * 128)
        ew.append((nbytes, 3.0 * MEMORY_BOUND_ELEMENTS * nbytes / t(chain, reps)))
    ps = [torch.nn.Parameter(torch.randn(optimizer_params // 16, device=device)) for _ in range(16)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        opt.step()

    opt_bw = 40.0 * (optimizer_params // 16) * 16 / t(step, reps)
    one = torch.ones(1, device=device)
    launch = t(lambda: [one.add_(0.0) for _ in range(100)], reps) / 100
    tiny = measure_tiny_block(reps, device)["wall"]
    return DeviceRates(_curve(mm), _curve(at), _curve(ew), opt_bw, launch, tiny)


def _curve(points: list[tuple[float, float]]) -> Curve:
    return Curve(tuple(sorted(points)))


def device_profile(base: Hardware, rates: DeviceRates, source: str) -> Hardware:
    """``base`` (the datasheet preset) with the measured rates."""
    return replace(
        base,
        matmul=rates.matmul,
        attention=rates.attention,
        elementwise=rates.elementwise,
        optimizer_bandwidth=rates.optimizer_bandwidth,
        op_overhead_s=0.0,
        block_overhead_s=0.0,
        source=source,
    )


def calibrate_cuda(quick: bool = False) -> tuple[Hardware, DeviceRates]:
    """Measure the first CUDA device (bf16) and return its profile."""
    import datetime

    import torch

    from plait.errors import ConfigError
    from plait.plan.fit import cuda_hardware

    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: torch sees no CUDA device; run it on the GPU machine (or drop "
            "--device to calibrate the CPU ranks)."
        )
    props = torch.cuda.get_device_properties(0)
    base = cuda_hardware(props.name, float(props.total_memory))
    rates = measure_device(
        "cuda",
        torch.bfloat16,
        GPU_LINEAR[:2] if quick else GPU_LINEAR,
        GPU_ATTENTION[:3] if quick else GPU_ATTENTION,
        GPU_ELEMENTWISE[:2] if quick else GPU_ELEMENTWISE,
        reps=5 if quick else 10,
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"measured by plait bench calibrate --device cuda on {props.name} "
        f"({props.total_memory / 2**30:.1f} GiB), torch {torch.__version__} bf16, {stamp}; "
        f"launch {rates.launch_s * 1e6:.1f} us per kernel, tiny block "
        f"{rates.tiny_block_s * 1e3:.2f} ms (not charged: launches run ahead); links, peak "
        f"and node size from the {base.name} preset"
    )
    return device_profile(base, rates, source), rates
