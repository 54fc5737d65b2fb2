"""Tensor-parallel sharding plans as data, applied to a one-device model from outside.

A sharding plan (not to be confused with the planner, :mod:`plait.plan`) is a table of
``(module-name pattern, style)`` rows. A pattern matches a dotted module name segment by
segment (``*`` matches one segment: ``layers.*.attention.wq``).
Styles (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism):

=================  ==============================================================
style              what happens to the matched module
=================  ==============================================================
colwise            :class:`ColumnParallelLinear` inside a region (no entrance)
colwise_heads      the same, split by whole attention heads (``head_dim`` rows)
colwise_kv_heads   by whole key/value heads; when there are fewer KV heads than tp
                   ranks (tp divisible by them), each KV head is *replicated* on
                   tp/kv consecutive ranks, whose weight gradients are summed
rowwise            :class:`RowParallelLinear`; its output leaves the region
rowwise_heads      the same, its input split by whole heads
vocab_embedding    :class:`VocabParallelEmbedding` (padded vocabulary)
vocab_head         :class:`ColumnParallelLinear` over the padded vocabulary that
                   enters a region and keeps its logits sharded (use
                   :func:`plait.parallel.tensor.loss.vocab_parallel_loss`); shares the
                   embedding's shard when the one-device model ties the two
region             the module's first input enters a tensor-parallel region
                   (``f``, or the sequence all-gather)
replicate          parameters kept whole; under sequence parallelism their
                   gradients are summed over tp (each rank saw a sequence shard)
replicate_summed   kept whole inside a head-split region: gradients always summed
                   over tp (a per-head q/k norm)
norm_heads         a q norm over the whole projection, split with ``wq``; its sums
                   of squares all-reduced over tp
norm_kv_heads      the same for the k norm, split (or replicated) with ``wk``
=================  ==============================================================

The last three are :mod:`plait.parallel.tensor.qk_norm_plan`'s.

Every parameter of the model must be covered by a parameter style. All checks (heads,
KV heads, MLP width divisible by tp; every pattern matching) run before any process
group is created or anything is sent, and fail with :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from plait.comm.group import AxisGroup
from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.parallel.tensor.hf_llama_sharding_plan import hf_tp_plan, is_hf_llama
from plait.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
    VocabParallelEmbedding,
    set_shard_info,
    shard_info,
    split_units,
)
from plait.parallel.tensor.qk_norm_plan import QK_NORM_STYLES, apply_qk_norm_style, qk_norm_rows
from plait.parallel.tensor.sequence import (
    check_sequence_length,
    enter_region,
    mark_sequence_parallel,
)

Style = Literal[
    "colwise",
    "colwise_heads",
    "colwise_kv_heads",
    "rowwise",
    "rowwise_heads",
    "vocab_embedding",
    "vocab_head",
    "region",
    "replicate",
    "replicate_summed",
    "norm_heads",
    "norm_kv_heads",
]
ShardingPlan = Sequence[tuple[str, Style]]

TRANSFORMER_TP_PLAN: tuple[tuple[str, Style], ...] = (
    ("tok_embeddings", "vocab_embedding"),
    ("layers.*.attention_norm", "replicate"),
    ("layers.*.attention", "region"),
    ("layers.*.attention.wq", "colwise_heads"),
    ("layers.*.attention.wk", "colwise_kv_heads"),
    ("layers.*.attention.wv", "colwise_kv_heads"),
    ("layers.*.attention.wo", "rowwise_heads"),
    ("layers.*.ffn_norm", "replicate"),
    ("layers.*.feed_forward", "region"),
    ("layers.*.feed_forward.w1", "colwise"),
    ("layers.*.feed_forward.w3", "colwise"),
    ("layers.*.feed_forward.w2", "rowwise"),
    ("norm", "replicate"),
    ("output", "vocab_head"),
)
"""The plan of :class:`plait.model.Transformer`: per block one region for attention
(Q, K, V column-parallel by heads, output row-parallel) and one for the SwiGLU MLP
(gate/up column-parallel, down row-parallel), norms replicated, embedding and head
vocabulary-parallel."""

_HEAD_STYLES = ("colwise_heads", "colwise_kv_heads", "rowwise_heads")


def default_sharding_plan(model: nn.Module) -> ShardingPlan:
    """The plan used when none is passed: the model's own ``plait_tp_plan`` attribute
    (a factory may attach one), :data:`~plait.parallel.tensor.hf_llama_sharding_plan.
    HF_LLAMA_TP_PLAN` for a Hugging Face Llama, else :data:`TRANSFORMER_TP_PLAN`."""
    own = getattr(model, "plait_tp_plan", None)
    if own is not None:
        return tuple(own)
    if is_hf_llama(model):
        return hf_tp_plan(model)
    rows = [*qk_norm_rows(model), *post_norm_rows(model)]
    return (*TRANSFORMER_TP_PLAN, *rows) if rows else TRANSFORMER_TP_PLAN


def post_norm_rows(model: nn.Module) -> list[tuple[str, Style]]:
    """The rows of the sandwich blocks' post-sublayer norms (Gemma), replicated as the
    others (under sequence parallelism they see the sequence shard)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return []
    if getattr(layers[0], "post_attention_norm", None) is None:
        return []
    return [
        ("layers.*.post_attention_norm", "replicate"),
        ("layers.*.post_ffn_norm", "replicate"),
    ]


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a == "*" or a == b for a, b in zip(p, n, strict=True))


