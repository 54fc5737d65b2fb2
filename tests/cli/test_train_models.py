"""``plait train`` on your own model: ``--model.factory`` and ``--model.family hf-llama``.

Each run is the tiny run (tests/tiny.py) for 3 steps on 2 local ranks, in a fresh
folder; it must exit 0, name the model in its banner and write 3 finite losses.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.tiny import read_metrics, run_plait, tiny_args

MODELS_PY = '''
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)  # (batch, seq, dim)
        return self.head(h + self.mlp(h))  # (batch, seq, vocab)


def build(cfg):
    return TinyLM(cfg.vocab_size, cfg.dim)
'''


def _losses(folder: Path) -> list[float]:
    rows = read_metrics(folder / "runs" / "last" / "metrics.jsonl")
    return [float(r["loss"]) for r in rows]


def test_train_with_a_factory_model(tmp_path: Path) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(MODELS_PY)
    args = ["train", *tiny_args(), "--steps", "3", "--nproc", "2", "--zero", "3"]
    r = run_plait([*args, "--model.factory", "mypkg.models:build"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TinyLM from model.factory mypkg.models:build" in r.stdout
    losses = _losses(tmp_path)
    assert len(losses) == 3 and all(math.isfinite(v) and 0 < v < 10 for v in losses)


def test_train_hf_llama_tp2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    args = ["train", *tiny_args(), "--steps", "3", "--nproc", "2", "--tp", "2"]
    r = run_plait([*args, "--model.family", "hf-llama", "--model.n_kv_heads", "2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Hugging Face LlamaForCausalLM, 2 layers, dim 32" in r.stdout
    assert "tensor parallel tp 2" in r.stdout
    losses = _losses(tmp_path)
    assert len(losses) == 3 and all(math.isfinite(v) and 0 < v < 10 for v in losses)


def test_bad_factory_exits_2_before_starting_ranks(tmp_path: Path) -> None:
    r = run_plait(["train", "--nproc", "2", "--model.factory", "nopkg.models:build"], tmp_path)
    assert r.returncode == 2
    assert "cannot import 'nopkg.models'" in r.stderr
    assert "rank" not in r.stderr  # refused in the launching process
