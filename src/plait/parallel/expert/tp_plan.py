"""The tensor-parallel plan of the built-in transformer with MoE layers.

Attention and the dense feed-forwards are split as in
:data:`~plait.parallel.tensor.sharding_plan.TRANSFORMER_TP_PLAN`; of an MoE layer the router and
the routed experts stay whole on every tp rank (``replicate``: the tp ranks hold the
same tokens and compute the same routing, so expert parallelism and its all-to-all are
unchanged by tp), and the shared experts are one tensor-parallel SwiGLU region like a
dense feed-forward. Under sequence parallelism the MoE layer is no region: each tp rank
routes its own sequence shard (the tp ranks then split the tokens like data ranks: the
ep group of a rank is at its tp index, the router's and experts' gradients are summed
over tp as any ``replicate`` weight's under SP, the load-balancing counts over dp x cp x
tp), and only the shared experts gather the sequence (their region). Qwen2-MoE's
shared-expert gate (``(1, dim)``, a per-token scalar times the shared output) is
``replicate`` like the router: outside the region, on the tokens the router sees.
"""

from __future__ import annotations

from torch import nn

from plait.errors import ConfigError
from plait.model.moe import MoE
from plait.parallel.tensor.qk_norm_plan import qk_norm_rows
from plait.parallel.tensor.sharding_plan import TRANSFORMER_TP_PLAN, ShardingPlan, Style


def moe_tp_plan(model: nn.Module) -> ShardingPlan | None:
    """The plan for plait's Transformer with MoE layers (None: no MoE layer, or the
    model brings its own ``plait_tp_plan``)."""
    if getattr(model, "plait_tp_plan", None) is not None:
        return None
    moes = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    if not moes:
        return None
    plan: list[tuple[str, Style]] = [
        row for row in TRANSFORMER_TP_PLAN if not row[0].startswith("layers.*.feed_forward")
    ] + qk_norm_rows(model)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"tensor parallelism of {type(model).__name__}: its MoE layers "
            f"({', '.join(moes)}) are not in the built-in transformer's `layers` list, so "
            "plait has no plan for it; give the model a `plait_tp_plan` (name pattern, "
            "style) list (or pass tp_plan= to parallelize), or run it with parallel.tp=1."
        )
    for i in range(len(layers)):
        ff = f"layers.{i}.feed_forward"
        moe = moes.get(ff)
        if moe is None:
            plan += [
                (ff, "region"),
                (f"{ff}.w1", "colwise"),
                (f"{ff}.w3", "colwise"),
                (f"{ff}.w2", "rowwise"),
            ]
            continue
        plan += [(f"{ff}.router.gate", "replicate"), (f"{ff}.experts", "replicate")]
        if moe.shared is not None:
            plan += [
                (f"{ff}.shared", "region"),
                (f"{ff}.shared.w1", "colwise"),
                (f"{ff}.shared.w3", "colwise"),
                (f"{ff}.shared.w2", "rowwise"),
            ]
        if moe.shared_gate is not None:  # a per-token scalar outside the region
            plan.append((f"{ff}.shared_gate", "replicate"))
    return plan
