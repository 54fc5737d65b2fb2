"""Tokenizers: ``hf:PATH`` (a tokenizer.json or a model folder) next to byte; vocabulary
size and eos id on every tokenizer; a model vocabulary smaller than the tokenizer's is
refused; ``--init-from`` a Hugging Face folder with a tokenizer makes it the default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.config import DataConfig
from plait.data import ByteTokenizer, HFTokenizer, make_datasets, make_tokenizer
from plait.errors import DataError
from tests.data.conftest import EOS, documents


def test_hf_tokenizer_file_and_folder(bpe: Path, tmp_path: Path) -> None:
    for spec in (f"hf:{bpe}", f"hf:{bpe.parent}"):
        tok = make_tokenizer(spec)
        assert isinstance(tok, HFTokenizer) and tok.vocab_size == 400
        assert tok.eos_id == 0  # the special token trained first
        for doc in documents(10):
            ids = tok.encode(doc)
            assert ids.dtype == np.uint32 and (ids < 400).all()
            assert tok.decode(ids) == doc
            assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == doc
    assert ByteTokenizer().eos_id == 0 and ByteTokenizer().vocab_size == 256
    # a model folder's tokenizer_config.json names the eos token
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(bpe, folder / "tokenizer.json")
    tok = make_tokenizer(f"hf:{folder}")
    some = tok._tok.id_to_token(300)  # type: ignore[union-attr]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": some}}))
    assert make_tokenizer(f"hf:{folder}").eos_id == 300
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        make_tokenizer(f"hf:{tmp_path}")
    with pytest.raises(DataError, match="unknown tokenizer"):
        make_tokenizer("sentencepiece:x")
    assert EOS == "<|endoftext|>"


def test_text_source_with_hf_tokenizer(bpe: Path, tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(documents(40)), encoding="utf-8")
    cfg = DataConfig(source=str(src), tokenizer=f"hf:{bpe}", val_fraction=0.1)
    train, val = make_datasets(cfg, 16, 400)
    assert len(train) > 10 and len(val) > 1
    with pytest.raises(DataError, match=r"vocabulary of 400 tokens but model\.vocab_size is 300"):
        make_datasets(cfg, 16, 300)


def test_init_from_folder_tokenizer_is_the_default(bpe: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from plait.cli.train import pretrained_defaults
    from tests.checkpoint.test_hf import make_hf_llama

    folder = make_hf_llama(tmp_path / "llama", tied=False)
    raw: dict[str, dict[str, object]] = {"train": {"init_from": str(folder)}}
    pretrained_defaults(raw)
    assert "tokenizer" not in raw.get("data", {})  # no tokenizer.json: unchanged
    shutil.copy(bpe, folder / "tokenizer.json")
    raw = {"train": {"init_from": str(folder)}}
    notes = pretrained_defaults(raw)
    assert raw["data"]["tokenizer"] == f"hf:{folder}"
    assert any("data.tokenizer not set" in n for n in notes)
    raw = {"train": {"init_from": str(folder)}, "data": {"tokenizer": "byte"}}
    pretrained_defaults(raw)
    assert raw["data"]["tokenizer"] == "byte"  # an explicit choice wins
