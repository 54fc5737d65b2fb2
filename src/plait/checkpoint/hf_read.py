"""Pretrained Hugging Face weights in: a model folder read rank-locally, like a resume.

:func:`open_hf` opens a Hugging Face folder (``config.json`` plus ``model.safetensors``
or the shards of ``model.safetensors.index.json``) as a
:class:`~plait.checkpoint.read.CheckpointReader` whose tensors carry the *model's*
names (the family's :class:`~plait.arch.spec.FamilySpec`) and one whole-tensor piece
each (a part of a fused tensor: its rows).
An MoE family's routed experts (one stored tensor per expert and projection in the
hub's layout, or transformers 5's fused ``gate_up_proj``/``down_proj``) are many stored
tensors per plait tensor: :class:`HFReader` reads a region of one from only the experts
it touches (:class:`~plait.checkpoint.hf_experts.ExpertLayout`), so an ep rank reads
only its experts. Only the files' headers are read here; every tensor is checked against the shapes
``config.json`` implies, and every shard the index names must exist. The weights are
then read exactly as a resume reads plait's own shards: each rank, after parallelize,
asks for the regions of the pieces it holds (its tensor-parallel block, its ZeRO flat
segment, its pipeline stage's tensors) and only those byte ranges are read, converted
to the model's dtype through a bounded buffer (:func:`~plait.checkpoint.load.
load_pieces` in a run; :func:`load_hf_weights` for one's own loop).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from plait.arch.families import family_named
from plait.arch.spec import concat_shape, expert_tensors, hf_tensors
from plait.checkpoint.files import ShardFile
from plait.checkpoint.format import CheckpointError, ParamEntry, Piece, dtype_to_name
from plait.checkpoint.hf import HF_CONFIG, HF_INDEX, HF_SINGLE, model_fields, read_hf_config
from plait.checkpoint.hf_experts import ExpertLayout, expert_layout
from plait.checkpoint.read import CheckpointReader
from plait.config import ModelConfig
from plait.config.choices import HF_FAMILIES
from plait.pieces import LocalPiece, TPSplit


def is_hf_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder that is not a plait checkpoint (no metadata.json):
    such a folder is read as a Hugging Face model (and refused without config.json)."""
    p = Path(path)
    return p.is_dir() and not (p / "metadata.json").is_file()


def _weight_files(folder: Path) -> dict[str, str]:
    """Hugging Face tensor name -> the file holding it (from the index, or the one file)."""
    index = folder / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is unreadable ({e})") from None
        for file in sorted(set(weight_map.values())):
            if not (folder / file).is_file():
                raise CheckpointError(
                    f"{folder}: shard {file} named by {HF_INDEX} is missing (the download "
                    "is incomplete?)"
                )
        return {str(k): str(v) for k, v in weight_map.items()}
    if not (folder / HF_SINGLE).is_file():
        raise CheckpointError(
            f"{folder} has {HF_CONFIG} but no weights: neither {HF_SINGLE} nor {HF_INDEX} "
            "(only safetensors are read, never pickled .bin files)"
        )
    f = ShardFile(folder / HF_SINGLE)
    names = {k: HF_SINGLE for k in f.entries}
    f.close()
    return names


