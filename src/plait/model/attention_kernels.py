"""Fused attention kernels that return the log-sum-exp, and their backward given one.

Blockwise and ring attention (:mod:`plait.model.blockwise_attention`,
:mod:`plait.parallel.context.ring_attention`) merge partial results by their
log-sum-exp and recompute gradients from the *final* output and log-sum-exp of the
query rows. PyTorch's fused SDPA kernels do both, through their aten ops (the CUDA
log-sum-exps are float32):

* ``cpu``: ``_scaled_dot_product_flash_attention_for_cpu``; lse ``(b, h, sq)``, q's dtype;
* ``flash``: ``_scaled_dot_product_flash_attention`` (CUDA, 16-bit); lse ``(b, h, sq)``;
* ``efficient``: ``_scaled_dot_product_efficient_attention`` (CUDA); lse
  ``(b, h, ceil32(sq))`` (rows padded to a multiple of 32);
* ``cudnn``: ``_scaled_dot_product_cudnn_attention`` (CUDA); lse ``(b, h, sq, 1)``;

each with its ``_backward`` op, which takes the output and log-sum-exp to recompute the
probabilities ``P = exp(S - lse)`` (FlashAttention-2's backward): given the final
``(out, lse)`` of the rows it gives the true gradients of one key block. Signatures
are those of torch 2.11-2.13 (``native_functions.yaml``); dropout is always 0, so the
kernels' random-number state is never read (empty tensors are passed).

On CUDA the kernel is the one SDPA itself would pick for the same inputs
(``torch._fused_sdp_choice``, which honours ``torch.nn.attention.sdpa_kernel``), so a
block costs what SDPA costs on it. An additive mask (``bias``, 0 or -inf, document
masking) goes to the ``cpu`` or ``efficient`` kernel (flash and the cuDNN path here
take none). :func:`choose` returns None where no fused kernel applies (float64 on
CUDA, other devices): callers then use the pure-PyTorch reference.

A kernel that raises (other than running out of memory) is disabled *at its call site*
(:func:`call_site`: the blockwise forward, its backward, a ring step, ...), with a
warning, and SDPA's next choice or the reference serves that site from then on; other
sites keep it. :func:`disabled` and :func:`fallbacks` report both per site, and
:func:`reset` forgets them (a benchmark row, a test).

Rows that see no key of a block under a mask get ``out = 0``, ``lse = -inf`` (the
kernels' own value for such rows varies: the CPU kernel returns lse 0).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")

Kernel = Literal["cpu", "flash", "efficient", "cudnn"]
KERNELS: tuple[Kernel, ...] = ("cpu", "flash", "efficient", "cudnn")
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_SDPA_CHOICE: dict[int, Kernel] = {1: "flash", 2: "efficient", 3: "cudnn"}
"""``torch.nn.attention.SDPBackend`` values -> kernel (0 math, -1 error, 4 other)."""
_aten = torch.ops.aten


def available(q: torch.Tensor) -> bool:
    """Whether a fused kernel may serve ``q``'s device and dtype at all."""
    if q.device.type == "cpu":
        return q.dtype in _CPU_DTYPES
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _sdpa_choice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
) -> Kernel | None:
    try:
        choice = int(
            torch._fused_sdp_choice(
                q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal and mask is None
            )
        )
    except RuntimeError:  # inputs SDPA itself refuses: the reference serves them
        return None
    return _SDPA_CHOICE.get(choice)


def choose(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
    site: str | None = None,
) -> Kernel | None:
    """The fused kernel for these inputs (heads already expanded), or None. A kernel
    that failed at this call site (``site``: see :func:`call_site`; derived from the
    caller when None) is not chosen there again: SDPA's choice among the others is taken
    instead. Other call sites keep every kernel."""
    if not available(q):
        return None
    off = _DISABLED.get(site if site is not None else call_site(), {}) if _DISABLED else {}
    if q.device.type == "cpu":
        return None if "cpu" in off else "cpu"
    mask = _efficient_bias(bias, q)  # as the efficient kernel would get it
    kernel = _sdpa_choice(q, k, v, causal, mask)
    if kernel in off:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
        names["cudnn"] = "CUDNN_ATTENTION"
        allowed = [getattr(SDPBackend, b) for n, b in names.items() if n not in off]
        with sdpa_kernel([*allowed, SDPBackend.MATH]):
            kernel = _sdpa_choice(q, k, v, causal, mask)
    if kernel is not None and bias is not None:
        kernel = "efficient"  # the one CUDA kernel here that takes an additive mask
    return None if kernel in off else kernel


