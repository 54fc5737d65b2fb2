"""Top-k sparsification with error feedback (Aji & Heafield 2017; Stich et al. 2018).

Each rank adds its error buffer to the bucket, keeps, per matrix-shaped tensor of the
bucket, the k_i = ceil(rho * n_i) entries of largest magnitude (vectors and scalars,
biases and norm weights, go whole, as in Deep Gradient Compression: selecting per
tensor keeps a layer with small gradients from never being sent), and the ranks
exchange the k = sum k_i ``(index, value)`` pairs with one AllGather
(indices int32 when the bucket has fewer than 2^31 elements, else int64; values in the
gradient's dtype, both packed into one byte message). Every rank then adds all ranks'
pairs into a zero bucket in rank order, so the result (the sum, i.e. the mean of the
pre-divided gradients) is identical on every rank. What a rank did not send stays in
its error buffer and is added next step. With ``scope = "bucket"``
(``parallel.compression_topk_scope``) the same total count is picked as one top-k over
all matrix entries of the bucket instead, so the budget goes to the matrices whose
residual is largest (vectors still go whole; :meth:`TopKCompressor.select`).

Sparsity warm-up (Deep Gradient Compression, Lin et al. 2018): over the first
``warmup`` compressed steps the density decays exponentially from ``start_ratio``
(DGC's 25 %) to ``ratio``: at compressed step t (0-based, counted from
``compression_start``), ``rho_t = rho_0 * (rho / rho_0) ** (t / warmup)`` for
``t < warmup``, else ``rho`` (:meth:`TopKCompressor.ratio_at`). Early gradients change
fastest and the error buffers are still empty, so sending more of them first keeps the
first steps close to the uncompressed run; the warm-up sends more bytes. DGC's momentum
correction and momentum factor masking (for SGD with momentum) and its local gradient
clipping are options of :class:`TopKCompressor`; docs/compression.md says which parts
apply to Adam and why.

With ``sign_every = S`` (``parallel.compression_topk_sign_every``) every S-th step also
sends one bit per remaining matrix entry of the residual, a scaled sign with one scale
per tensor (:mod:`.sign_residual`), in the same AllGather message.

Wire bytes per rank and bucket (AllGather output, S in :mod:`plait.comm.stats`):
``N * k * (index_bytes + value_bytes)``, plus ``N * (n_mat * value_bytes + ceil(M / 8))``
on a step that sends signs (n_mat matrices of M entries in all). With rho = 1 every entry
is sent and the result equals the plain all-reduce (up to the order of the additions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.config import TOPK_SCOPES, TopKScope
from plait.parallel.compression import sign_residual
from plait.parallel.compression.adam_local import LocalAdam
from plait.parallel.compression.compressor import Compressor, Finish, _done


def topk_count(numel: int, ratio: float) -> int:
    """k for a bucket of ``numel`` elements: ceil(ratio * numel), at least 1."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    """The dtype indices travel in: int32 while they fit."""
    return torch.int32 if numel < 2**31 else torch.int64


DGC_START_RATIO = 0.25
"""The density a sparsity warm-up starts from (DGC's 75 % sparsity)."""


def warmup_ratio(t: int, ratio: float, warmup: int, start_ratio: float = DGC_START_RATIO) -> float:
    """The density at compressed step ``t`` (0-based) of an exponential warm-up over
    ``warmup`` steps from ``max(start_ratio, ratio)`` to ``ratio``."""
    rho0 = max(start_ratio, ratio)
    if t >= warmup:
        return ratio
    return rho0 * (ratio / rho0) ** (max(t, 0) / warmup)


class TopKCompressor(Compressor):
    """Send the ``ratio`` fraction of largest-magnitude entries of each bucket.

    Args:
        ratio: the density rho in (0, 1] after the warm-up.
        start: plain all-reduce steps before compression begins.
        warmup: compressed steps over which the density decays exponentially from
            ``start_ratio`` to ``ratio`` (``parallel.compression_warmup_steps``; 0: none).
        start_ratio: the warm-up's first density (DGC: 0.25).
        momentum: DGC's momentum correction for SGD with momentum m (0: off, the
            error feedback on the raw gradient that Adam needs): each rank keeps a
            velocity ``u = m * u + g`` and accumulates ``v += u``; top-k of ``v`` is sent,
            and the sent entries of both ``u`` and ``v`` are cleared (momentum factor
            masking). The optimizer then runs *without* momentum (plain SGD): the
            momentum is applied here, before the sparsification.
        clip: local gradient clipping (DGC): before it is accumulated, this rank's
            bucket (pre-divided by N) is scaled to an L2 norm of at most
            ``clip / sqrt(N)`` (0: off). ``clip`` is the global clipping threshold.
        adam: the Adam form of momentum correction (:mod:`.adam_local`): this rank's
            Adam moments of its own gradient, with error feedback and top-k on the
            resulting step direction. The optimizer then runs plain SGD (no momentum;
            its weight decay equals AdamW's). The ``start`` steps then send everything
            (rho = 1) rather than the raw gradient. Exclusive with ``momentum``.
        scope: ``"tensor"``: ``ceil(rho * n_i)`` entries of each matrix (DGC);
            ``"bucket"``: the same total count, picked as one top-k over every matrix
            entry of the bucket (:meth:`select`; ``parallel.compression_topk_scope``).
        sign_every: every this many compressed steps (counted from ``start``) also send
            one bit per remaining matrix entry of the residual, a scaled sign with one
            scale per tensor (:mod:`.sign_residual`; ``parallel.compression_topk_sign_every``;
            0: off).
        sign_scale: the magnitude of those signs as a multiple of each tensor's mean
            residual magnitude (``parallel.compression_topk_sign_scale``; > 0; 1 is the
            least-squares scale, 1.8 converged best of the scales measured; above 2 the
            residual's oscillation grows: :mod:`.sign_residual`).
    """

    name = "topk"
    error_feedback = True

    def __init__(
        self,
        ratio: float,
        start: int = 0,
        warmup: int = 0,
        start_ratio: float = DGC_START_RATIO,
        momentum: float = 0.0,
        clip: float = 0.0,
        adam: LocalAdam | None = None,
        scope: TopKScope = "tensor",
        sign_every: int = 0,
        sign_scale: float = 1.8,
    ) -> None:
        super().__init__(start)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        if warmup < 0:
            raise ValueError(f"top-k warm-up steps must be >= 0, got {warmup}")
        if not 0.0 < start_ratio <= 1.0:
            raise ValueError(f"top-k warm-up start ratio must be in (0, 1], got {start_ratio}")
        if not 0.0 <= momentum < 1.0 or clip < 0:
            raise ValueError(
                f"top-k momentum must be in [0, 1) and clip >= 0, got {momentum}, {clip}"
            )
        if adam is not None and momentum > 0:
            raise ValueError("top-k takes momentum correction for SGD or for Adam, not both")
        if scope not in TOPK_SCOPES:
            raise ValueError(f"top-k scope must be one of {', '.join(TOPK_SCOPES)}, got {scope!r}")
        if sign_every < 0:
            raise ValueError(f"top-k sign_every must be >= 0, got {sign_every}")
        if sign_scale <= 0:
            raise ValueError(f"top-k sign_scale must be > 0, got {sign_scale}")
        self.sign_every = sign_every
        self.sign_scale = sign_scale
        self.scope = scope
        self.ratio = ratio
        self.adam = adam
        self.lr = 0.0
        """With Adam's correction: the learning rate the residuals are scaled for (0: none
        given yet); :meth:`set_lr`."""
        self.momentum = momentum
        self.clip = clip
        self.velocity: dict[int, torch.Tensor] = {}
        """Per bucket (momentum correction): ``(numel,)`` this rank's velocity u."""
        self.warmup = warmup
        self.start_ratio = start_ratio

    def ratio_at(self, step: int) -> float:
        """The density used at synchronising step ``step`` (0-based, counting the
        ``start`` plain steps): the warm-up's exponential decay, then ``ratio``. With
        Adam's correction the ``start`` steps send everything (density 1)."""
        if self.adam is not None and step < self.start:
            return 1.0
        return warmup_ratio(step - self.start, self.ratio, self.warmup, self.start_ratio)

    def set_lr(self, lr: float) -> None:
        """With Adam's correction the residual holds step directions not yet applied,
        in units of the learning rate that will apply them. When the rate changes from
        lr_old to lr, the residual is scaled by lr_old / lr, so that what it will move the
        weights by (lr times what is sent) is what it was accumulated as: a direction held
        back while the rate decays still arrives in full. No-op without Adam."""
        if self.adam is None or lr <= 0:
            return
        if self.lr > 0 and lr != self.lr:
            for err in self.errors.values():
                err.mul_(self.lr / lr)
        self.lr = lr

    def sign_at(self, step: int) -> bool:
        """Whether synchronising step ``step`` (0-based) sends the residual's signs: every
        ``sign_every``-th compressed step, counted from ``start``, while the density is
        below 1 (at density 1 nothing is left to send)."""
        if self.sign_every <= 0 or step < self.start or self.ratio_at(step) >= 1.0:
            return False
        return (step - self.start) % self.sign_every == 0

    @property
    def active(self) -> bool:
        """With Adam's correction every step runs here (the optimizer is plain SGD and
        needs Adam's step direction even before compression starts)."""
        return self.adam is not None or super().active

    @property
    def current_ratio(self) -> float:
        """The density this step sends."""
        return self.ratio_at(self.steps)

    def counts(self, shapes: Sequence[torch.Size], ratio: float | None = None) -> list[int]:
        """Per tensor of a bucket: the entries sent at density ``ratio`` (default: this
        step's): ``ceil(ratio * numel)`` for a matrix (at least 1), every entry of a
        vector or scalar (DGC leaves biases and norm weights uncompressed)."""
        rho = self.current_ratio if ratio is None else ratio
        out = []
        for shape in shapes:
            numel = math.prod(shape)
            out.append(topk_count(numel, rho) if len(shape) >= 2 else numel)
        return out

    def select(self, corrected: torch.Tensor, shapes: Sequence[torch.Size]) -> torch.Tensor:
        """The bucket offsets ``(k,)`` (int64, unique) this rank sends of ``corrected``
        ``(numel,)``: every entry of a vector; of the matrices, per tensor its
        ``k_i = ceil(rho * n_i)`` largest magnitudes (scope ``"tensor"``), or (scope
        ``"bucket"``) the ``sum_i k_i`` largest magnitudes over all matrix entries of the
        bucket together: the same count, spent where the residual is largest."""
        counts = self.counts(shapes)
        dense = [len(s) < 2 or k_i == math.prod(s) for s, k_i in zip(shapes, counts, strict=True)]
        if self.scope == "bucket" and not all(dense):
            score = corrected.abs()  # (numel,) with every entry sent whole marked +inf
            offset = 0
            for shape, whole in zip(shapes, dense, strict=True):
                size = math.prod(shape)
                if whole:
                    score[offset : offset + size] = math.inf
                offset += size
            return score.topk(sum(counts), sorted=False).indices
        picks, offset = [], 0
        for shape, k_i, whole in zip(shapes, counts, dense, strict=True):
            size = math.prod(shape)
            if whole:  # a vector, or rho * numel rounds up to all of it
                picks.append(torch.arange(offset, offset + size, device=corrected.device))
            else:  # (k_i,) the tensor's largest-magnitude entries, as bucket offsets
                part = corrected[offset : offset + size].abs()
                picks.append(part.topk(k_i, sorted=False).indices + offset)
            offset += size
        return torch.cat(picks)

    def reduce(
        self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size], group: AxisGroup
    ) -> Finish:
        n = flat.numel()
        if self.clip > 0:  # local clipping before accumulation (DGC)
            limit = self.clip / math.sqrt(group.size)
            norm = float(flat.norm())
            if norm > limit:
                flat.mul_(limit / norm)
        if self.adam is not None:  # Adam in front of the sparsification
            direction = self.adam.update(key, flat * group.size, self.steps + 1)
            flat.copy_(direction).div_(group.size)  # (n,) this rank's share of the mean
        err = self.error_of(key, flat)
        u = None
        if self.momentum > 0:  # momentum correction: accumulate the velocity
            u = self.velocity.get(key)
            if u is None or u.shape != flat.shape:
                u = self.velocity[key] = torch.zeros_like(flat)
            u.mul_(self.momentum).add_(flat)
            corrected = err + u  # (n,) v: the accumulated velocity
        else:
            corrected = flat + err  # (n,) gradient plus what earlier steps did not send
        idx = self.select(corrected, shapes)  # (k,) int64, unique
        k = idx.numel()
        vals = corrected[idx]  # (k,)
        err.copy_(corrected)
        err[idx] = 0  # the unsent remainder
        if u is not None:
            u[idx] = 0  # momentum factor masking: no stale momentum for sent entries
        ib, vb = index_dtype(n), vals.dtype
        parts = [idx.to(ib).view(torch.uint8), vals.contiguous().view(torch.uint8)]
        signs = self.sign_at(self.steps) and bool(sign_residual.matrix_spans(shapes))
        if signs:  # one bit per remaining matrix entry, error-fed
            sign_msg, q = sign_residual.encode(err, idx, shapes, self.sign_scale)
            err.sub_(q)
            parts.append(sign_msg)
        if self.keep_sent:
            self._record_sent(key, corrected - err)
        message = torch.cat(parts)  # bytes: indices, values[, scales and sign bits]
        gathered = comm.all_gather(message, group)  # (N * message,)
        assert isinstance(gathered, torch.Tensor)
        per_rank = gathered.view(group.size, -1)  # (N, message bytes)
        split = k * torch.empty((), dtype=ib).element_size()
        end = split + k * vals.element_size()
        flat.zero_()
        for r in range(group.size):  # rank order: the same sum on every rank
            r_idx = per_rank[r, :split].clone().view(ib).long()  # (k,) (clone: aligned)
            r_val = per_rank[r, split:end].clone().view(vb)  # (k,)
            flat.index_add_(0, r_idx, r_val)  # indices unique within a rank
            if signs:  # (n,) that rank's scaled signs, zero where it sent by top-k
                flat.add_(sign_residual.decode(per_rank[r, end:], r_idx, shapes, flat))
        return _done

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        for k, u in self.velocity.items():
            out[f"velocity/{k}"] = u
        if self.adam is not None:
            out |= self.adam.state_dict()
            out["lr"] = torch.tensor(self.lr, dtype=torch.float64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.velocity = {
            int(k.split("/", 1)[1]): v.clone()
            for k, v in state.items()
            if k.startswith("velocity/")
        }
        if self.adam is not None:
            self.adam.load_state_dict(state)
            self.lr = float(state["lr"]) if "lr" in state else 0.0

    def describe(self) -> str:
        warm = ""
        if self.warmup:
            rho0 = max(self.start_ratio, self.ratio)
            warm = f", warm-up {rho0:g} -> {self.ratio:g} over {self.warmup} steps"
        extra = f", momentum correction {self.momentum:g}" if self.momentum else ""
        extra += ", Adam moments before top-k" if self.adam is not None else ""
        extra += ", one top-k per bucket" if self.scope == "bucket" else ""
        if self.sign_every:
            extra += f", residual signs every {self.sign_every} steps x{self.sign_scale:g}"
        extra += f", local clipping {self.clip:g}" if self.clip else ""
        return f"{super().describe()} (ratio {self.ratio:g}{warm}, error feedback{extra})"
