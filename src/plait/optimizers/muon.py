"""Muon on the hidden matrices and AdamW on the rest, as one ``torch.optim.Optimizer``.

A param group with ``muon=True`` is stepped by Muon exactly as ``torch.optim.Muon``
steps it (momentum ``B <- mu B + (1 - mu) g`` as a lerp, Nesterov's ``g + mu (B - g)``,
Newton-Schulz orthogonalisation ``O``, decoupled decay ``p <- p (1 - lr wd)``, then
``p <- p - adjust(lr, shape) O``), with the Newton-Schulz dtype a choice
(``ns_dtype``); a 3-D tensor is a stack of expert matrices, each orthogonalised on its
own (``in_out=True``: stored ``(experts, in, out)``, each ``(out, in)`` map is its
transpose). A group with ``muon=False`` is stepped by ``torch.optim.AdamW`` (an inner
instance sharing these groups and this state), so it is bit-equal to AdamW.

Under ZeRO the Muon groups hold flat shard segments, not whole matrices: the ZeRO
wrapper sets :attr:`Muon.matrix_step` to its owner exchange
(:class:`plait.parallel.zero.owners.MatrixOwners`), which gathers each matrix's momentum
update on one rank, calls :func:`orthogonalize` there and scatters the update back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from plait.comm import AxisGroup
from plait.optimizers.closure import run_closure
from plait.optimizers.newton_schulz import NS_COEFFICIENTS, NS_DTYPES, adjust_lr, zeropower

TPLayout = Callable[[torch.Tensor], Any]
"""A parameter's tensor-parallel layout (``plait.parallel.tensor.layers.shard_info``)."""
MatrixStep = Callable[[list[dict[str, Any]]], None]
"""Steps the Muon groups (given the groups; gradients on their params' ``.grad``)."""


@dataclass(frozen=True)
class MuonDefaults:
    """torch.optim.Muon's hyper-parameters (its names and defaults) and the dtype of the
    Newton-Schulz iteration."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str = "original"
    ns_dtype: str = "bfloat16"


def matrix_shape(shape: torch.Size | tuple[int, ...], in_out: bool) -> tuple[int, int]:
    """``(out, in)`` of one matrix of a parameter of ``shape`` (2-D, or a 3-D stack)."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    return (int(shape[2]), int(shape[1])) if in_out else (int(shape[1]), int(shape[2]))


def advance_momentum(grad: torch.Tensor, buf: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Advance the momentum ``buf`` (in place) by ``grad`` and return the matrix to
    orthogonalise: ``g + mu (B - g)`` (Nesterov) or ``B``. Element-wise, so a piece of a
    matrix (a ZeRO shard, a tp block) advances on its own."""
    mu = group["momentum"]
    buf.lerp_(grad, 1 - mu)
    return grad.lerp(buf, mu) if group["nesterov"] else buf


def orthogonalize(
    u: torch.Tensor, group: dict[str, Any], pieces: tuple[Any, AxisGroup] | None = None
) -> tuple[torch.Tensor, float]:
    """The Newton-Schulz orthogonalisation of ``u`` (the parameter's shape; a 3-D stack
    matrix by matrix) in the group's dtype, and the adjusted learning rate.

    ``pieces``: ``u`` is this rank's piece of a tensor-parallel matrix, ``(layout, tp
    group)`` with the layout's ``gather(local, group)`` and ``shard(full, index)``
    (:class:`plait.parallel.tensor.layers.TPShard`): ``u`` is gathered whole over tp
    (counted by plait.comm) and this rank's piece of the result is returned."""
    if pieces is not None:
        layout, tp = pieces
        u = layout.gather(u, tp)  # the whole matrix (stack) on every tp rank
    coeffs, steps, eps = tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]
    dtype = NS_DTYPES[group["ns_dtype"]]
    in_out = group["in_out"]
    if u.ndim == 2:
        o = zeropower(u, coeffs, steps, eps, dtype)
    else:  # (experts, ., .): each expert's (out, in) matrix on its own
        mats = [m.T if in_out else m for m in u.unbind(0)]
        outs = [zeropower(m, coeffs, steps, eps, dtype) for m in mats]
        o = torch.stack([m.T if in_out else m for m in outs])
    lr_adj = adjust_lr(group["lr"], group["adjust_lr_fn"], matrix_shape(u.shape, in_out))
    if pieces is not None:
        o = pieces[0].shard(o, pieces[1].index)
    return o, lr_adj