_DISABLED: dict[str, dict[str, str]] = {}
"""Call site -> the kernels that raised there -> the first line of their error."""
_FALLBACKS: dict[str, int] = {}
"""Call site -> calls made there after a kernel had failed there (each ran SDPA's next
choice or the reference, not necessarily the kernel a clean process would have run)."""
_HERE = __file__


def call_site(depth: int = 2) -> str:
    """The call site a kernel failure is charged to: the first ``depth`` frames outside
    this module, outermost first, as ``module.function`` joined by ``>`` (e.g.
    ``blockwise_attention.forward>blockwise_attention.block_forward``): the per-block
    helpers are called from several places (blockwise, ring), so their caller counts too."""
    frame = sys._getframe(1)
    names: list[str] = []
    while frame is not None and len(names) < depth:
        code = frame.f_code
        if code.co_filename != _HERE:
            names.append(f"{Path(code.co_filename).stem}.{code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return ">".join(reversed(names))


def disabled() -> dict[str, dict[str, str]]:
    """The kernels that failed, per call site (site -> kernel -> first line of its
    error); they are no longer chosen at that site. The GPU tests check this stays
    empty; ``benchmarks/attention_gpu.py`` reports it."""
    return {site: dict(kernels) for site, kernels in _DISABLED.items()}


def fallbacks() -> dict[str, int]:
    """Per call site, the calls made there after a kernel had failed there (a benchmark
    that times a fused row checks this stays unchanged)."""
    return dict(_FALLBACKS)


def reset() -> None:
    """Forget every failure and fallback count (a new benchmark row or test)."""
    _DISABLED.clear()
    _FALLBACKS.clear()


def _disable(site: str, kernel: Kernel, exc: RuntimeError) -> None:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    _DISABLED.setdefault(site, {})[kernel] = line
    warnings.warn(
        f"plait attention: the {kernel} kernel failed at {site} ({line}); another kernel "
        "or the reference computes its blocks there from now on",
        RuntimeWarning,
        stacklevel=4,
    )


def fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`forward` with the kernel :func:`choose` picks; None when none applies.
    A kernel that raises is disabled at this call site and the next choice is tried."""
    return _first_working(
        q, k, v, causal, bias, lambda kn: forward(kn, q, k, v, causal, scale, bias)
    )


def fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`backward` with the kernel :func:`choose` picks; None when none applies."""
    return _first_working(
        q, k, v, causal, bias, lambda kn: backward(kn, dout, q, k, v, out, lse, causal, scale, bias)
    )


def _first_working(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
    call: Callable[[Kernel], T],
) -> T | None:
    """``call(kernel)`` for the kernels :func:`choose` picks in turn: one that raises is
    disabled at the caller's site and the next is tried; None when none applies.
    Running out of memory is not the kernel's fault (the plain fallback needs more): it
    propagates, and the kernel stays enabled. The site is looked up only once a kernel
    has failed somewhere (no cost on the path without failures)."""
    site = call_site() if _DISABLED else None
    fell_back = bool(site is not None and _DISABLED.get(site))
    while True:
        kernel = choose(q, k, v, causal, bias, site=site or "")
        if kernel is None:
            break
        try:
            got = call(kernel)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            site = site or call_site()
            _disable(site, kernel, exc)
            fell_back = True
            continue
        if fell_back and site is not None:
            _FALLBACKS[site] = _FALLBACKS.get(site, 0) + 1
        return got
    if fell_back and site is not None:
        _FALLBACKS[site] = _FALLBACKS.get(site, 0) + 1
    return None


def _rng(q: torch.Tensor, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholder dropout state (dropout is 0: never read), shaped as the forward's."""
    if kernel == "flash":
        return (
            torch.empty(2, dtype=torch.uint64, device=q.device),
            torch.empty((), dtype=torch.uint64, device=q.device),
        )
    return (
        torch.empty((), dtype=torch.int64, device=q.device),
        torch.empty((), dtype=torch.int64, device=q.device),
    )


def _efficient_bias(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``bias`` ``(b or 1, 1, sq, sk)`` as the efficient kernel reads it: q's dtype, the last
    dimension's storage padded to a multiple of 16 (as SDPA pads it), heads expanded
    (stride 0) -> ``(b, h, sq, sk)``."""
    if bias is None:
        return None
    _, _, sq, sk = bias.shape  # (b or 1, 1, sq, sk): a window alone is one mask
    pad = -sk % 16
    padded = F.pad(bias.to(q.dtype), (0, pad))[..., :sk]
    return padded.expand(q.shape[0], q.shape[1], sq, sk)


def _visible_rows(bias: torch.Tensor) -> torch.Tensor:
    """``(b, 1, sq)`` bool: rows with at least one visible key."""
    return (bias > float("-inf")).any(-1)


def forward(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` ``(b, h, sq, d)`` over ``k``/``v`` ``(b, h, sk, d)``:
    ``out`` in q's dtype, ``lse`` ``(b, h, sq)`` in at least float32. ``causal`` (only
    without ``bias``) masks key ``j > i``; ``bias`` ``(b, 1, sq, sk)`` is added to the
    scores (0 visible, -inf masked)."""
    sq = q.shape[2]
    if kernel == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            0.0,
            causal,
            attn_mask=None if bias is None else bias.to(q.dtype),
            scale=scale,
        )
    elif kernel == "flash":
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
    elif kernel == "efficient":
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            q, k, v, _efficient_bias(bias, q), True, 0.0, causal, scale=scale
        )
        lse = lse[..., :sq]  # the kernel pads its rows to a multiple of 32
    elif kernel == "cudnn":
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(
            q,  # strided views, as torch's own context parallelism passes them
            k,
            v,
            None,
            True,
            0.0,
            causal,
            False,
            scale=scale,
        )
        lse = lse.reshape(lse.shape[0], lse.shape[1], sq)  # (b, h, sq, 1) -> (b, h, sq)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    lse = lse.to(torch.promote_types(q.dtype, torch.float32))
    if bias is not None:
        seen = _visible_rows(bias)  # (b, 1, sq)
        lse = torch.where(seen, lse, float("-inf"))
        out = torch.where(seen.unsqueeze(-1), out, 0.0)
    return out, lse


def backward(
    kernel: Kernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block from the rows' *final* ``out`` (q's dtype) and
    ``lse`` ``(b, h, sq)`` (their attention over every key block, merged)."""
    sq, sk = q.shape[2], k.shape[2]
    if kernel == "cpu":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out.contiguous(),
            lse.contiguous(),
            0.0,
            causal,
            attn_mask=None if bias is None else bias.to(q.dtype),
            scale=scale,
        )
        return dq, dk, dv
    seed, offset = _rng(q, kernel)
    # float32 for 16-bit inputs (what the kernels return and read); dense: a strided
    # slice would be misread by the kernels
    lse32 = lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous()
    dout, out = dout.contiguous(), out.contiguous()  # one layout for both, last dim dense
    if kernel == "flash":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse32,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    elif kernel == "efficient":
        padded = F.pad(lse32, (0, -sq % 32))  # (b, h, ceil32(sq)), as the forward returns it
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            _efficient_bias(bias, q),
            out,
            padded,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
    elif kernel == "cudnn":
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            out,
            lse32.unsqueeze(-1),
            seed,
            offset,
            None,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            scale=scale,
        )
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return dq, dk, dv
