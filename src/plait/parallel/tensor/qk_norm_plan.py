"""Tensor-parallel rows and styles of the query/key norms (Qwen3, OLMo 2).

Inside an attention region each tp rank holds whole heads, so

* a norm per head (``qk_norm = "head"``, one gain of ``head_dim`` shared by the heads) is
  kept whole on every rank and its gradient, a partial sum over the rank's heads, is
  summed over tp (style ``replicate_summed``);
* a norm over the whole projection (``qk_norm = "projection"``, one gain per channel)
  is split with its projection (styles ``norm_heads`` for ``q_norm`` as ``wq``,
  ``norm_kv_heads`` for ``k_norm`` as ``wk``, key/value replicas included), and its
  sums of squares are all-reduced over tp in forward and backward
  (:class:`~plait.model.norms.ProjectionRMSNorm`; ``(batch, seq, 1)`` values per norm
  and layer, counted on the tp axis).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from plait.comm.group import AxisGroup
from plait.errors import ConfigError
from plait.model.norms import ProjectionRMSNorm
from plait.parallel.tensor.layers import TPShard, set_shard_info, split_units
from plait.parallel.tensor.sequence import sum_grad_over_tp

if TYPE_CHECKING:
    from plait.parallel.tensor.sharding_plan import Style

QK_NORM_STYLES = ("replicate_summed", "norm_heads", "norm_kv_heads")


def qk_norm_rows(model: nn.Module) -> list[tuple[str, Style]]:
    """The plan rows of the built-in transformer's query/key norms (none without them)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return []
    kind = getattr(getattr(layers[0], "attention", None), "qk_norm", "none")
    if kind == "head":
        return [
            ("layers.*.attention.q_norm", "replicate_summed"),
            ("layers.*.attention.k_norm", "replicate_summed"),
        ]
    if kind == "projection":
        return [
            ("layers.*.attention.q_norm", "norm_heads"),
            ("layers.*.attention.k_norm", "norm_kv_heads"),
        ]
    return []


def apply_qk_norm_style(
    module: nn.Module,
    style: Style,
    group: AxisGroup,
    head_dim: int,
    replica_group: AxisGroup | None,
    name: str,
) -> None:
    """Shard or mark the norm ``module`` in place for ``style`` (see the module docstring)."""
    tp = group.size
    if style == "replicate_summed":
        for p in module.parameters(recurse=False):
            set_shard_info(p, TPShard.replicated(tp))
            if tp > 1:
                sum_grad_over_tp(p, group)
        return
    if not isinstance(module, ProjectionRMSNorm):
        raise ConfigError(f"{name}: style {style!r} needs a ProjectionRMSNorm")
    rep = replica_group.size if replica_group is not None else 1
    width = module.weight.shape[0]
    info = split_units(width, head_dim, tp, rep, False, name)
    module.weight = set_shard_info(nn.Parameter(info.shard(module.weight, group.index)), info)
    if rep > 1 and replica_group is not None:
        sum_grad_over_tp(module.weight, replica_group)
    module.group, module.width, module.replicas = group, width, rep
