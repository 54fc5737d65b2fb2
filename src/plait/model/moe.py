"""A mixture-of-experts feed-forward for one device: router, stacked experts, losses.

:class:`MoE` replaces a block's SwiGLU feed-forward when ``model.moe_experts`` > 0 and
the layer index matches ``model.moe_every`` (:func:`is_moe_layer`). For the ``T``
tokens of a call (``x`` ``(batch, seq, dim)`` flattened to ``(T, dim)``):

1. **route** (:class:`Router`): logits ``(T, E)``; softmax over all experts (or sigmoid)
   scores; the top-k experts of each token and their weights (renormalised to sum 1
   with ``model.moe_norm_topk_prob``, as Mixtral and Qwen-MoE's ``norm_topk_prob``;
   else the raw scores: with k = 1, Switch's router);
2. **permute**: the ``T·k`` (token, expert) assignments sorted by expert, top-1 choices
   before top-2 and then by token index inside each expert (the priority order a
   capacity factor drops in: the overflow of an expert is the end of its run);
3. **experts** (:class:`Experts`, weights stacked ``(E, dim, hidden)``): each expert's
   SwiGLU on its run of rows. How the runs reach the experts is the ``dispatcher``'s
   job: on one device they are here already (:class:`LocalDispatch`); expert
   parallelism replaces it from outside with an all-to-all (``plait.parallel.expert``);
4. **combine**: each row times its weight, summed back into its token;
5. **losses**: the Switch/GShard load-balancing loss ``E · Σ_i f_i · P_i`` (f_i the
   fraction of assignments routed to expert i, before any drop; P_i the mean router
   probability of i) and the router z-loss ``mean_t logsumexp(logits_t)²``. Their
   weighted sum enters the training loss through :class:`AttachAux` (the forward returns
   the block output unchanged; backward adds the losses' gradient), so any loss
   function and the pipeline need no change. Each call's losses, the expert loads and
   the dropped assignments are kept in :attr:`MoE.stats`. With
   ``model.moe_aux_loss_scope = "model"`` the load-balancing loss is instead one loss
   over every MoE layer of the model, ``transformers``' (:mod:`plait.model.moe_aux`).

The shared experts (``model.moe_shared_experts``) add their SwiGLU to every token,
scaled per token by ``sigmoid(x · w_gate)`` with ``model.moe_shared_expert_gate``
(Qwen2-MoE's ``shared_expert_gate``, ``(1, dim)``).

Under data parallelism the counts behind ``f`` are summed over the data ranks (the
dispatcher's ``global_counts``) while ``P`` stays rank-local: the mean over ranks of the
rank losses is then exactly the loss of the global batch, and so are the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.config.model import expert_hidden_dim as expert_hidden_dim  # re-exported
from plait.config.model import is_moe_layer as is_moe_layer
from plait.model.moe_aux import ModelAuxShare, model_aux_term


@dataclass
class MoEStats:
    """What one MoE call measured (detached; the last call of the module)."""

    aux_loss: torch.Tensor
    """() the load-balancing loss of this rank's tokens (its mean over the data ranks
    is the global batch's); scope 'model': this layer's alone, ``E · Σ_i F_i · P_i`` of
    its own counts (the model's is its :class:`~plait.model.moe_aux.ModelAuxShare`'s)."""
    z_loss: torch.Tensor
    """() the router z-loss of this rank's tokens."""
    load: torch.Tensor
    """(E,) assignments per expert over the data ranks (before drops)."""
    dropped: int
    """Assignments of this rank dropped by the capacity factor."""


