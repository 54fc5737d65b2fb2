"""The tokenizer of a run's prepared data: taken from the index (spec and eos id), one
across mixture entries and ``data.val``, a contradicting ``data.tokenizer`` refused;
``data.val`` never a training source; a malformed index refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plait.config import DataConfig
from plait.data import data_eos_id, data_tokenizer, make_datasets, read_index
from plait.errors import DataError
from tests.tiny import run_plait


def test_prepared_folder_gives_its_tokenizer_and_eos(bpe_folder: Path, bpe: Path) -> None:
    idx = read_index(bpe_folder)
    assert idx.eos_id == 1
    cfg = DataConfig(source=str(bpe_folder))  # data.tokenizer left at 'byte'
    assert data_tokenizer(cfg) == idx.tokenizer
    assert data_eos_id(cfg) == 1
    assert data_tokenizer(DataConfig(source=str(bpe_folder), tokenizer=idx.tokenizer))
    with pytest.raises(DataError, match="differs from the tokenizer"):
        data_tokenizer(DataConfig(source=str(bpe_folder), tokenizer=f"hf:{bpe}"))
    with pytest.raises(DataError, match="differs from the tokenizer"):
        make_datasets(DataConfig(source=str(bpe_folder), tokenizer=f"hf:{bpe}"), 16, 512)
    assert data_eos_id(DataConfig()) is None  # the built-in corpus: the tokenizer's own


def test_sources_with_different_tokenizers_refused(bpe_folder: Path, byte_folder: Path) -> None:
    mix = DataConfig(source=f"{byte_folder}:0.5,{bpe_folder}:0.5")
    for cfg in (mix, DataConfig(source=str(byte_folder), val=str(bpe_folder))):
        with pytest.raises(DataError, match="must share a tokenizer") as err:
            make_datasets(cfg, 16, 512)
        assert str(byte_folder) in str(err.value) and str(bpe_folder) in str(err.value)


def test_val_that_is_a_training_source_refused(byte_folder: Path, byte_folder_b: Path) -> None:
    for cfg in (
        DataConfig(source=str(byte_folder), val=str(byte_folder)),
        DataConfig(source=f"{byte_folder}:0.7,{byte_folder_b}:0.3", val=str(byte_folder_b)),
    ):
        with pytest.raises(DataError, match="also a training source"):
            make_datasets(cfg, 32, 256)


def test_malformed_shard_entry_is_one_line(byte_folder_b: Path, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(byte_folder_b, folder)
    raw = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    del raw["shards"][0]["tokens"]
    (folder / "index.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(DataError, match="malformed index"):
        read_index(folder)
    r = run_plait(["data", "info", str(folder)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "malformed index" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_samples_and_generate_use_the_index_tokenizer(bpe_folder: Path) -> None:
    """``log.sample_every`` and ``plait generate`` (from a checkpoint's saved data section)
    encode with the prepared folder's tokenizer, not ``data.tokenizer``'s default."""
    from dataclasses import replace

    from plait.cli.model_source import _saved_tokenizer
    from plait.train.sample import TrainingSamples
    from tests.tiny import tiny_config

    spec = read_index(bpe_folder).tokenizer
    base = tiny_config(steps=1)
    cfg = replace(
        base,
        model=replace(base.model, vocab_size=512),
        data=replace(base.data, source=str(bpe_folder)),
        log=replace(base.log, sample_every=1),
    )
    assert TrainingSamples(cfg).tokenizer.name == spec
    assert _saved_tokenizer({"source": str(bpe_folder), "tokenizer": "byte"}) == spec
    assert _saved_tokenizer({"source": "/nonexistent:0.5,/gone:0.5", "tokenizer": "byte"}) == "byte"