def open_hf(folder: str | Path, family: str = "plait") -> CheckpointReader:
    """The Hugging Face model in ``folder`` as a reader with the model's names
    (``family`` 'plait': the built-in transformer's; 'hf' or 'hf-llama': Hugging Face's
    own, a fused tensor whole).
    Reads the headers only; CheckpointError (exit 2) names a missing config.json or
    shard, an unsupported architecture, a missing tensor or one of the wrong shape.

    The part of a fused tensor (Phi-3's ``qkv_proj``) is a piece whose ``start`` is
    minus the elements before it in the stored tensor: element ``e`` of the part is
    element ``e - start`` of the stored one, and the reader's negative positions
    (the other parts) are never read."""
    folder = Path(folder)
    source = str(folder)
    cfg = ModelConfig(**model_fields(read_hf_config(folder), source))
    spec = family_named(cfg.arch)
    own = family in HF_FAMILIES  # transformers' class: its own names, fused tensors whole
    if own and spec.experts is not None:
        raise CheckpointError(
            f"{source}: {spec.architecture} loads into the built-in transformer only "
            "(model.family 'plait', where --ep splits its experts); transformers' own class "
            "(model.family 'hf') is not wired for mixtures of experts"
        )
    expected = hf_tensors(spec, cfg)
    if own:
        expected = {hf: [(hf, concat_shape(parts))] for hf, parts in expected.items()}
    weight_files = _weight_files(folder)
    layout = expert_layout(spec.experts, expert_tensors(spec, cfg), weight_files, source)
    files: dict[str, ShardFile] = {}
    params: dict[str, ParamEntry] = {}
    for stored, file in weight_files.items():
        hf_name = layout.aliases.get(stored, stored)  # Mixtral's fused-layout router
        if hf_name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # tied: the embedding matrix is the head
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name in layout.shapes:  # a routed expert's tensor: checked here, read apart
            f = files.get(file)
            if f is None:
                f = files[file] = ShardFile(folder / file)
            layout.check(hf_name, f.info(hf_name)[1], file)
            continue
        parts = expected.get(hf_name)
        if parts is None:
            raise CheckpointError(
                f"{source}: tensor {hf_name!r} in {file} is not a {spec.architecture} weight "
                f"of the shapes {HF_CONFIG} gives (plait does not load it)"
            )
        f = files.get(file)
        if f is None:
            f = files[file] = ShardFile(folder / file)
        dt, shape, _, _ = f.info(stored)
        if shape != concat_shape(parts):
            raise CheckpointError(
                f"{source}: tensor {hf_name!r} in {file} has shape {shape}, but {HF_CONFIG} "
                f"implies {concat_shape(parts)}"
            )
        dname = dtype_to_name(dt)
        before = 0
        for plait_name, part_shape in parts:
            numel = _numel(part_shape)
            name = plait_name
            piece = Piece(file, -before, numel, None, {"param": stored})
            params[name] = ParamEntry(part_shape, dname, dname, [piece])
            before += numel
    missing = [
        hf
        for hf, parts in expected.items()
        if (hf if family == "hf-llama" else parts[0][0]) not in params
    ]
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is in no weights file")
    params.update(layout.entries(files, folder))
    reader = HFReader.__new__(HFReader)
    reader.folder = folder
    reader.meta = {"step": 0, "format": "huggingface"}
    reader.params = params
    reader._files = files
    reader._cache = {}
    reader.layout = layout
    return reader


class HFReader(CheckpointReader):
    """A Hugging Face folder's reader: the one-to-one and fused tensors as byte-range
    pieces (:class:`CheckpointReader`), an MoE family's routed experts through
    :attr:`layout` (many stored tensors per plait tensor, transposed: only the experts
    a region touches are read, :func:`~plait.checkpoint.hf_experts.read_expert_piece`)."""

    layout: ExpertLayout

    def read_into(
        self, name: str, kind: str, tp: TPSplit | None, start: int, out: torch.Tensor
    ) -> None:
        if name not in self.layout.experts:
            super().read_into(name, kind, tp, start, out)
            return
        if kind != "param":
            raise CheckpointError(f"{self.folder}: a Hugging Face folder has no {kind!r} state")
        region = self.layout.read(self._open, name, tp, start, start + out.numel())
        out.copy_(region)

    def read_global(self, name: str, kind: str = "param") -> torch.Tensor:
        if name not in self.layout.experts:
            return super().read_global(name, kind)
        numel = self.entry(name).numel
        return self.read(name, kind, None, 0, numel).view(self.entry(name).shape)

    def _open(self, hf_name: str) -> ShardFile:
        return self._file(self.layout.files[hf_name])


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@torch.no_grad()
def load_hf_weights(model: Any, folder: str | Path, optimizer: Any = None) -> int:
    """Fill the pieces ``model`` (anything with ``local_pieces()``, e.g. a
    :class:`~plait.parallel.model.ParallelModel`) holds on this rank from the Hugging Face
    folder ``folder``, byte range by byte range; with ``optimizer``
    (:class:`~plait.optim.Optimizer`) its fp32 masters too. Call it on every rank after
    parallelize (and after the optimizer is made). The model's family is taken from its
    names. Returns the tensor bytes this rank read."""
    pieces: list[LocalPiece] = model.local_pieces()
    family = "hf" if any(p.name.startswith("model.") for p in pieces) else "plait"
    reader = open_hf(folder, family)
    try:
        masters = {}
        if optimizer is not None:
            masters = {(p.name, str(p.tp), p.start): p for p in optimizer.local_pieces()}
        for lp in pieces:
            e = reader.entry(lp.name)
            if list(e.shape) != list(lp.shape):
                raise CheckpointError(
                    f"{folder}: tensor {lp.name!r} has shape {e.shape}, the model {lp.shape}"
                )
            op = masters.pop((lp.name, str(lp.tp), lp.start), None)
            target = lp.value if op is None else op.value  # the master first: exact values
            if target.is_contiguous():
                reader.read_into(lp.name, "param", lp.tp, lp.start, target.view(-1))
            else:
                region = reader.read(lp.name, "param", lp.tp, lp.start, lp.end)
                target.copy_(region.view(target.shape))
            if lp.value.data_ptr() != target.data_ptr():
                lp.value.copy_(target.view(lp.value.shape))
        for op in masters.values():  # pieces only the optimizer describes
            reader.read_into(op.name, "param", op.tp, op.start, op.value.view(-1))
        publish = getattr(optimizer, "publish_masters", None)
        if publish is not None:
            publish()
        return reader.bytes_read
    finally:
        reader.close()
