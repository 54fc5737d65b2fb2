"""Rank-local loading: each rank reads exactly the pieces it holds in its new layout.

A resume (or a start from ``train.init_from``) runs *after* the model is parallelized and
the optimizer exists, so every rank knows what it holds: the model's pieces
(``model.local_pieces()``: one-device name, global shape, tensor-parallel block, flat
element range, the model's own storage) and the optimizer's (the same pieces with their
fp32 master and the key of their optimizer state). For each piece the rank reads the
byte ranges of the saved pieces that cover it (:func:`~plait.checkpoint.read.
read_region`) straight into the master (or the parameter) and copies that into the
model's storage, then reads the piece's optimizer state into freshly allocated state
tensors. Nothing else is read: no rank ever holds the full model of a checkpoint, only
its own shard plus one bounded read buffer. The code names no parallelism: whatever
layout (dp, ZeRO flat segments, tp blocks, pipeline stages, their combinations) the
pieces describe is what is read. Finally the optimizer makes replicas whole
(``publish_masters``: under ZeRO-1/2 the all-gather every step ends with).

Also here: :func:`restore_training_state` (the pieces, then the counters, loss scaler,
sampler position and this rank's RNG states), :func:`open_weights` (``train.init_from``)
and :func:`check_model` (refusing a checkpoint whose tensors do not match the model, by
name, before the model is sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint.files import verify_collective
from plait.checkpoint.format import CheckpointError, dtype_from_name
from plait.checkpoint.hf_read import is_hf_folder, open_hf
from plait.checkpoint.rank_state import restore_rank_state, restore_rng
from plait.checkpoint.read import CheckpointReader
from plait.checkpoint.state import TrainState
from plait.mesh import Mesh
from plait.pieces import LocalPiece


def _ident(lp: LocalPiece) -> tuple[Any, ...]:
    return (lp.name, None if lp.tp is None else tuple(lp.tp.to_json()), lp.start, lp.end)


def _check_shape(reader: CheckpointReader, lp: LocalPiece, source: str) -> None:
    e = reader.params.get(lp.name)
    if e is None:
        raise CheckpointError(
            f"{source} does not match the model: it has no tensor {lp.name!r} (shape "
            f"{lp.shape}); was it written for another model configuration?"
        )
    if list(e.shape) != list(lp.shape):
        raise CheckpointError(
            f"{source} does not match the model: tensor {lp.name!r} has shape {e.shape} in "
            f"the checkpoint but {lp.shape} in the model"
        )


@torch.no_grad()
def load_pieces(
    ts: TrainState,
    reader: CheckpointReader,
    optimizer_state: bool = True,
    absent_ok: Callable[[str], bool] | None = None,
) -> None:
    """Every piece this rank holds: its values into the model (and the masters), and
    with ``optimizer_state`` its optimizer state, read from ``reader``'s byte ranges.
    A piece ``reader`` lacks whose name ``absent_ok`` accepts keeps its value (LoRA's
    adapters when the base model comes from ``train.init_from``)."""
    source = str(reader.folder)
    opt = ts.optimizer
    opt_pieces = {_ident(lp): lp for lp in opt.local_pieces()}
    model_pieces = ts.model.local_pieces()
    done: set[tuple[Any, ...]] = set()
    if absent_ok is not None:
        keep = [lp for lp in opt_pieces.values() if lp.name not in reader.params]
        done = {_ident(lp) for lp in keep if absent_ok(lp.name)}
        opt_pieces = {i: lp for i, lp in opt_pieces.items() if i not in done}
        model_pieces = [lp for lp in model_pieces if _ident(lp) not in done]
    for mp in model_pieces:
        _check_shape(reader, mp, source)
        ident = _ident(mp)
        op = opt_pieces.get(ident)
        target = op.value if op is not None else mp.value  # master first: the exact values
        _read_into(reader, mp, "param", target)
        if mp.value.data_ptr() != target.data_ptr():
            mp.value.copy_(target.view(mp.value.shape))  # model dtype from the master
        done.add(ident)
    for ident, op in opt_pieces.items():  # pieces only the optimizer describes
        if ident not in done:
            _check_shape(reader, op, source)
            _read_into(reader, op, "param", op.value)
    if optimizer_state:
        for op in opt_pieces.values():
            _load_state(ts, reader, op)
    publish = getattr(opt, "publish_masters", None)
    if publish is not None:
        publish()


def _read_into(reader: CheckpointReader, lp: LocalPiece, kind: str, dst: torch.Tensor) -> None:
    """The piece's region of ``kind`` into ``dst`` (its storage, written in place)."""
    if dst.is_contiguous():
        reader.read_into(lp.name, kind, lp.tp, lp.start, dst.view(-1))
    else:  # a strided view: through a temporary of the piece's size
        dst.copy_(reader.read(lp.name, kind, lp.tp, lp.start, lp.end).view(dst.shape))


