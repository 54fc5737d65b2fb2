"""The model-wide load-balancing loss of transformers' MoE families (Mixtral, Qwen-MoE).

``model.moe_aux_loss_scope = "model"`` replaces each MoE layer's own Switch loss by the
one ``transformers``' ``load_balancing_loss_func`` computes over the router logits of
every MoE layer together: with ``L`` MoE layers of ``T`` tokens each, ``c_li`` the
top-k assignments of layer ``l`` to expert ``i`` and ``p_lti`` its router probabilities,

    F_i = Σ_l c_li / (L·T)          (assignments per token; Σ_i F_i = k)
    P_i = Σ_l Σ_t p_lti / (L·T)     (mean probability)
    loss = E · Σ_i F_i · P_i

``F`` carries no gradient (top-k counts), so the loss is linear in each layer's mean
probabilities ``P_l = Σ_t p_lti / T``: its gradient with respect to ``P_l`` is
``E · F / L``, which needs every layer's counts. Each layer records its ``F_l`` (and a
detached ``P_l``) in one :class:`ModelAuxShare` per model during forward; its
:class:`ModelAuxTerm` reads the complete ``F`` in backward, when every layer has run
(recomputed layers record the same counts again). Under data parallelism the counts are
the data ranks' sum (the dispatcher's ``global_counts``) and ``P_l`` stays rank-local,
so the mean over ranks of the rank losses is the global batch's loss, as for the
per-layer loss. A pipeline would hold the layers on different stages with several
micro-batches in flight: refused there (:func:`~plait.config.rules.model.
check_moe_aux_scope`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class ModelAuxShare:
    """The routing counts of one model's ``layers`` MoE layers for the current forward."""

    def __init__(self, layers: int, experts: int) -> None:
        self.layers = layers
        self.experts = experts
        self.counts: dict[int, torch.Tensor] = {}
        """MoE layer index -> ``(E,)`` its assignments per token ``c_l / T`` (detached)."""
        self.probs: dict[int, torch.Tensor] = {}
        """MoE layer index -> ``(E,)`` its mean router probabilities (detached)."""

    def record(self, index: int, per_token: torch.Tensor, probs: torch.Tensor) -> None:
        """Layer ``index``'s counts per token and mean probabilities (this forward)."""
        self.counts[index] = per_token.detach()
        self.probs[index] = probs.detach()

    def per_token(self) -> torch.Tensor:
        """``(E,)`` ``F``: the assignments per token over every MoE layer."""
        if len(self.counts) != self.layers:
            raise RuntimeError(
                f"the model-wide load-balancing loss needs the routing of all {self.layers} "
                f"MoE layers before backward, but only {sorted(self.counts)} ran (a model "
                "split into pipeline stages, or MoE layers skipped in forward?)"
            )
        return torch.stack([self.counts[i] for i in range(self.layers)]).mean(0)

    def loss(self) -> torch.Tensor:
        """``()`` the loss ``E · Σ_i F_i · P_i`` of the last forward (this rank's ``P``)."""
        p = torch.stack([self.probs[i] for i in range(self.layers)]).mean(0)
        return self.experts * (self.per_token() * p).sum()


class ModelAuxTerm(torch.autograd.Function):
    """``forward(probs, share, index)``: ``probs`` ``(E,)`` layer ``index``'s mean router
    probabilities -> ``()`` its part of the model loss with its own counts,
    ``E/L · Σ_i F_li · P_li``; backward gives ``probs`` the model loss's gradient
    ``E · F / L`` (``F`` over every layer, complete by then)."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, share: ModelAuxShare, index: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        ctx.share = share
        scale = share.experts / share.layers
        return scale * (share.counts[index].to(probs.dtype) * probs).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[no-untyped-def]
        share: ModelAuxShare = ctx.share
        f = share.per_token().to(grad.dtype)
        return grad * (share.experts / share.layers) * f, None, None


@torch.compiler.disable  # the share is Python state: recorded and read eagerly
def model_aux_term(
    share: ModelAuxShare, index: int, per_token: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    """Record layer ``index``'s counts per token ``(E,)`` and mean probabilities
    ``probs`` ``(E,)`` in ``share``; return its :class:`ModelAuxTerm` ``()``."""
    share.record(index, per_token, probs)
    out: torch.Tensor = ModelAuxTerm.apply(probs, share, index)
    return out


def link_model_aux(moes: Iterable[object]) -> ModelAuxShare | None:
    """Give the MoE layers among ``moes`` (a model's feed-forwards, in order; others are
    skipped) one shared :class:`ModelAuxShare` when their scope is 'model' (None:
    'layer', nothing done)."""
    layers = [m for m in moes if getattr(m, "aux_scope", "layer") == "model"]
    if not layers:
        return None
    share = ModelAuxShare(len(layers), int(getattr(layers[0], "n_experts")))  # noqa: B009
    for i, m in enumerate(layers):
        setattr(m, "aux_share", share)  # noqa: B010
        setattr(m, "aux_index", i)  # noqa: B010
    return share
