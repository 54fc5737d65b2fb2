"""Expert weights between plait's MoE and Hugging Face's two layouts.

plait's :class:`~plait.model.moe.MoE` keeps a layer's routed experts stacked and
right-multiplied (``x @ w``): ``experts.w1``/``experts.w3`` ``(E, dim, f)`` (gate, up)
and ``experts.w2`` ``(E, f, dim)`` (down). Hugging Face has two layouts of the same
numbers, both left-multiplied (``nn.Linear`` weights, ``w @ x``):

* **hub** (what the hub's folders hold and ``save_pretrained`` writes): one tensor per
  expert and projection, ``(f, dim)`` for gate and up, ``(dim, f)`` for down, named

  ``model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral: gate,
  up, down) or ``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``
  (Qwen2/Qwen3-MoE, style ``qwen``);

* **fused** (``transformers`` 5.x in memory, e.g. ``model.state_dict()`` saved as is):
  ``model.layers.{i}.mlp.experts.gate_up_proj`` ``(E, 2f, dim)`` (gate rows first, then
  up) and ``model.layers.{i}.mlp.experts.down_proj`` ``(E, dim, f)``; Mixtral's router
  is then ``mlp.gate.weight`` (its hub name ``block_sparse_moe.gate.weight``).

Import accepts both (:func:`detect_fused` tells which a folder has), export writes the
hub's (:func:`to_hub`). Reading is rank-local: :func:`read_experts` reads only experts
``[first, last)`` of a layer, whole per-expert tensors in the hub layout or the
contiguous rows ``first:last`` of the fused tensors (one element range each), so an
expert-parallel rank reads only its experts' bytes; :func:`read_expert_piece` turns that
into the flat range a :class:`~plait.pieces.LocalPiece` holds (its expert block, a ZeRO
segment of it). :func:`renames` gives the one-to-one names of the rest of an MoE layer
(router, shared expert and its gate). No tensor is copied more than once: the
transposes are views until the caller's copy. :class:`ExpertLayout` is what the import
(:func:`~plait.checkpoint.hf_read.open_hf`) knows of a folder's experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import torch

from plait.checkpoint.files import ShardFile
from plait.checkpoint.format import CheckpointError, ParamEntry, Piece, dtype_to_name
from plait.pieces import TPSplit

Style = Literal["mixtral", "qwen"]
"""Whose hub names: Mixtral's (``block_sparse_moe``, ``w1/w3/w2``) or Qwen2/Qwen3-MoE's
(``mlp``, ``gate_proj/up_proj/down_proj``)."""

Which = Literal["w1", "w3", "w2"]
"""plait's expert tensor: gate ``w1``, up ``w3`` (``(E, dim, f)``), down ``w2``
(``(E, f, dim)``)."""

_HUB = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "qwen": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}

Opener = Callable[[str], ShardFile]
"""Hugging Face tensor name -> the open safetensors file holding it."""


def hub_name(layer: int, expert: int, which: Which, style: Style) -> str:
    """The hub's name of expert ``expert``'s ``which`` projection in layer ``layer``."""
    block, proj = _HUB[style]
    return f"model.layers.{layer}.{block}.experts.{expert}.{proj[which]}.weight"


def fused_name(layer: int, which: Literal["gate_up", "down"]) -> str:
    """``transformers`` 5.x's in-memory name of layer ``layer``'s fused experts."""
    return f"model.layers.{layer}.mlp.experts.{which}_proj"


def plait_name(layer: int, which: Which) -> str:
    """plait's name of layer ``layer``'s stacked expert tensor."""
    return f"layers.{layer}.feed_forward.experts.{which}"


def renames(layer: int, style: Style, fused: bool = False) -> dict[str, str]:
    """The other tensors of MoE layer ``layer``, one to one: Hugging Face name -> plait
    name (router; Qwen's shared expert and its gate, present only when the model has
    them). ``fused``: Mixtral's router under its in-memory name."""
    p = f"layers.{layer}.feed_forward"
    block = "mlp" if fused else _HUB[style][0]
    out = {f"model.layers.{layer}.{block}.gate.weight": f"{p}.router.gate.weight"}
    if style == "qwen":
        for hf, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[f"model.layers.{layer}.mlp.shared_expert.{hf}.weight"] = f"{p}.shared.{ours}.weight"
        out[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = f"{p}.shared_gate.weight"
    return out


def hub_names(layer: int, experts: int, style: Style) -> list[str]:
    """Every hub tensor of layer ``layer``'s ``experts`` experts."""
    return [hub_name(layer, e, w, style) for e in range(experts) for w in ("w1", "w3", "w2")]


def detect_fused(names: Iterable[str], layer: int, experts: int, style: Style) -> bool:
    """Whether the folder whose tensor ``names`` are given holds layer ``layer``'s
    experts fused (True) or per expert (False); CheckpointError when neither is whole."""
    have = set(names)
    fused = {fused_name(layer, "gate_up"), fused_name(layer, "down")}
    if fused <= have:
        return True
    hub = hub_names(layer, experts, style)
    missing = [n for n in hub if n not in have]
    if not missing:
        return False
    raise CheckpointError(
        f"layer {layer}'s experts are in neither layout: no {fused_name(layer, 'gate_up')} "
        f"and, of the per-expert tensors, {missing[0]!r} is missing"
    )


def from_hub(
    gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
) -> dict[Which, torch.Tensor]:
    """Per-expert ``(f, dim)``, ``(f, dim)``, ``(dim, f)`` -> plait's stacked tensors."""
    return {
        "w1": torch.stack([g.t() for g in gate]),  # (E, dim, f)
        "w3": torch.stack([u.t() for u in up]),  # (E, dim, f)
        "w2": torch.stack([d.t() for d in down]),  # (E, f, dim)
    }


def to_hub(
    layer: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, style: Style
) -> dict[str, torch.Tensor]:
    """plait's stacked experts of layer ``layer`` -> the hub's tensors by name
    (contiguous, one per expert and projection)."""
    out: dict[str, torch.Tensor] = {}
    for e in range(w1.shape[0]):
        for which, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            out[hub_name(layer, e, which, style)] = w[e].t().contiguous()  # type: ignore[arg-type]
    return out


def from_fused(gate_up: torch.Tensor, down: torch.Tensor) -> dict[Which, torch.Tensor]:
    """``gate_up_proj`` ``(E, 2f, dim)`` and ``down_proj`` ``(E, dim, f)`` -> plait's."""
    f = down.shape[-1]
    if gate_up.shape[1] != 2 * f:
        raise CheckpointError(
            f"gate_up_proj has {gate_up.shape[1]} rows per expert, down_proj implies 2 x {f}"
        )
    return {
        "w1": gate_up[:, :f].transpose(1, 2),  # (E, dim, f)
        "w3": gate_up[:, f:].transpose(1, 2),  # (E, dim, f)
        "w2": down.transpose(1, 2),  # (E, f, dim)
    }


def to_fused(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """plait's stacked experts -> ``{"gate_up_proj": (E, 2f, dim), "down_proj": (E, dim,
    f)}`` (what ``transformers`` 5.x holds in memory)."""
    gate_up = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1)
    return {"gate_up_proj": gate_up.contiguous(), "down_proj": w2.transpose(1, 2).contiguous()}


def read_experts(
    open_file: Opener,
    layer: int,
    which: Which,
    first: int,
    last: int,
    style: Style,
    fused: bool,
) -> torch.Tensor:
    """Experts ``[first, last)`` of layer ``layer``'s ``which`` tensor in plait's layout
    (``(last - first, dim, f)`` or ``(.., f, dim)``, the stored dtype), reading only
    their bytes: the hub's per-expert tensors whole, or rows ``first:last`` of the fused
    tensor (one contiguous element range)."""
    if not fused:
        rows = []
        for e in range(first, last):
            name = hub_name(layer, e, which, style)
            rows.append(open_file(name).read(name).t())
        return torch.stack(rows)
    name = fused_name(layer, "down" if which == "w2" else "gate_up")
    f = open_file(name)
    _, shape, _, _ = f.info(name)
    per = shape[1] * shape[2]  # elements of one expert
    block = f.read(name, first * per, last * per).view(last - first, shape[1], shape[2])
    if which == "w2":
        return block.transpose(1, 2)  # (n, f, dim)
    half = shape[1] // 2
    part = block[:, :half] if which == "w1" else block[:, half:]
    return part.transpose(1, 2)  # (n, dim, f)


def read_expert_piece(
    open_file: Opener,
    layer: int,
    which: Which,
    shape: tuple[int, int, int],
    tp: TPSplit | None,
    start: int,
    end: int,
    style: Style,
    fused: bool,
) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened expert block a rank holds of plait's
    ``which`` tensor of one-device ``shape`` ``(E, a, b)`` (``tp``: its block along the
    experts, expert parallelism's; None: all experts), reading only the experts that
    range touches."""
    n_exp, a, b = shape
    first = 0
    if tp is not None:
        if tp.dim != 0:
            raise CheckpointError(f"expert tensor {plait_name(layer, which)} split along {tp.dim}")
        first = (tp.index // tp.replicas) * tp.block
    per = a * b
    lo, hi = first + start // per, first + -(-end // per)  # experts the range touches
    if hi > n_exp or start > end:
        raise CheckpointError(f"{plait_name(layer, which)}: range {start}:{end} past the experts")
    if hi == lo:  # an empty range: nothing read
        name = fused_name(layer, "gate_up") if fused else hub_name(layer, first, which, style)
        return torch.empty(0, dtype=open_file(name).info(name)[0])
    block = read_experts(open_file, layer, which, lo, hi, style, fused)
    skip = start - (lo - first) * per
    return block.reshape(-1)[skip : skip + end - start]


@dataclass
class ExpertLayout:
    """How a Hugging Face folder holds an MoE family's routed experts (import): each
    plait expert tensor's layer, projection and layout, the stored tensors expected
    with their shapes (checked against the headers), and Mixtral's router under its
    fused-layout name. Empty for a dense family."""

    style: Style | None
    experts: dict[str, tuple[int, Which, bool]] = field(default_factory=dict)
    """plait name -> (layer, projection, fused layout)."""
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """Every stored expert tensor's name -> the shape ``config.json`` implies."""
    plait_shapes: dict[str, list[int]] = field(default_factory=dict)
    """plait name -> its global shape ``(E, a, b)``."""
    files: dict[str, str] = field(default_factory=dict)
    """Every stored tensor's name -> its file."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Stored name -> the spec's name (``mlp.gate.weight`` -> ``block_sparse_moe...``)."""
    seen: set[str] = field(default_factory=set)
    source: str = ""
    """The folder, for the errors."""

    def check(self, name: str, shape: list[int], file: str) -> None:
        """Stored expert tensor ``name`` of ``shape`` in ``file``: the implied shape?"""
        want = self.shapes[name]
        if list(shape) != want:
            raise CheckpointError(
                f"{self.source}: tensor {name!r} in {file} has shape {list(shape)}, but "
                f"config.json implies {want}"
            )
        self.seen.add(name)

    def entries(self, files: dict[str, ShardFile], folder: Path) -> dict[str, ParamEntry]:
        """One entry per plait expert tensor (the first stored tensor's dtype and file);
        CheckpointError naming a stored tensor that is in no file."""
        missing = [n for n in self.shapes if n not in self.seen]
        if missing:
            raise CheckpointError(f"{folder}: tensor {missing[0]!r} is in no weights file")
        out: dict[str, ParamEntry] = {}
        for name, (layer, which, fused) in self.experts.items():
            first = _stored(layer, which, 0, fused, self.style)
            file = self.files[first]
            f = files.get(file)
            if f is None:
                f = files[file] = ShardFile(folder / file)
            dname = dtype_to_name(f.info(first)[0])
            shape = self.plait_shapes[name]
            piece = Piece(file, 0, shape[0] * shape[1] * shape[2], None, {"param": first})
            out[name] = ParamEntry(shape, dname, dname, [piece])
        return out

    def read(
        self, open_file: Opener, name: str, tp: TPSplit | None, start: int, end: int
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of block ``tp`` of plait expert tensor ``name``."""
        layer, which, fused = self.experts[name]
        shape = self.plait_shapes[name]
        assert self.style is not None
        e, a, b = shape
        return read_expert_piece(
            open_file, layer, which, (e, a, b), tp, start, end, self.style, fused
        )


def _stored(layer: int, which: Which, expert: int, fused: bool, style: Style | None) -> str:
    if fused:
        return fused_name(layer, "down" if which == "w2" else "gate_up")
    assert style is not None
    return hub_name(layer, expert, which, style)


def expert_layout(
    style: Style | None,
    experts: dict[str, list[int]],
    weight_files: dict[str, str],
    source: str,
) -> ExpertLayout:
    """The :class:`ExpertLayout` of a folder whose tensors are ``weight_files`` (name ->
    file) for plait's expert tensors ``experts`` (name -> ``(E, a, b)``), each layer's
    layout detected (:func:`detect_fused`; CheckpointError naming ``source``)."""
    out = ExpertLayout(style, files=dict(weight_files), source=source)
    if style is None:
        return out
    for name, shape in experts.items():
        _, i, _, _, w = name.split(".")  # layers.{i}.feed_forward.experts.{w}
        layer, which = int(i), cast(Which, w)
        try:
            fused = detect_fused(weight_files, layer, shape[0], style)
        except CheckpointError as err:
            raise CheckpointError(f"{source}: {err}") from None
        out.experts[name] = (layer, which, fused)
        out.plait_shapes[name] = list(shape)
        e, a, b = shape
        if not fused:
            for x in range(e):
                out.shapes[hub_name(layer, x, which, style)] = [b, a]  # (f, d) or (d, f)
            continue
        if which == "w2":  # (E, f, d) -> down_proj (E, d, f)
            out.shapes[fused_name(layer, "down")] = [e, b, a]
        else:  # (E, d, f) each -> gate_up_proj (E, 2f, d)
            out.shapes[fused_name(layer, "gate_up")] = [e, 2 * b, a]
        if style == "mixtral":
            router = f"model.layers.{layer}.block_sparse_moe.gate.weight"
            out.aliases[f"model.layers.{layer}.mlp.gate.weight"] = router
    return out
