"""Gradient compression for data parallelism (``parallel.compression``).

:class:`~plait.parallel.data_parallel.DataParallel` hands each gradient bucket to a
:class:`Compressor` instead of the plain all-reduce. Methods:

* ``fp16`` / ``bf16`` (:mod:`.cast`): cast, all-reduce, cast back; half the bytes;
* ``topk`` (:mod:`.topk`): the ``compression_ratio`` largest entries of each matrix as
  (index, value) pairs over an AllGather, error feedback, Deep Gradient Compression's
  sparsity warm-up (``compression_warmup_steps``), momentum correction and local
  clipping; ``compression_topk_scope = "bucket"`` picks the same count as one top-k
  over a bucket's matrices; ``compression_topk_sign_every`` adds one bit per remaining
  residual entry (:mod:`.sign_residual`);
* ``powersgd`` (:mod:`.powersgd`): rank-``compression_rank`` power iteration per matrix,
  warm-started, error feedback.

``compression_start`` plain steps run first (PowerSGD's ``start_iter``). Compression
applies over dp only (tp/pp untouched) and only on the last micro-step of an
accumulation (the others do not communicate). ZeRO stages reduce-scatter to shard
owners rather than all-reduce, and mixed precision reduces through the ZeRO wrapper:
both are refused with compression (see :func:`plait.config.rules.features.check_compression`).
"""

from __future__ import annotations

from typing import Any

from plait.config import COMPRESSIONS, Config, ParallelConfig, TopKScope
from plait.parallel.compression.adam_local import LocalAdam
from plait.parallel.compression.cast import CAST_DTYPES, CastCompressor
from plait.parallel.compression.compressor import Compressor, Finish
from plait.parallel.compression.powersgd import PowerSGDCompressor
from plait.parallel.compression.topk import TopKCompressor

METHODS = COMPRESSIONS  # declared once, in plait.config


def make_compressor(
    method: str,
    *,
    ratio: float = 0.01,
    rank: int = 4,
    start: int = 0,
    seed: int = 0,
    warmup: int = 0,
    adam: LocalAdam | None = None,
    clip: float = 0.0,
    scope: TopKScope = "tensor",
    sign_every: int = 0,
    sign_scale: float = 1.8,
) -> Compressor | None:
    """The compressor for ``parallel.compression = method`` (None for ``"none"``);
    ``warmup`` is top-k's sparsity warm-up in steps (``compression_warmup_steps``),
    ``adam`` its Adam moments in front of the sparsification and ``clip`` its local
    clipping threshold (``compression_adam = "before"``), ``scope`` where top-k picks
    (``compression_topk_scope``), ``sign_every`` how often it also sends the residual's
    signs (``compression_topk_sign_every``) and ``sign_scale`` their magnitude
    (``compression_topk_sign_scale``)."""
    if method == "none":
        return None
    if method in CAST_DTYPES:
        return CastCompressor(method, start)
    if method == "topk":
        return TopKCompressor(
            ratio,
            start,
            warmup=warmup,
            adam=adam,
            clip=clip,
            scope=scope,
            sign_every=sign_every,
            sign_scale=sign_scale,
        )
    if method == "powersgd":
        return PowerSGDCompressor(rank, start, seed=seed)
    raise ValueError(f"unknown compression {method!r}; use one of {', '.join(METHODS)}")


def adam_before(p: ParallelConfig, full: Config | None) -> dict[str, Any]:
    """``make_compressor``'s ``adam`` and ``clip`` for top-k with ``compression_adam =
    "before"`` (empty otherwise): Adam's betas and the clipping threshold from the
    ``train`` section of ``full`` (torch's AdamW betas and no clipping without one)."""
    if p.compression != "topk" or p.compression_adam != "before":
        return {}
    if full is None:
        return {"adam": LocalAdam()}
    t = full.train
    return {"adam": LocalAdam(t.beta1, t.beta2), "clip": t.grad_clip}


def adam_in_front(model: Any) -> bool:
    """Whether ``model``'s gradient compressor applies Adam itself (top-k with
    ``compression_adam = "before"``): its optimizer must then be plain SGD without
    momentum, and clipping happens on each rank before the moments."""
    compressor = getattr(model, "compressor", None)
    return isinstance(compressor, TopKCompressor) and compressor.adam is not None


__all__ = [
    "METHODS",
    "CastCompressor",
    "Compressor",
    "Finish",
    "LocalAdam",
    "PowerSGDCompressor",
    "TopKCompressor",
    "adam_before",
    "adam_in_front",
    "make_compressor",
]
