"""``data.mask_documents`` in the trainer: the tokenizer's end-of-document id reaches the
model, the mask changes training only where a window holds several documents, and
layouts it cannot serve are refused before anything runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from plait import init_mesh
from plait.config import Config, DataConfig, ModelConfig, ParallelConfig
from plait.errors import ConfigError
from plait.model.document_mask import DocumentIds
from plait.train.mask_documents import BYTE_EOS, eos_id
from plait.train.trainer import Trainer
from tests.tiny import run_plait, tiny_args, tiny_config


def _losses(cfg: Config) -> tuple[list[float], Trainer]:
    tr = Trainer(cfg, init_mesh(), show_progress=False)
    return tr.run().losses, tr


def _with(cfg: Config, source: str | None, mask: bool) -> Config:
    data = replace(cfg.data, mask_documents=mask, **({"source": source} if source else {}))
    return replace(cfg, data=data)


def test_mask_follows_end_of_document_bytes(tmp_path: Path) -> None:
    """Byte tokenizer, EOS = NUL: on a corpus of short NUL-separated documents the
    masked run's losses differ from the unmasked one's; on a corpus without NUL they
    are identical (every window is one document)."""
    text = np.frombuffer(Path(__file__).read_bytes() * 4, dtype=np.uint8).astype(np.uint16)
    text = text.copy()
    text[::20] = BYTE_EOS  # documents of 20 tokens, pre-tokenized (text holds no NUL)
    docs = tmp_path / "docs.npy"
    np.save(docs, text)
    base = tiny_config(steps=2)
    masked, tr = _losses(_with(base, str(docs), True))
    assert isinstance(tr.base.documents, DocumentIds) and tr.base.documents.eos_id == BYTE_EOS
    plain, _ = _losses(_with(base, str(docs), False))
    assert masked != pytest.approx(plain, rel=1e-6)
    assert _losses(_with(base, None, True))[0] == _losses(_with(base, None, False))[0]


def test_eos_ids() -> None:
    assert eos_id("byte") == 0
    pytest.importorskip("tiktoken")
    try:
        assert eos_id("tiktoken:gpt2") == 50256
    except Exception as exc:  # the encoding's files may not be cached offline
        pytest.skip(f"tiktoken gpt2 unavailable: {exc}")


def test_refusals(tmp_path: Path) -> None:
    """Pipeline parallelism and models other than the built-in one are refused by the
    config check; the CLI exits 2 with one line naming the option."""
    cfg = _with(tiny_config(), None, True)
    with pytest.raises(ConfigError, match="pipeline"):
        replace(cfg, parallel=ParallelConfig(pp=2)).validate(2)
    with pytest.raises(ConfigError, match="built-in"):
        replace(cfg, model=replace(cfg.model, family="hf-llama")).validate(1)
    assert isinstance(cfg.data, DataConfig) and isinstance(cfg.model, ModelConfig)
    r = run_plait(
        [
            "train",
            *tiny_args(),
            "--steps",
            "1",
            "--nproc",
            "2",
            "--pp",
            "2",
            "--data.mask_documents",
            "true",
        ],
        tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert "data.mask_documents" in r.stderr


def test_mask_uses_prepared_index_eos(tmp_path: Path) -> None:
    """A folder prepared with a BPE whose eos id is 1: the mask takes the index's id,
    not the byte tokenizer's 0 that ``data.tokenizer``'s default would give."""
    from plait.train.mask_documents import enable_document_mask
    from tests.data.conftest import prepared_bpe_folder

    folder = prepared_bpe_folder(tmp_path / "bpe")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.documents = DocumentIds()

    model = Model()
    base = tiny_config(steps=1)
    cfg = replace(
        base,
        model=replace(base.model, vocab_size=512),
        data=replace(base.data, source=str(folder), mask_documents=True),
    )
    enable_document_mask(model, cfg)
    assert model.documents.eos_id == 1