def resolve_sharding_plan(model: nn.Module, plan: ShardingPlan) -> dict[str, Style]:
    """``{module name: style}`` for every module the plan names (first match wins).

    Raises :class:`ConfigError` for a pattern that matches nothing, an unknown style, or
    a parameter whose module no parameter style covers.
    """
    known = set(Style.__args__)  # type: ignore[attr-defined]
    out: dict[str, Style] = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan:
        if style not in known:
            raise ConfigError(f"tensor-parallel plan: unknown style {style!r} for {pattern!r}")
        hits = [n for n in names if _matches(pattern, n)]
        if not hits:
            raise ConfigError(
                f"tensor-parallel plan: {pattern!r} matches no module of the model "
                f"({type(model).__name__}); the default plans are for plait's Transformer "
                "and Hugging Face Llama. Pass parallelize(..., tp_plan=[(module pattern, "
                "style), ...]) or set the model's plait_tp_plan attribute, or use tp = 1."
            )
        for n in hits:
            out.setdefault(n, style)
    missing = [
        f"{mod}.{pn}" if mod else pn
        for mod, m in model.named_modules()
        for pn, _ in m.named_parameters(recurse=False)
        if out.get(mod, "region") == "region"
    ]
    if missing:
        raise ConfigError(
            f"tensor-parallel plan leaves {len(missing)} parameter(s) without a style: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; add a row for "
            "their modules (e.g. 'replicate')"
        )
    return out


def vocab_size_of(model: nn.Module, plan: ShardingPlan | None = None) -> int:
    """The vocabulary size of ``model``'s head: the output features of the module the
    plan (default :func:`default_sharding_plan`) marks ``vocab_head``. Call it before
    :func:`apply_tensor_parallel` (whose loss needs it); raises :class:`ConfigError`
    when the plan has no vocabulary head."""
    styles = resolve_sharding_plan(model, default_sharding_plan(model) if plan is None else plan)
    heads = [n for n, s in styles.items() if s == "vocab_head"]
    if not heads:
        raise ConfigError(
            "tensor-parallel plan: no module is styled 'vocab_head', so the loss of the "
            "vocabulary-sharded logits is unknown; pass parallelize(..., loss_fn=...)"
        )
    out = getattr(model.get_submodule(heads[0]), "out_features", None)
    if not isinstance(out, int):
        raise ConfigError(f"tensor-parallel plan: {heads[0]} has no integer out_features")
    return out


def _head_dim(model: nn.Module, name: str) -> int:
    parent = model.get_submodule(name.rpartition(".")[0])
    hd = getattr(parent, "head_dim", None)
    if not isinstance(hd, int):
        raise ConfigError(
            f"tensor-parallel plan: {name} is split by heads but its parent "
            "module has no integer attribute 'head_dim'"
        )
    return hd


def _kv_replicas(kv: int, tp: int, name: str) -> int:
    """1 when the KV heads split over tp; tp/kv when each is replicated; else an error."""
    if kv % tp == 0:
        return 1
    if tp % kv == 0:
        return tp // kv
    ok = sorted({d for d in range(1, 2 * max(kv, tp) + 1) if kv % d == 0 or d % kv == 0})
    raise ConfigError(
        f"{name}: {kv} key/value heads cannot be split over tp={tp} (not divisible) nor "
        f"replicated (tp is not a multiple of {kv}); use a tp that divides {kv} or is a "
        f"multiple of it, e.g. one of {[d for d in ok if d <= 2 * tp][:8]}"
    )