def _load_state(ts: TrainState, reader: CheckpointReader, lp: LocalPiece) -> None:
    """The optimizer state of piece ``lp`` (per-element tensors, and the whole
    parameter's scalars and small tensors such as Adafactor's row and column factors)."""
    state: dict[str, torch.Tensor] = {}
    dtype = dtype_from_name(reader.entry(lp.name).dtype)
    have = ts.optimizer.inner.state.get(lp.key, {})  # read into it in place if it fits
    for kind in reader.kinds(lp.name):
        if kind == "param":
            continue
        t = have.get(kind)
        fits = (
            isinstance(t, torch.Tensor)
            and t.shape == lp.key.shape
            and t.dtype == dtype
            and t.device == lp.key.device
            and t.is_contiguous()
        )
        if not fits:
            t = torch.empty(lp.key.shape, dtype=dtype, device=lp.key.device)
        assert isinstance(t, torch.Tensor)
        reader.read_into(lp.name, kind, lp.tp, lp.start, t.view(-1))
        state[kind] = t
    for s in reader.scalar_names(lp.name):  # whole-parameter state (scalars on the host)
        v = reader.scalar(lp.name, s)
        if v is not None:
            state[s] = v if v.dim() == 0 else v.to(lp.key.device)
    if state:
        ts.optimizer.inner.state[lp.key] = state


@torch.no_grad()
def restore_training_state(ts: TrainState, reader: CheckpointReader) -> int:
    """This rank's pieces (weights and optimizer state, :func:`load_pieces`),
    counters, scaler, sampler, RNG; returns the step to continue from."""
    meta = reader.meta
    opt = ts.optimizer
    load_pieces(ts, reader)
    o = meta["optimizer"]
    opt.steps, opt.skipped = int(o["steps"]), int(o["skipped"])
    if opt.scaler is not None and o.get("scaler"):
        opt.scaler.load_state_dict(o["scaler"])
    ts.sched_step = int(meta["sched_step"])
    ts.sampler.load_state_dict(meta["sampler"])
    restore_rng(reader, ts.mesh.rank, ts.device)
    restore_rank_state(ts.rank_state, meta, ts.mesh.rank, reader.tensor)
    return reader.step


def open_weights(path: str, mesh: Mesh, family: str = "plait") -> CheckpointReader:
    """``train.init_from``: a checkpoint folder (its files verified once per host), a
    consolidated safetensors file or a Hugging Face model folder (no metadata.json; its
    names mapped to ``family``'s, :func:`~plait.checkpoint.hf_read.open_hf`), opened
    for rank-local reads."""
    p = Path(path)
    if is_hf_folder(p):
        return open_hf(p, family)
    if p.is_dir():
        reader = CheckpointReader(p, verify=False)
        verify_collective(p, reader.meta, mesh)
        return reader
    if not p.is_file():
        raise CheckpointError(f"no checkpoint or weights file at {p}")
    return CheckpointReader.from_weights_file(p)


def check_model(reader_params: dict[str, list[int]], model: nn.Module, source: str) -> None:
    """Refuse a checkpoint whose tensors do not match ``model``'s, naming the tensor."""
    have = {n: list(p.shape) for n, p in model.named_parameters()}
    for name, shape in have.items():
        if name not in reader_params:
            raise CheckpointError(
                f"{source} does not match the model: it has no tensor {name!r} (shape "
                f"{shape}); was it written for another model configuration?"
            )
        if reader_params[name] != shape:
            raise CheckpointError(
                f"{source} does not match the model: tensor {name!r} has shape "
                f"{reader_params[name]} in the checkpoint but {shape} in the model"
            )
    extra = [n for n in reader_params if n not in have]
    if extra:
        raise CheckpointError(
            f"{source} does not match the model: it holds tensor {extra[0]!r}"
            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''} the model does not have"
        )
