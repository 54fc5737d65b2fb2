"""Pretrained weights out: a plait checkpoint written as a Hugging Face model folder.

:func:`export_hf` turns a checkpoint of any layout (dp, ZeRO, tp, pp, cp and their
products: its metadata describes every piece) into ``config.json`` plus safetensors
shards of at most ``shard_size`` bytes (one ``model.safetensors`` when everything fits)
and ``model.safetensors.index.json``, which ``transformers.AutoModelForCausalLM.
from_pretrained`` loads. It streams: the shard plan and every header come from the
metadata alone, then each tensor is assembled from the byte ranges of its saved pieces
(a fused tensor, Phi-3's ``qkv_proj``, from its parts one after another)
(:meth:`~plait.checkpoint.read.CheckpointReader.read`, a tensor-parallel block walked
in bounded chunks), written, and dropped, so the process holds one tensor plus a
bounded read buffer, never the model. The values are the stored ones (the fp32 masters
when the run had them), written in that dtype; the names are mapped by
``model.arch``'s :class:`~plait.arch.spec.FamilySpec`, which also writes its
``config.json`` (the identity for ``hf-llama``). A factory
model is refused (plait does not know its Hugging Face class).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, cast

import torch

from plait.arch.families import family_named
from plait.arch.spec import concat_shape, expert_tensors, hf_tensors
from plait.checkpoint.files import _bytes_of, fsync_dir
from plait.checkpoint.format import CheckpointError, dtype_from_name
from plait.checkpoint.hf import HF_CONFIG, HF_INDEX, HF_SINGLE, hf_config
from plait.checkpoint.hf_experts import Which, hub_name
from plait.checkpoint.peft_io import (
    is_lora_name,
    lora_factors,
    lora_scale,
    read_tensor,
)
from plait.checkpoint.peft_io import merge_lora as merged_weights
from plait.checkpoint.read import CheckpointReader
from plait.config import ModelConfig
from plait.config.choices import HF_FAMILIES

DEFAULT_SHARD_SIZE = 5 * 1024**3
"""Bytes per shard file when none is given (Hugging Face's default, 5 GB)."""

_ST_DTYPE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _model_config(reader: CheckpointReader) -> ModelConfig:
    model = dict(reader.meta.get("config", {}).get("model", {}))
    if model.get("factory"):
        raise CheckpointError(
            f"checkpoint {reader.folder} is of the factory model {model['factory']!r}; only "
            "the built-in transformer and model.family 'hf-llama' export to Hugging Face"
        )
    try:
        return ModelConfig(**model)
    except TypeError as e:
        msg = f"checkpoint {reader.folder}: its model config is unreadable ({e})"
        raise CheckpointError(msg) from None


Tensor = tuple[str, list[str], list[int], str]
"""``(Hugging Face name, plait names of its parts, shape, dtype)`` of one written tensor."""


def _hf_tensors(
    reader: CheckpointReader, m: ModelConfig
) -> tuple[dict[str, list[str]], dict[str, tuple[str, int]]]:
    """Hugging Face name -> the checkpoint's tensors whose rows it holds, in the family's
    order (``hf-llama``: each tensor under its own name); and, for an MoE family, each
    routed expert's hub tensor -> (plait's stacked tensor, the expert's index): written
    transposed, one expert at a time."""
    params = [n for n in reader.params if not is_lora_name(n)]  # adapters: merged or apart
    if m.family in HF_FAMILIES:
        return {name: [name] for name in params}, {}
    spec = family_named(m.arch)
    out: dict[str, list[str]] = {}
    experts: dict[str, tuple[str, int]] = {}
    for name, shape in expert_tensors(spec, m).items():
        if name not in reader.params:
            raise CheckpointError(f"checkpoint {reader.folder} has no tensor {name!r}")
        layer, which = int(name.split(".")[1]), name.rsplit(".", 1)[1]
        assert spec.experts is not None
        for e in range(shape[0]):
            hf_name = hub_name(layer, e, cast(Which, which), spec.experts)
            out[hf_name] = [name]
            experts[hf_name] = (name, e)
    for hf_name, parts in hf_tensors(spec, m).items():
        names = [n for n, _ in parts]
        missing = [n for n in names if n not in reader.params]
        if missing:
            raise CheckpointError(f"checkpoint {reader.folder} has no tensor {missing[0]!r}")
        out[hf_name] = names
    extra = set(params) - {n for names in out.values() for n in names}
    if extra:
        raise CheckpointError(
            f"checkpoint {reader.folder}: tensor {sorted(extra)[0]!r} has no {m.arch} name"
        )
    return out, experts


def _expert(reader: CheckpointReader, name: str, e: int) -> torch.Tensor:
    """Expert ``e`` of plait's stacked ``(E, a, b)`` tensor ``name`` as the hub's ``(b,
    a)`` (``nn.Linear``'s weight), contiguous; reads that expert's elements only."""
    _, a, b = reader.entry(name).shape
    block = reader.read(name, "param", None, e * a * b, (e + 1) * a * b)  # (a·b,)
    return block.view(a, b).t().contiguous()


def _plan(tensors: list[Tensor], shard_size: int) -> list[list[Tensor]]:
    """Tensors cut into shards of at most ``shard_size`` bytes each (a larger tensor gets
    a shard of its own)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        n = _nbytes(t[2], t[3])
        if shards[-1] and size + n > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _nbytes(shape: list[int], dtype: str) -> int:
    return _numel(shape) * dtype_from_name(dtype).itemsize


def _header(shard: list[Tensor]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for hf_name, _, shape, dtype in shard:
        n = _nbytes(shape, dtype)
        head[hf_name] = {"dtype": _ST_DTYPE[dtype], "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def export_hf(
    source: str | Path | CheckpointReader,
    out: str | Path,
    shard_size: int = DEFAULT_SHARD_SIZE,
    merge_lora: bool = False,
) -> dict[str, Any]:
    """Write checkpoint ``source`` (a folder, or a reader already opened and verified) as
    a Hugging Face folder ``out`` of its ``model.arch`` family (created; it must not exist
    or be empty); returns a summary (step, tensors, parameters, bytes, files). A
    checkpoint with LoRA adapters needs ``merge_lora`` (each adapted weight written as
    ``W + (alpha/r) B A``; the adapter alone: :func:`~plait.checkpoint.peft_io.export_peft`)."""
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
    m = _model_config(reader)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty folder; choose a new -o")
    if shard_size < 1:
        raise CheckpointError(f"--shard-size must be positive, got {shard_size}")
    adapted = {n[: -len(".lora_A.weight")] for n in reader.params if n.endswith(".lora_A.weight")}
    if adapted and not merge_lora:
        raise CheckpointError(
            f"checkpoint {reader.folder} holds LoRA adapters: export them with --format peft, "
            "or write merged weights with --merge-lora"
        )
    scale = lora_scale(reader.meta) if adapted else 1.0
    config = hf_config(m, "float32")  # refuses a model its family cannot hold, before work
    tensors = []
    by_name, experts = _hf_tensors(reader, m)
    for hf_name, parts in by_name.items():
        dts = {reader.entry(n).dtype for n in parts}
        dt = dts.pop() if len(dts) == 1 else "float32"
        if dt not in _ST_DTYPE:
            raise CheckpointError(f"checkpoint {reader.folder}: {parts[0]} is stored as {dt}")
        shape = concat_shape([(n, list(reader.entry(n).shape)) for n in parts])
        if hf_name in experts:  # one expert (a, b) of the stacked (E, a, b), transposed
            shape = shape[:0:-1]
        tensors.append((hf_name, parts, shape, dt))
    dtypes = {t[3] for t in tensors}
    shards = _plan(tensors, shard_size)
    names = (
        [HF_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    weight_map: dict[str, str] = {}
    try:
        for file, shard in zip(names, shards, strict=True):
            with open(out / file, "wb") as fh:
                fh.write(_header(shard))
                for hf_name, parts, _, dt in shard:
                    if hf_name in experts:  # only this expert's elements are read
                        t = _expert(reader, *experts[hf_name]).to(dtype_from_name(dt))
                        fh.write(_bytes_of(t))
                        total += t.numel() * t.element_size()
                        weight_map[hf_name] = file
                        continue
                    for name in parts:  # a fused tensor: its parts' rows one after another
                        part_shape = list(reader.entry(name).shape)
                        t = reader.read(name, "param", None, 0, _numel(part_shape))  # dropped
                        layer = name[: -len(".weight")]
                        if layer in adapted:  # W + scale · B A, in W's dtype
                            fac = {n: read_tensor(reader, n) for n in lora_factors(layer)}
                            fac[name] = t.view(part_shape)
                            t = merged_weights(fac, scale)[name]
                        t = t.to(dtype_from_name(dt))
                        fh.write(_bytes_of(t))
                        total += t.numel() * t.element_size()
                    weight_map[hf_name] = file
                fh.flush()
                os.fsync(fh.fileno())
        dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
        config = {**config, "torch_dtype": dtype, "dtype": dtype}
        (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n", "utf-8")
        fsync_dir(out)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        reader.close()
    return {
        "step": reader.step,
        "tensors": len(tensors),
        "parameters": sum(_numel(t[2]) for t in tensors),
        "bytes": total,
        "files": names,
    }
