"""The model a command loads from a plait checkpoint: the one its run trained.

A plait checkpoint records its run's configuration (``metadata.json``). ``plait eval``,
``plait generate`` and ``plait train --init-from CKPT`` / ``--resume`` therefore take the
model section and the tokenizer from it (a run started from a Hugging Face folder
recorded that model's sizes), instead of building the default model and failing on the
first tensor's shape: :func:`checkpoint_defaults` fills the raw config before it is
validated. A flag that sets a field the tensors' shapes depend on (``SHAPE_FIELDS``) to
another value than the checkpoint's is refused in one line; the other model fields
(attention kernel, RoPE settings, ``max_seq_len``, ...) and ``data.tokenizer`` are the
checkpoint's unless a flag says otherwise; ``plait eval`` and ``plait generate`` of a
LoRA run's checkpoint also take its ``lora`` section (the base with its adapters).
``plait checkpoint export`` reads the
recorded model itself (:func:`plait.checkpoint.export_hf`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

SHAPE_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "multiple_of",
    "tie_embeddings",
    "moe_experts",
    "moe_every",
    "moe_shared_experts",
    "moe_hidden_dim",
    "factory",
)
"""Model fields that fix the checkpoint's tensors: a flag may not contradict them."""


def _saved_tokenizer(saved: dict[str, Any]) -> str | None:
    """The tokenizer a checkpoint was trained with: its prepared data's index's (when that
    folder is still here), else its saved ``data.tokenizer``."""
    from plait.config import DataConfig
    from plait.data.sources import data_tokenizer

    spec = saved.get("tokenizer")
    source = saved.get("source")
    if not isinstance(source, str):
        return spec if isinstance(spec, str) else None
    try:
        val = saved.get("val")
        data = DataConfig(source=source, tokenizer=spec or "byte", val=val)
        return data_tokenizer(data)
    except ConfigError:  # the data folder moved or gone: the saved spec
        return spec if isinstance(spec, str) else None


def _folder(path: Path) -> Path | None:
    """The checkpoint ``path`` names: itself (it has ``metadata.json``) or, for a run's
    checkpoint root, what its ``latest`` names; None when neither."""
    from plait.checkpoint import read_latest

    if (path / "metadata.json").is_file():
        return path
    return read_latest(path) if path.is_dir() else None


def _source(train: dict[str, Any]) -> tuple[str, Path] | None:
    """(the flag, the checkpoint folder) a run loads its model from: ``train.init_from``,
    else ``train.resume`` (a path, or 'latest'/'auto' in ``train.checkpoint_dir``)."""
    init_from, resume = train.get("init_from"), train.get("resume")
    if init_from:
        found = _folder(Path(init_from))
        return ("--init-from", found) if found is not None else None
    if not resume:
        return None
    root = train.get("checkpoint_dir") if resume in ("latest", "auto") else resume
    found = _folder(Path(root)) if root else None
    return ("--resume", found) if found is not None else None


def checkpoint_defaults(data: dict[str, Any], adapters: bool = False) -> list[str]:
    """Fill the raw config ``data`` from the checkpoint it loads (``train.init_from``, or
    ``train.resume``): a run's checkpoint root given to ``--init-from`` becomes its latest
    checkpoint; the model section and ``data.tokenizer`` come from the checkpoint's
    recorded config where ``data`` does not set them; a flag contradicting a shape field
    is refused (ConfigError, one line). With ``adapters`` (``plait eval``, ``plait
    generate``: commands that use the trained model as it is) a LoRA run's ``lora``
    section comes too, unless ``data`` has one: the model is the frozen base with the
    checkpoint's adapters. Returns what was done, in words."""
    from plait.checkpoint.format import read_metadata
    from plait.config import LoraConfig, ModelConfig

    train = data.setdefault("train", {})
    found = _source(train)
    if found is None:
        return []
    flag, folder = found
    notes = []
    if flag == "--init-from" and Path(train["init_from"]) != folder:
        notes.append(f"--init-from {train['init_from']}: its latest checkpoint, {folder}")
        train["init_from"] = str(folder)
    saved = read_metadata(folder).get("config", {})
    saved_model = saved.get("model", {})
    model = data.setdefault("model", {})
    for key in SHAPE_FIELDS:
        if key in model and key in saved_model and model[key] != saved_model[key]:
            raise ConfigError(
                f"--model.{key} {model[key]!r} contradicts the checkpoint {folder} "
                f"(model.{key} = {saved_model[key]!r}); leave it out: {flag} loads the "
                "checkpoint's model."
            )
    known = {f.name for f in dataclasses.fields(ModelConfig)}  # a newer writer's extras: no
    filled = {k: v for k, v in saved_model.items() if k in known and k not in model}
    model.update(filled)
    tokenizer = _saved_tokenizer(saved.get("data", {}))
    if tokenizer and "tokenizer" not in data.setdefault("data", {}):
        data["data"]["tokenizer"] = tokenizer
    if filled:
        notes.append(f"model from {folder}/metadata.json")
    saved_lora = saved.get("lora", {})
    if adapters and saved_lora.get("rank") and "lora" not in data:
        # the adapters are the checkpoint's tensors: not re-read from a PEFT folder
        fields = {f.name for f in dataclasses.fields(LoraConfig)} - {"init_from"}
        data["lora"] = {k: v for k, v in saved_lora.items() if k in fields}
        notes.append(f"LoRA rank {saved_lora['rank']} adapters from {folder}")
    return notes
