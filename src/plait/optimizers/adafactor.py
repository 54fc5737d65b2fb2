"""``torch.optim.Adafactor`` on pieces of parameters (ZeRO's flat shards, tp blocks).

Adafactor (Shazeer and Stern 2018, PyTorch's variant) needs, of each whole parameter,
the row and column sums of the squared gradient (two or more dimensions) and two RMS
values (the parameter's before the step, the update's). Each rank computes its piece's
share of them (:mod:`plait.optimizers.factored`) and the shares are added by all-reduces
over the groups whose ranks hold the other pieces, through :mod:`plait.comm`; nothing is
gathered. One step, for every parameter at once:

1. **round 1**: per parameter, the row sums, the column sums and the parameter's squared
   norm, concatenated per set of groups into one vector and all-reduced (one call per
   group): ``R + C + 1`` elements for an ``(R, C)`` matrix, 1 for a vector;
2. every rank advances the row and column factors (whole vectors, identical on every
   rank that holds a piece: ``R + C`` elements per matrix) and the element-wise
   variance of vectors (its piece), then computes its piece of the update;
3. **round 2**: the update's squared norm (1 element per parameter), all-reduced;
4. decay and the update, scaled exactly as torch: ``alpha = max(eps2, RMS(p)) · rho_t``,
   ``p <- p (1 - lr wd) - alpha / max(1, RMS(u) / d) · u``.

Bus bytes of one step over a group of ``n`` ranks: ``2 (n - 1) / n · e · Σ (R_m + C_m +
2)`` over the matrices and ``2 (n - 1) / n · e · 2`` per vector (:func:`reduce_bytes`),
against ZeRO's ``(n - 1) / n · e · Σ R_m C_m`` gradient reduce-scatter: the statistics
are a vector per matrix, which is why they are reduced rather than the matrices gathered
to an owner (Muon's scheme, which needs the whole matrix).

The state has torch.optim.Adafactor's keys and shapes: ``step`` (a scalar),
``row_var`` ``(..., R, 1)`` and ``col_var`` ``(..., 1, C)`` of the whole parameter, and
``variance`` for vectors (the piece's elements), so a checkpoint reshards it between
layouts (whole-parameter state is saved once per piece and read whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.optimizers.closure import run_closure
from plait.optimizers.factored import Held, partial_sums, piece_update, whole_means


def reduce_bytes(held: list[Held], element_size: int) -> dict[str, float]:
    """Bus bytes one step's two all-reduces move, per axis name (every rank's count)."""
    out: dict[str, float] = {}
    for h in held:
        for g in h.groups:
            n = g.size
            out[g.name] = out.get(g.name, 0.0) + 2 * (n - 1) / n * h.stat_numel() * element_size
    return out


Buckets = dict[tuple[int, ...], tuple[tuple[AxisGroup, ...], list[torch.Tensor]]]
"""Tensors to sum, keyed by the ids of the groups they are summed over."""


def _add(buckets: Buckets, h: Held, parts: list[torch.Tensor]) -> tuple[tuple[int, ...], int]:
    """Put ``parts`` in ``h``'s bucket; returns (bucket key, index of the first part)."""
    key = tuple(id(g) for g in h.groups)
    bucket = buckets.setdefault(key, (h.groups, []))[1]
    bucket.extend(parts)
    return key, len(bucket) - len(parts)


