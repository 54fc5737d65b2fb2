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

Rows that see no key of a block under a mask get ``out = 0``, ``lse = -inf`` (the
kernels' own value for such rows varies: the CPU kernel returns lse 0).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None
) -> Kernel | None:
    """The fused kernel for these inputs (heads already expanded), or None. A kernel
    that failed once in this process (:func:`disabled`) is not chosen again: SDPA's
    choice among the others is taken instead."""
    if not available(q):
        return None
    if q.device.type == "cpu":
        return None if "cpu" in _DISABLED else "cpu"
    mask = _efficient_bias(bias, q)  # as the efficient kernel would get it
    kernel = _sdpa_choice(q, k, v, causal, mask)
    if kernel in _DISABLED:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
        names["cudnn"] = "CUDNN_ATTENTION"
        allowed = [getattr(SDPBackend, b) for n, b in names.items() if n not in _DISABLED]
        with sdpa_kernel([*allowed, SDPBackend.MATH]):
            kernel = _sdpa_choice(q, k, v, causal, mask)
    if kernel is not None and bias is not None:
        kernel = "efficient"  # the one CUDA kernel here that takes an additive mask
    return None if kernel in _DISABLED else kernel


_DISABLED: dict[str, str] = {}
"""Kernels that raised in this process -> the first line of their error."""


def disabled() -> dict[str, str]:
    """The kernels that failed in this process and are no longer chosen (kernel ->
    first line of its error); the GPU tests check this stays empty."""
    return dict(_DISABLED)


def _disable(kernel: Kernel, exc: RuntimeError) -> None:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    _DISABLED[kernel] = line
    warnings.warn(
        f"plait attention: the {kernel} kernel failed ({line}); another kernel or the "
        "reference computes these blocks from now on",
        RuntimeWarning,
        stacklevel=3,
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
    A kernel that raises is disabled and the next choice is tried."""
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
    disabled and the next is tried; None when none applies. Running out of memory is
    not the kernel's fault (the plain fallback needs more): it propagates, and the
    kernel stays enabled."""
    while (kernel := choose(q, k, v, causal, bias)) is not None:
        try:
            return call(kernel)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            _disable(kernel, exc)
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