def _validate(model: nn.Module, styles: dict[str, Style], tp: int) -> dict[str, int]:
    """Every divisibility check, before anything is built; returns KV replica counts."""
    replicas: dict[str, int] = {}
    for name, style in styles.items():
        m = model.get_submodule(name)
        linear_style = style.startswith(("colwise", "rowwise")) or style == "vocab_head"
        if linear_style and not isinstance(m, nn.Linear):
            raise ConfigError(f"{name}: style {style!r} needs an nn.Linear, got {type(m)}")
        if style == "vocab_embedding" and not isinstance(m, nn.Embedding):
            raise ConfigError(f"{name}: style 'vocab_embedding' needs an nn.Embedding")
        if not isinstance(m, nn.Linear) or style not in (*_HEAD_STYLES, "colwise", "rowwise"):
            continue
        rows = style.startswith("colwise")
        length = m.out_features if rows else m.in_features
        if style in _HEAD_STYLES:
            hd = _head_dim(model, name)
            what = "key/value heads" if style == "colwise_kv_heads" else "heads"
            label = f"{name}: {length // hd} {what}"
            rep = _kv_replicas(length // hd, tp, name) if style == "colwise_kv_heads" else 1
            replicas[name] = rep
            split_units(length, hd, tp, rep, False, label)
        else:
            kind = "output" if rows else "input"
            split_units(length, 1, tp, 1, False, f"{name}: {length} {kind} features")
    return replicas


def check_tensor_parallel(
    cfg: ModelConfig, tp: int, sequence_parallel: bool = False, seq_len: int | None = None
) -> None:
    """Config-time check of the built-in transformer at tp degree ``tp`` (no torch work):
    heads, KV heads (unless replicated), MLP width and, with sequence parallelism, the
    sequence length divisible by tp. Raises :class:`ConfigError` with the numbers."""
    if tp <= 1:
        return
    split_units(cfg.n_heads, 1, tp, 1, False, f"model.n_heads: {cfg.n_heads} heads")
    _kv_replicas(cfg.kv_heads, tp, "model.n_kv_heads")
    split_units(cfg.hidden_dim, 1, tp, 1, False, f"model.ffn_dim: {cfg.hidden_dim} features")
    if sequence_parallel and seq_len is not None:
        check_sequence_length(seq_len, tp)


INPUT_KEYWORDS = ("hidden_states", "x", "input", "inputs")
"""Keyword names a region's input may be passed under (Hugging Face modules are called
as ``module(hidden_states=...)``); otherwise the first tensor keyword argument."""


def _entry_hook(group: AxisGroup, sp: bool) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs``) entering the region with its input: the first
    positional argument, or the input passed by keyword."""

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (enter_region(args[0], group, sp), *args[1:]), kwargs  # (b, s, h)
        keys = [k for k in INPUT_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)]
        keys += [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if not keys:
            raise TypeError(
                f"tensor-parallel region {type(module).__name__} was called without a tensor "
                "input (no positional argument and no tensor keyword argument)"
            )
        return args, {**kwargs, keys[0]: enter_region(kwargs[keys[0]], group, sp)}

    return hook


def apply_tensor_parallel(
    model: nn.Module,
    mesh: Mesh,
    sequence_parallel: bool = False,
    plan: ShardingPlan | None = None,
) -> nn.Module:
    """Shard the full one-device ``model`` over ``mesh``'s tp axis in place; returns it.

    ``plan`` defaults to :func:`default_sharding_plan`. Modules are replaced by their
    parallel versions (same attribute names, so parameter names do not change);
    regions get forward pre-hooks. The model's logits become vocabulary-sharded: use
    :func:`~plait.parallel.tensor.loss.vocab_parallel_loss`. Parameters are plain local shards, so
    :class:`~plait.parallel.data_parallel.DataParallel` or ZeRO can wrap the result over dp.
    """
    group = mesh.axis("tp")
    tp, sp = group.size, sequence_parallel
    plan = default_sharding_plan(model) if plan is None else plan
    if sp and tp > 1 and is_hf_llama(model):
        raise ConfigError(
            f"sequence parallelism is not supported for {type(model).__name__}: its forward "
            "derives positions and the causal mask from the hidden states' length, which "
            "sequence parallelism shards; use parallel.sequence_parallel = false."
        )
    styles = resolve_sharding_plan(model, plan)
    replicas = _validate(model, styles, tp)  # every ConfigError is raised by here
    sharded: dict[int, nn.Parameter] = {}  # id(full weight) -> shard (tied weights)
    for name, style in styles.items():
        m = model.get_submodule(name)
        new: nn.Module | None = None
        if style == "region":
            m.register_forward_pre_hook(_entry_hook(group, sp), with_kwargs=True)
        elif style == "replicate":
            for p in m.parameters(recurse=False):
                set_shard_info(p, TPShard.replicated(tp))
                if sp and tp > 1:
                    mark_sequence_parallel(p, group)
        elif style in QK_NORM_STYLES:
            sibling = f"{name.rpartition('.')[0]}.w{'k' if style == 'norm_kv_heads' else 'q'}"
            rep = replicas.get(sibling, 1)
            rgroup = mesh.split_axis("tp", rep)[0] if rep > 1 else None
            apply_qk_norm_style(m, style, group, _head_dim(model, name), rgroup, name)
        elif style == "vocab_embedding":
            assert isinstance(m, nn.Embedding)
            new = VocabParallelEmbedding(m, group, sequence_parallel=sp, name=name)
            sharded[id(m.weight)] = new.weight
        elif style == "vocab_head":
            assert isinstance(m, nn.Linear)
            tied = sharded.get(id(m.weight))
            new = ColumnParallelLinear(m, group, sequence_parallel=sp, pad=True, name=name)
            if tied is not None:
                new.weight = tied
        elif style.startswith("colwise"):
            assert isinstance(m, nn.Linear)
            rep = replicas.get(name, 1)
            rgroup = mesh.split_axis("tp", rep)[0] if rep > 1 else None
            unit = _head_dim(model, name) if style in _HEAD_STYLES else 1
            new = ColumnParallelLinear(
                m,
                group,
                enter=False,
                sequence_parallel=sp,
                unit=unit,
                replica_group=rgroup,
                name=name,
            )
        else:  # rowwise, rowwise_heads
            assert isinstance(m, nn.Linear)
            unit = _head_dim(model, name) if style in _HEAD_STYLES else 1
            new = RowParallelLinear(m, group, sequence_parallel=sp, unit=unit, name=name)
        if new is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    _set_heads_per_rank(model, styles)
    return model


def _set_heads_per_rank(model: nn.Module, styles: dict[str, Style]) -> None:
    """Attention modules that keep head counts as attributes get this rank's counts.

    Hugging Face attention reads ``num_key_value_groups`` (query heads per key/value
    head) and, in older versions, ``num_heads``, ``num_key_value_heads`` and
    ``hidden_size`` (heads x head_dim, for the output reshape); each one the module has
    is set from the sharded projections' rows. Modules that read the counts from
    tensor shapes (plait's own ``Attention``) have none of them and are left alone.
    """
    local: dict[str, dict[str, int]] = {}
    for name, style in styles.items():
        if style not in ("colwise_heads", "colwise_kv_heads"):
            continue
        weight = model.get_submodule(name).weight  # (local heads x head_dim, dim)
        assert isinstance(weight, torch.Tensor)
        head_dim = _head_dim(model, name)
        counts = local.setdefault(name.rpartition(".")[0], {"head_dim": head_dim})
        counts[style] = weight.shape[0] // head_dim
    for parent_name, counts in local.items():
        parent = model.get_submodule(parent_name)
        q, kv = counts.get("colwise_heads"), counts.get("colwise_kv_heads")
        values: dict[str, int] = {}
        if q is not None:
            values.update(num_heads=q, hidden_size=q * counts["head_dim"])
        if kv is not None:
            values["num_key_value_heads"] = kv
        if q is not None and kv is not None:
            values["num_key_value_groups"] = q // kv
        for attr, v in values.items():
            old = getattr(parent, attr, None)
            if isinstance(old, int) and not isinstance(old, bool):
                setattr(parent, attr, v)


@torch.no_grad()
def gather_full_state(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """The one-device ``state_dict`` of a tensor-parallel model, on every tp rank.

    Sharded parameters are all-gathered over tp (padding and KV-head replicas removed);
    replicated parameters and buffers are copied. Keys and shapes are those of the
    unsharded model, so the result loads into it (``load_state_dict``).
    """
    group = mesh.axis("tp")
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        info = shard_info(t)
        out[key] = info.gather(t, group) if info is not None else t.detach().clone()
    return out


@torch.no_grad()
def load_full_state(model: nn.Module, mesh: Mesh, state: dict[str, torch.Tensor]) -> None:
    """Copy a one-device ``state`` into a tensor-parallel model: each rank takes its own
    pieces (no communication). The inverse of :func:`gather_full_state`."""
    index = mesh.index("tp")
    for key, t in model.state_dict(keep_vars=True).items():
        if key not in state:
            raise KeyError(f"load_full_state: {key!r} missing from the state")
        info = shard_info(t)
        src = state[key]
        t.copy_(info.shard(src, index) if info is not None else src)
