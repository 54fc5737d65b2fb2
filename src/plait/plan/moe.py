"""The planner's mixture-of-experts terms: expert memory per rank, all-to-all traffic and
time per layer, active vs total parameters and FLOPs. Pure arithmetic, no torch.

An MoE model is a dense :class:`~plait.plan.modelspec.ModelSpec` whose feed-forward, on
``moe_layers`` of its layers, is replaced by a router ``(E, h)``, ``E`` routed experts
of width ``f_e`` (each a SwiGLU: ``3·h·f_e`` weights) of which a token uses ``k``, and
``s`` shared experts. Under expert parallelism of degree ``ep`` (a sub-axis of the
dp x cp ranks) a rank holds ``E/ep`` routed experts of each MoE layer, whole (tp does not
split them), with their gradients and optimizer state; everything else is as dense.

Traffic (what :mod:`plait.parallel.expert.dispatch` moves and ``plait.comm`` counts,
checked by the tests): a rank routes ``T·k`` rows of ``h`` values per MoE layer; with a
balanced router a fraction ``(ep-1)/ep`` of them leaves the rank on dispatch and as many
come back on combine, and backward repeats both, so per layer and step a rank sends
``4 · (ep-1)/ep · T·k·h·b`` bytes plus ``(ep-1)/ep · E · 8`` bytes of counts. The time is
the alpha-beta cost on the link the ep group spans (intra-node while it fits one node).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.arch import mlp_params, moe_ffn_params
from plait.config import ModelConfig
from plait.config.model import expert_hidden_dim, is_moe_layer
from plait.errors import ConfigError


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of a model's shape."""

    hidden: int
    """h: model width."""
    experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """k: routed experts per token."""
    expert_hidden: int
    """f_e: one expert's SwiGLU width."""
    shared: int
    """s: always-on experts."""
    moe_layers: int
    """MoE layers of the model."""
    dense_hidden: int
    """f: the dense feed-forward width (of the other layers)."""
    n_layers: int
    """L: all layers."""
    shared_gate: bool = False
    """Whether the shared experts have a ``(1, h)`` gate (Qwen2-MoE)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(
                f"top-k {self.top_k} must be between 1 and the {self.experts} experts."
            )

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MoESpec | None:
        """The MoE shape of a model config (None: dense)."""
        if cfg.moe_experts == 0:
            return None
        hidden = expert_hidden_dim(cfg)
        layers = sum(1 for i in range(cfg.n_layers) if is_moe_layer(cfg, i))
        return cls(
            cfg.dim,
            cfg.moe_experts,
            cfg.moe_top_k,
            hidden,
            cfg.moe_shared_experts,
            layers,
            cfg.hidden_dim,
            cfg.n_layers,
            cfg.moe_shared_expert_gate,
        )

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert."""
        return mlp_params(self.hidden, self.expert_hidden)

    @property
    def routed_params(self) -> int:
        """Routed-expert weights of the whole model (what ep splits)."""
        return self.moe_layers * self.experts * self.expert_params

    def params_delta(self, active: bool) -> int:
        """Parameters of the MoE model minus those of the dense model of the same
        shape: per MoE layer router, shared and routed experts (``active``: k of them)
        instead of the dense SwiGLU."""
        routed = self.top_k if active else self.experts
        moe = moe_ffn_params(
            self.hidden, self.experts, self.expert_hidden, self.shared, routed, self.shared_gate
        )
        return self.moe_layers * (moe - mlp_params(self.hidden, self.dense_hidden))

    def flops_delta_per_token(self) -> float:
        """Training FLOPs per token of the MoE model minus the dense one: ``6 x`` the
        active weights' difference (MFU counts active parameters)."""
        return 6.0 * self.params_delta(active=True)

    def a2a_bytes_per_layer(self, tokens: int, ep: int, dtype_bytes: int) -> float:
        """Bytes one rank sends on the ep axis for one MoE layer in a training step over
        ``tokens`` tokens, with a balanced router (see the module docstring)."""
        if ep == 1:
            return 0.0
        away = (ep - 1) / ep
        return (
            4.0 * away * tokens * self.top_k * self.hidden * dtype_bytes + away * self.experts * 8
        )

    def a2a_seconds_per_layer(
        self, tokens: int, ep: int, dtype_bytes: int, latency_s: float, bandwidth: float
    ) -> float:
        """The alpha-beta time of one layer's all-to-alls: 5 calls (counts, dispatch and
        combine forward and backward), each ``ep - 1`` messages deep."""
        if ep == 1:
            return 0.0
        return (
            5 * (ep - 1) * latency_s + self.a2a_bytes_per_layer(tokens, ep, dtype_bytes) / bandwidth
        )


def format_ep_table(rows: list[tuple[int, float, float, float]]) -> str:
    """``(ep, expert bytes per rank, all-to-all bytes per step, all-to-all seconds per
    step)`` rows (:func:`plait.plan.moe_estimate.ep_row`) as a small text table."""
    lines = ["  ep   experts GB/rank   all-to-all MB/step   all-to-all ms/step"]
    for ep, mem, traffic, secs in rows:
        lines.append(f"  {ep:<4} {mem / 1e9:>15.3f} {traffic / 1e6:>20.2f} {secs * 1e3:>20.3f}")
    return "\n".join(lines)