class AttachAux(torch.autograd.Function):
    """``forward(out, aux, scale)`` returns ``out``; backward passes ``out``'s gradient
    through and gives ``aux`` the gradient ``scale`` (the factor the training loss was
    multiplied by: loss scale / micro-batches), so ``aux`` is added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[no-untyped-def]
        g = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, g, None


class Router(nn.Module):
    """Top-k router: ``gate`` ``(E, dim)``; ``kind`` softmax or sigmoid; ``norm_topk``:
    the k weights renormalised to sum 1."""

    def __init__(
        self, dim: int, experts: int, top_k: int, kind: str, norm_topk: bool = True
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.top_k = top_k
        self.kind = kind
        self.norm_topk = norm_topk

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(T, dim)`` -> (logits ``(T, E)``, probabilities ``(T, E)`` for the
        aux loss, expert ids ``(T, k)``, weights ``(T, k)``)."""
        logits = self.gate(x)
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()  # routing decisions in at least fp32
        if self.kind == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        top, ids = scores.topk(self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        return logits, probs, ids, top


class Experts(nn.Module):
    """``E`` SwiGLU experts with stacked weights ``w1``/``w3`` ``(E, dim, hidden)`` and
    ``w2`` ``(E, hidden, dim)``; expert parallelism keeps a slice ``(E/ep, ...)``."""

    grouped: bool = False
    """True: one padded batched matmul over the experts instead of a loop (see
    benchmarks/moe.py for which is faster)."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` ``(N, dim)``: the rows of expert 0, then expert 1, ... (``counts[e]``
        rows each, for every local expert) -> ``(N, dim)``. Every expert runs, also on
        zero rows, so each weight gets a gradient (zeros) on every rank."""
        if self.grouped:
            return self._padded(x, counts)
        outs = []
        start = 0
        for e, c in enumerate(counts):
            seg = x[start : start + c]  # (c, dim)
            h = F.silu(seg @ self.w1[e]) * (seg @ self.w3[e])  # (c, hidden)
            outs.append(h @ self.w2[e])  # (c, dim)
            start += c
        return torch.cat(outs) if outs else x[:0]

    def _padded(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The same as the loop through one ``bmm`` per weight on rows padded to the
        largest count: ``(E_local, max, dim)``."""
        n_exp, width = len(counts), max(counts) if counts else 0
        cnt = torch.tensor(counts, device=x.device)
        starts = torch.cumsum(cnt, 0) - cnt  # (E_local,)
        expert = torch.repeat_interleave(torch.arange(n_exp, device=x.device), cnt)  # (N,)
        slot = torch.arange(x.shape[0], device=x.device) - starts[expert]  # (N,)
        padded = x.new_zeros(n_exp, width, x.shape[1])
        padded = padded.index_put((expert, slot), x)  # (E_local, max, dim)
        h = F.silu(torch.bmm(padded, self.w1)) * torch.bmm(padded, self.w3)
        y = torch.bmm(h, self.w2)  # (E_local, max, dim)
        return y[expert, slot]


class LocalDispatch(nn.Module):
    """One device: the rows are already with their experts; the counts are global."""

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``(E,)`` assignments per expert summed over the data ranks (here: as given)."""
        return counts

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """``x`` ``(N, dim)`` sorted by expert, ``counts`` ``(E,)`` -> ``(N, dim)``."""
        return experts(x, [int(c) for c in counts.tolist()])


class SharedExperts(nn.Module):
    """Always-on experts: one SwiGLU of width ``shared · hidden`` applied to every token."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim)`` -> ``(..., dim)``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def capacity(tokens: int, cfg_factor: float, top_k: int, experts: int) -> int | None:
    """Rows one expert takes from one rank's ``tokens`` (None: dropless)."""
    if cfg_factor <= 0:
        return None
    return math.ceil(cfg_factor * tokens * top_k / experts)


class MoE(nn.Module):
    """The mixture-of-experts feed-forward (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.moe_experts
        self.top_k = cfg.moe_top_k
        self.aux_coef = cfg.moe_aux_loss_coef
        self.z_coef = cfg.moe_z_loss_coef
        self.capacity_factor = cfg.moe_capacity_factor
        hidden = expert_hidden_dim(cfg)
        self.router = Router(
            cfg.dim, cfg.moe_experts, cfg.moe_top_k, cfg.moe_router, cfg.moe_norm_topk_prob
        )
        self.experts = Experts(cfg.moe_experts, cfg.dim, hidden)
        self.shared: SharedExperts | None = None
        if cfg.moe_shared_experts > 0:
            self.shared = SharedExperts(cfg.dim, cfg.moe_shared_experts * hidden)
        self.shared_gate: nn.Linear | None = None
        """Qwen2-MoE's ``(1, dim)`` gate: the shared output times ``sigmoid(x · w)``
        (outside the shared experts' tensor-parallel region: a per-token scalar)."""
        if cfg.moe_shared_expert_gate:
            self.shared_gate = nn.Linear(cfg.dim, 1, bias=False)
        self.aux_scope = cfg.moe_aux_loss_scope
        self.aux_share: ModelAuxShare | None = None
        """The model's shared routing counts (scope 'model'; set by
        :func:`~plait.model.moe_aux.link_model_aux`, or a model of this layer alone)."""
        self.aux_index = 0
        self.dispatcher: LocalDispatch = LocalDispatch()
        self.grad_scale = 1.0
        """The factor the training loss is multiplied by before backward (set by
        ``ParallelModel.step``: loss scale / micro-batches); the aux losses get it too."""
        self.stats: MoEStats | None = None

    def route(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``x`` ``(T, dim)`` -> (sorted rows' token ids ``(N,)``, their weights ``(N,)``,
        rows per expert ``(E,)`` after drops, assignments per expert ``(E,)`` before
        drops, the router's aux term ``()``, dropped count)."""
        t, e, k = x.shape[0], self.n_experts, self.top_k
        logits, probs, ids, weights = self.router(x)
        flat_e = ids.t().reshape(-1)  # (k*T,) slot-major: top-1 choices first
        flat_w = weights.t().reshape(-1)  # (k*T,)
        order = torch.argsort(flat_e, stable=True)  # by expert, then slot, then token
        sorted_e = flat_e[order]
        counts = torch.bincount(flat_e, minlength=e)  # (E,) before drops
        cap = capacity(t, self.capacity_factor, k, e)
        dropped = 0
        kept_counts = counts
        if cap is not None:
            starts = torch.cumsum(counts, 0) - counts  # (E,)
            rank_in_expert = torch.arange(order.numel(), device=x.device) - starts[sorted_e]
            keep = rank_in_expert < cap
            dropped = int((~keep).sum())
            order = order[keep]
            kept_counts = counts.clamp(max=cap)
        token = order % t  # (N,)
        glob = self.dispatcher.global_counts(counts.to(probs.dtype))  # (E,) over data ranks
        f = glob / glob.sum()  # fraction of assignments per expert
        p_mean = probs.mean(0)  # (E,) mean router probability
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        if self.aux_scope == "model":
            if self.aux_share is None:  # a layer alone is its own model
                self.aux_share = ModelAuxShare(1, e)
            per_token = k * f.detach()  # (E,) assignments per token, sums to k
            aux = e * (per_token * p_mean).sum()  # this layer alone, as transformers'
            aux_term = model_aux_term(self.aux_share, self.aux_index, per_token, p_mean)
        else:
            aux = aux_term = e * (f.detach() * p_mean).sum()
        self.stats = MoEStats(aux.detach(), z.detach(), glob.detach(), dropped)
        term = self.aux_coef * aux_term + self.z_coef * z
        return token, flat_w[order], kept_counts, counts, term, dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, dim)`` -> ``(batch, seq, dim)``."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, dim)
        token, weight, kept, _, term, _ = self.route(flat)
        rows = flat[token]  # (N, dim) grouped by expert
        y = self.dispatcher(rows, kept, self.experts)  # (N, dim)
        y = y * weight.to(y.dtype)[:, None]
        out = torch.zeros_like(flat).index_add_(0, token, y)  # (T, dim)
        if self.shared is not None:  # on (batch, seq, dim): a sequence-parallel region
            shared = self.shared(x)  # (batch, seq, dim)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared  # (batch, seq, 1) gate
            out = out + shared.reshape(flat.shape)
        out = out.view(shape)
        if self.aux_coef or self.z_coef:
            out = AttachAux.apply(out, term, self.grad_scale)
        return out
