"""Expert tensors between plait's layout and Hugging Face's hub and fused layouts.

* Round trips: plait -> hub -> plait and plait -> fused -> plait give the same tensors
  bit for bit.
* Against ``transformers`` itself: a tiny Mixtral and a tiny Qwen2-MoE (made with their
  own classes, ``save_pretrained`` into 2 shards: the hub's per-expert names) read with
  :func:`read_experts` equal the fused tensors the model holds in memory mapped by
  :func:`from_fused`, and the same model's in-memory state written as is (the fused
  layout) reads back the same; :func:`detect_fused` tells the two folders apart.
  Export: the hub tensors :func:`to_hub` writes (and the :func:`renames` of router,
  shared expert and gate, inverted) are exactly the saved folder's, name and value.
* Rank-local: an expert-parallel rank's block (ep 2, rank 1) and a ZeRO segment of it
  that starts and ends inside experts read only the experts they touch (the files'
  ``bytes_read``) and equal the slice of the whole tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint.files import ShardFile
from plait.checkpoint.format import CheckpointError
from plait.checkpoint.hf_experts import (
    detect_fused,
    from_fused,
    from_hub,
    hub_name,
    plait_name,
    read_expert_piece,
    read_experts,
    renames,
    to_fused,
    to_hub,
)
from plait.pieces import TPSplit

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

E, DIM, F = 4, 16, 8


def test_round_trips_are_exact() -> None:
    g = torch.Generator().manual_seed(0)
    w = {
        "w1": torch.randn(E, DIM, F, generator=g),
        "w3": torch.randn(E, DIM, F, generator=g),
        "w2": torch.randn(E, F, DIM, generator=g),
    }
    for style in ("mixtral", "qwen"):
        hub = to_hub(3, w["w1"], w["w3"], w["w2"], style)  # type: ignore[arg-type]
        assert len(hub) == 3 * E and hub[hub_name(3, 1, "w2", style)].shape == (DIM, F)  # type: ignore[arg-type]
        back = from_hub(
            *[[hub[hub_name(3, e, k, style)] for e in range(E)] for k in ("w1", "w3", "w2")]  # type: ignore[arg-type]
        )
        for k in w:
            assert torch.equal(back[k], w[k])  # type: ignore[index]
    fused = to_fused(w["w1"], w["w3"], w["w2"])
    assert fused["gate_up_proj"].shape == (E, 2 * F, DIM)
    assert fused["down_proj"].shape == (E, DIM, F)
    back = from_fused(fused["gate_up_proj"], fused["down_proj"])
    for k in w:
        assert torch.equal(back[k], w[k])  # type: ignore[index]


class Folder:
    """A saved folder's tensors: name -> open file."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            where = json.loads(index.read_text())["weight_map"]
        else:
            one = ShardFile(path / "model.safetensors")
            where = dict.fromkeys(one.entries, "model.safetensors")
        self.files = {f: ShardFile(path / f) for f in set(where.values())}
        self.where = where

    def __call__(self, name: str) -> ShardFile:
        return self.files[self.where[name]]

    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())


def _model(style: str) -> Any:
    common: dict[str, Any] = {
        "vocab_size": 32, "hidden_size": DIM, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts_per_tok": 2,
    }  # fmt: skip
    torch.manual_seed(0)
    if style == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=F, num_local_experts=E)
        return transformers.MixtralForCausalLM(cfg).double()
    cfg = transformers.Qwen2MoeConfig(
        **common, intermediate_size=32, moe_intermediate_size=F,
        shared_expert_intermediate_size=2 * F, num_experts=E,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(cfg).double()


@pytest.mark.parametrize("style", ["mixtral", "qwen"])
def test_both_layouts_read_as_transformers_holds_them(tmp_path: Path, style: str) -> None:
    model = _model(style)
    hub_dir, fused_dir = tmp_path / "hub", tmp_path / "fused"
    model.save_pretrained(hub_dir, max_shard_size="20KB")
    assert (hub_dir / "model.safetensors.index.json").is_file()  # several shards
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    fused_dir.mkdir()
    safetensors_torch.save_file(state, str(fused_dir / "model.safetensors"))
    hub, fused = Folder(hub_dir), Folder(fused_dir)
    assert not detect_fused(hub.where, 1, E, style)  # type: ignore[arg-type]
    assert detect_fused(fused.where, 1, E, style)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="in neither layout"):
        detect_fused([n for n in hub.where if ".experts.3." not in n], 1, E, style)  # type: ignore[arg-type]
    exported: dict[str, torch.Tensor] = {}
    for layer in range(2):
        ex = model.model.layers[layer].mlp.experts
        want = from_fused(ex.gate_up_proj.detach(), ex.down_proj.detach())
        got = {}
        for which in ("w1", "w3", "w2"):
            a = read_experts(hub, layer, which, 0, E, style, fused=False)  # type: ignore[arg-type]
            b = read_experts(fused, layer, which, 0, E, style, fused=True)  # type: ignore[arg-type]
            assert torch.equal(a, want[which]) and torch.equal(b, want[which])  # type: ignore[index]
            got[which] = a
        exported |= to_hub(layer, got["w1"], got["w3"], got["w2"], style)  # type: ignore[arg-type]
        for hf_name in renames(layer, style):  # type: ignore[arg-type]
            exported[hf_name] = hub(hf_name).read(hf_name)
        plait_names = set(renames(layer, style).values())  # type: ignore[arg-type]
        assert f"layers.{layer}.feed_forward.router.gate.weight" in plait_names
    # export: every MoE tensor of the saved folder, name and value, and nothing else
    saved = {n for n in hub.where if ".mlp." in n or "block_sparse_moe" in n}
    assert set(exported) == saved
    for name, t in exported.items():
        assert torch.equal(t, hub(name).read(name)), name


@pytest.mark.parametrize("fused", [False, True])
def test_an_ep_rank_reads_only_its_experts(tmp_path: Path, fused: bool) -> None:
    """ep 2, rank 1 holds experts 2, 3 of ``w1`` ``(E, dim, f)``: its whole block, and a
    ZeRO segment from the middle of expert 2 to the middle of expert 3."""
    g = torch.Generator().manual_seed(1)
    w = {k: torch.randn(E, *s, generator=g) for k, s in (("w1", (DIM, F)), ("w3", (DIM, F)))}
    w["w2"] = torch.randn(E, F, DIM, generator=g)
    if fused:
        tensors = {f"model.layers.0.mlp.experts.{k}": v for k, v in to_fused(**w).items()}
    else:
        tensors = to_hub(0, w["w1"], w["w3"], w["w2"], "qwen")
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    folder = Folder(tmp_path)
    split = TPSplit(0, E, 2, 1, E // 2, 1)
    per = DIM * F
    whole = w["w1"][2:].reshape(-1)
    for start, end, touched in ((0, 2 * per, 2), (per // 2, per + per // 2, 2), (3, 7, 1)):
        before = folder.bytes_read()
        got = read_expert_piece(folder, 0, "w1", (E, DIM, F), split, start, end, "qwen", fused)
        assert torch.equal(got, whole[start:end])
        # the hub reads each touched expert's (f, dim) tensor; fused its (2f, dim) rows
        assert folder.bytes_read() - before == touched * per * 4 * (2 if fused else 1)
    empty = read_expert_piece(folder, 0, "w1", (E, DIM, F), split, 2 * per, 2 * per, "qwen", fused)
    assert empty.numel() == 0 and empty.dtype == torch.float32
    assert plait_name(0, "w1") == "layers.0.feed_forward.experts.w1"