def _all_reduce(buckets: Buckets) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Each bucket concatenated, summed over its groups (one all-reduce per group, through
    plait.comm) and split back."""
    out: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for key, (groups, parts) in buckets.items():
        flat = torch.cat([p.reshape(-1) for p in parts])
        for g in groups:
            if g.size > 1:
                comm.all_reduce(flat, g, op="sum")
        out[key] = list(flat.split([p.numel() for p in parts]))
    return out


class ShardedAdafactor(torch.optim.Optimizer):
    """torch.optim.Adafactor over the pieces :attr:`held` describes (its defaults and
    keys; ``foreach`` and ``maximize`` are not taken).

    Args:
        params: param groups of the pieces (each a tensor named by one :class:`Held`'s
            ``key``).
        held: every parameter of the layout, in the same order on every rank of its
            groups (also those this rank holds no piece of: they add zeros).
        lr, beta2_decay, eps, d, weight_decay: torch.optim.Adafactor's.
        dtype, device: of the statistics (the masters'; default: the first piece's).
    """

    def __init__(
        self,
        params: Iterable[Any],
        held: list[Held],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps": eps,
            "d": d,
            "weight_decay": weight_decay,
        }
        torch.optim.Adafactor([torch.zeros(1)], **defaults)  # torch's checks of the values
        super().__init__(params, defaults)
        self.held = held
        """Every parameter's piece (see Args)."""
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        keys = [h.key for h in held if h.key is not None]
        self.dtype = dtype or (keys[0].dtype if keys else torch.get_default_dtype())
        """The statistics' dtype (the same on every rank: they are all-reduced)."""
        self.device = device or (keys[0].device if keys else torch.device("cpu"))
        """Where the statistics live (the pieces' device)."""
        missing = [h for h in held if h.key is not None and id(h.key) not in self._group_of]
        if missing:
            raise ValueError(f"{len(missing)} held pieces are in no param group")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every parameter (see the module docstring)."""
        loss = run_closure(closure)
        first: Buckets = {}
        at1 = [_add(first, h, self._round1(h)) for h in self.held]  # sums, |p|²
        reduced1 = _all_reduce(first)
        second: Buckets = {}
        at2: list[tuple[tuple[int, ...], int]] = []
        updates: list[torch.Tensor | None] = []
        p_sq: list[torch.Tensor] = []
        for h, (key, i) in zip(self.held, at1, strict=True):  # each piece's update; |u|²
            stats = reduced1[key][i : i + (3 if h.factored else 1)]
            u = self._update(h, stats) if self._steps(h) else None
            sq = u.square().sum() if u is not None and h.counts else self._zeros(1)
            at2.append(_add(second, h, [sq.reshape(1)]))
            updates.append(u)
            p_sq.append(stats[-1])
        reduced2 = _all_reduce(second)
        mine = [k for k, u in enumerate(updates) if u is not None]
        scalars = [torch.cat([p_sq[k], reduced2[at2[k][0]][at2[k][1]]]) for k in mine]
        host = torch.cat(scalars).tolist() if scalars else []  # one read per step
        for j, k in enumerate(mine):  # decay and update, scaled as torch scales them
            u = updates[k]
            assert u is not None
            self._apply(self.held[k], u, host[2 * j], host[2 * j + 1])
        return loss

    def _steps(self, h: Held) -> bool:
        """Whether this rank steps a piece of ``h`` (it holds one, with a gradient)."""
        return h.key is not None and h.key.grad is not None

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, device=self.device)

    def _round1(self, h: Held) -> list[torch.Tensor]:
        """This rank's shares of the parameter's statistics (zeros where it holds none
        of it or a replica that does not count)."""
        p = h.key
        if p is None or p.grad is None or not h.counts:
            if not h.factored:
                return [self._zeros(1)]
            row_shape, col_shape = h.stat_shapes()
            return [
                self._zeros(math.prod(row_shape)),
                self._zeros(math.prod(col_shape)),
                self._zeros(1),
            ]
        p_sq = p.detach().reshape(-1).square().sum().reshape(1)
        if not h.factored:
            return [p_sq]
        rows, cols = partial_sums(h, p.grad.reshape(-1))
        return [rows, cols, p_sq]

    def _update(self, h: Held, stats: list[torch.Tensor]) -> torch.Tensor:
        """Advance the piece's state and return its update (before scaling)."""
        p = h.key
        assert p is not None and p.grad is not None
        group = self._group_of[id(p)]
        grad = p.grad.reshape(-1)
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            if h.factored:
                rows = list(h.shape)
                rows[-1] = 1
                cols = list(h.shape)
                cols[-2] = 1
                state["row_var"] = grad.new_zeros(rows)
                state["col_var"] = grad.new_zeros(cols)
            else:
                state["variance"] = torch.zeros_like(p)
        state["step"] += 1
        t = float(state["step"].item())
        one_minus_beta2 = t ** group["beta2_decay"]
        eps1 = group["eps"][0]
        if eps1 is None:
            eps1 = torch.finfo(p.dtype).eps
        if h.factored:
            row_mean, col_mean = whole_means(h, stats[0], stats[1])
            state["row_var"].lerp_(row_mean, one_minus_beta2)
            state["col_var"].lerp_(col_mean, one_minus_beta2)
            return piece_update(h, grad, state["row_var"], state["col_var"], eps1)
        variance = state["variance"].view(-1)
        variance.lerp_(grad * grad, one_minus_beta2)
        return variance.clone().clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)

    def _apply(self, h: Held, update: torch.Tensor, p_sq: float, u_sq: float) -> None:
        """torch's write: ``alpha`` from the parameter's RMS before decay, the decay, the
        update divided by ``max(1, RMS(u) / d)``."""
        p = h.key
        assert p is not None
        group = self._group_of[id(p)]
        lr, eps2 = group["lr"], group["eps"][1]
        t = float(self.state[p]["step"].item())
        rho = min(lr, 1 / (t**0.5))
        alpha = max(eps2, math.sqrt(p_sq) / (h.numel**0.5)) * rho
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        denom = max(1.0, math.sqrt(u_sq) / ((h.numel**0.5) * group["d"]))
        p.view(-1).add_(update, alpha=-alpha / denom)