def apply_update(p: torch.Tensor, o: torch.Tensor, lr: float, wd: float, lr_adj: float) -> None:
    """torch.optim.Muon's write: decoupled decay, then the update (``p`` and ``o`` the
    same shape; a piece of each under ZeRO)."""
    p.mul_(1 - lr * wd)
    p.add_(o, alpha=-lr_adj)


class Muon(torch.optim.Optimizer):
    """Muon groups (``muon=True``) and AdamW groups (``muon=False``) in one optimizer.

    Args:
        params: param groups; an AdamW group must set ``lr`` and ``weight_decay`` (the
            defaults below are Muon's).
        lr ... ns_dtype: Muon's defaults (:class:`MuonDefaults`).
        betas, adamw_eps: AdamW's, for the AdamW groups that do not set them.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str = "original",
        ns_dtype: str = "bfloat16",
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {sorted(NS_DTYPES)}, got {ns_dtype!r}")
        adjust_lr(1.0, adjust_lr_fn, (1, 1))  # refuses an unknown adjustment
        groups = [dict(g) for g in params]
        for g in groups:
            if not g.get("muon", True):  # AdamW's keys where Muon's default would leak
                g.setdefault("eps", adamw_eps)
                g.setdefault("betas", betas)
                missing = {"lr", "weight_decay"} - g.keys()
                if missing:
                    raise ValueError(f"an AdamW group of Muon must set {sorted(missing)}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
            "muon": True,
            "in_out": False,
        }
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["muon"]:
                for p in g["params"]:
                    if p.ndim not in (2, 3) and not g.get("sharded", False):
                        raise ValueError(f"Muon steps 2-D matrices (or 3-D stacks), got {p.shape}")
        adam_groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw: torch.optim.AdamW | None = None
        if adam_groups:
            self._adamw = torch.optim.AdamW([{"params": g["params"]} for g in adam_groups])
            for g in adam_groups:  # AdamW's remaining defaults into the shared groups
                for k, v in self._adamw.defaults.items():
                    g.setdefault(k, v)
            self._adamw.param_groups = adam_groups
            self._adamw.state = self.state
        self.matrix_step: MatrixStep | None = None
        """Steps the Muon groups elsewhere (ZeRO's owner exchange); None: here."""
        self.tp: tuple[TPLayout, AxisGroup] | None = None
        """Tensor parallelism: (a parameter's layout or None, the tp group); a matrix
        cut over tp is gathered whole before Newton-Schulz (:func:`orthogonalize`)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every group (see the module docstring)."""
        loss = run_closure(closure)
        if self._adamw is not None:
            self._adamw.step()
        muon_groups = [g for g in self.param_groups if g["muon"]]
        if self.matrix_step is not None:
            self.matrix_step(muon_groups)
            return loss
        for group in muon_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                u = advance_momentum(p.grad, state["momentum_buffer"], group)
                o, lr_adj = orthogonalize(u, group, self.pieces_of(p))
                apply_update(p, o, group["lr"], group["weight_decay"], lr_adj)
        return loss

    def pieces_of(self, p: torch.Tensor) -> tuple[Any, AxisGroup] | None:
        """``(layout, tp group)`` of a parameter cut over tensor parallelism; else None."""
        if self.tp is None:
            return None
        layout = self.tp[0](p)
        return (layout, self.tp[1]) if layout is not None and layout.dim is not None else None
