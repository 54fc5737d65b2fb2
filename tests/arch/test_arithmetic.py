"""The model arithmetic (:mod:`plait.arch`) by hand and on published sizes; that it equals
the built model's own count is checked in ``tests/model`` (``test_param_count_matches_numel``
and the MoE counts in ``test_moe.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from plait.arch import active_param_count, flops_per_token, param_count
from plait.config.presets import MODEL_PRESETS, model_preset


def test_published_sizes() -> None:
    assert abs(param_count(MODEL_PRESETS["llama3-8b"]) - 8.03e9) / 8.03e9 < 0.001
    assert abs(param_count(MODEL_PRESETS["gpt2-124m-llama"]) - 124e6) / 124e6 < 0.01
    # a dense model's active parameters are all of them
    assert active_param_count(MODEL_PRESETS["llama3-8b"]) == param_count(MODEL_PRESETS["llama3-8b"])


def test_flops_per_token_by_hand() -> None:
    # dim 32, 2 layers, 4 heads (head_dim 8), 2 kv heads, hidden 96, vocab 256.
    cfg = model_preset("tiny")
    assert cfg.hidden_dim == 96
    attn = 32 * 32 + 2 * (32 * 16) + 32 * 32  # wq, wk+wv, wo = 3072
    mlp = 3 * 32 * 96  # 9216
    n_matmul = 2 * (attn + mlp) + 256 * 32  # 24576 + 8192 = 32768
    assert n_matmul == 32768
    expected = 6 * 32768 + 12 * 2 * 64 * 32  # 196608 + 49152
    assert flops_per_token(cfg, 64) == pytest.approx(245760.0)
    assert flops_per_token(cfg, 64) == expected
    # Tying does not change the matmul count.
    assert flops_per_token(dataclasses.replace(cfg, tie_embeddings=True), 64) == expected
