"""The MoE entries of Mixtral's, Qwen2-MoE's and Qwen3-MoE's config.json <-> ModelConfig.

Each family's config made by ``transformers``' own class (non-default values) maps to
ModelConfig fields that build a valid model, and back to entries that ``transformers``'
class reads as the same values (``num_experts`` through its attribute map where the
class stores ``num_local_experts``). Refused by name: Mixtral's router jitter, Qwen's
``mlp_only_layers``, a shared expert whose width is no multiple of the experts'; a
ModelConfig the family cannot express (z-loss, a per-layer aux loss).
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.arch.moe_hf import moe_config, moe_fields
from plait.config import ModelConfig
from plait.errors import ConfigError

transformers = pytest.importorskip("transformers")

KEYS = (
    "num_experts_per_tok", "router_aux_loss_coef", "intermediate_size", "num_experts",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "norm_topk_prob",
)  # fmt: skip
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 6, "intermediate_size": 24}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 6, "moe_intermediate_size": 8, "intermediate_size": 40,
            "shared_expert_intermediate_size": 24, "decoder_sparse_step": 2,
            "norm_topk_prob": True,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 6, "moe_intermediate_size": 8, "intermediate_size": 40},
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(CASES))
def test_config_round_trip(family: str) -> None:
    cls_name, kw = CASES[family]
    cls = getattr(transformers, cls_name)
    hf = cls(num_experts_per_tok=3, router_aux_loss_coef=0.02, **kw)
    cfg = hf.to_dict()
    fields = moe_fields(cfg, family, "dir")  # type: ignore[arg-type]
    assert fields["moe_aux_loss_scope"] == "model" and fields["moe_z_loss_coef"] == 0.0
    m = ModelConfig(dim=16, n_heads=2, n_layers=4, **fields)
    back = cls(**moe_config(m, family))  # type: ignore[arg-type]
    for key in KEYS:
        if hasattr(hf, key):
            assert getattr(back, key) == getattr(hf, key), key
    if family == "qwen2_moe":
        assert m.moe_shared_experts == 3 and m.moe_shared_expert_gate and m.moe_every == 2
        assert m.moe_norm_topk_prob
    if family == "qwen3_moe":
        assert not m.moe_norm_topk_prob and m.moe_shared_experts == 0


@pytest.mark.parametrize(
    ("family", "entries", "match"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise > 0"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers \[0\]"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 12}, "not a positive multiple of"),
    ],
)
def test_refused_by_name(family: str, entries: dict[str, Any], match: str) -> None:
    cls_name, kw = CASES[family]
    cfg = getattr(transformers, cls_name)(**kw).to_dict() | entries
    with pytest.raises(ConfigError, match=match):
        moe_fields(cfg, family, "dir")  # type: ignore[arg-type]


def test_export_refuses_what_the_family_cannot_express() -> None:
    base = {"dim": 16, "n_heads": 2, "moe_experts": 4, "moe_hidden_dim": 8, "ffn_dim": 8}
    with pytest.raises(ConfigError, match=r"cannot express model\.moe_z_loss_coef"):
        moe_config(ModelConfig(**base, moe_aux_loss_scope="model"), "mixtral")
    with pytest.raises(ConfigError, match=r"cannot express model\.moe_aux_loss_scope"):
        moe_config(ModelConfig(**base, moe_z_loss_coef=0.0), "qwen3_moe")
