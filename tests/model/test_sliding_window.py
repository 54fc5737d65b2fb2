"""Sliding-window attention and restarted positions on one device (float64).

SDPA and the blockwise kernel (fused and reference, several block sizes) with a window,
with and without document masks, equal a dense reference written here (explicit
softmax over the mask ``j <= i``, ``i - j < W``, same document) to 1e-10 in outputs and
gradients, and differ from the windowless result; the host-side block plan skips key
blocks outside the window and documents; no host-syncing op runs in a forward +
backward; a model alternating sliding and full layers equals dense cores; packed
samples with restarted positions lose exactly what each sample loses alone, in the
built-in model and in a Hugging Face class.
"""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from plait.config import Config, DataConfig, ModelConfig
from plait.config.toml_io import dump_toml, load_config
from plait.errors import ConfigError
from plait.model import Transformer, transformer
from plait.model.block_plan import Segment, Visibility, blockwise_plan, document_spans
from plait.model.blockwise_attention import blockwise_attention
from plait.model.document_mask import DocumentIds, document_ids
from plait.model.hf_llama import build_hf_llama
from plait.model.transformer import SDPAttention
from plait.train.mask_documents import enable_document_mask

B, H, HK, S, D, W = 2, 4, 2, 16, 8, 5
EOS = 0
EOS_AT = [[2, 3, 9], [12]]  # per row: documents of one token, and ones across blocks
TOL = dict(rtol=1e-10, atol=1e-12)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout float64 and the document ids ``(B, S)``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    tokens = torch.ones(B, S, dtype=torch.long)
    for row, where in enumerate(EOS_AT):
        tokens[row, where] = EOS
    return r(B, H, S, D), r(B, HK, S, D), r(B, HK, S, D), r(B, H, S, D), document_ids(tokens, EOS)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None, window: int | None
) -> torch.Tensor:
    """The specification: softmax(q kᵀ/√d + mask) v with the mask written out."""
    s = q.shape[2]
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mask = (j <= i)[None, None]
    if window is not None:
        mask = mask & (i - j < window)[None, None]
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _core(kind: str, docs: torch.Tensor | None, window: int | None) -> Any:
    if kind == "sdpa":
        return lambda q, k, v: SDPAttention(window)(q, k, v, docs)
    impl, block = kind.split("-")[1], int(kind.split("-")[2])
    return lambda q, k, v: blockwise_attention(
        q,
        k,
        v,
        causal=True,
        block_size=block,
        impl=impl,
        doc_ids=docs,
        window=window,  # type: ignore[arg-type]
    )[0]


KINDS = [
    "sdpa",
    "blockwise-fused-4",
    "blockwise-fused-3",
    "blockwise-reference-4",
    "blockwise-reference-16",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_docs", [False, True])
def test_window_equals_dense_reference(kind: str, with_docs: bool) -> None:
    q, k, v, dout, docs_all = _inputs()
    docs = docs_all if with_docs else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _core(kind, docs, W)(*leaves)
    out.backward(dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*ref_leaves, docs, W)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), **TOL)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, **TOL)
    unwindowed = dense_attention(q, k, v, docs, None)
    assert (out.detach() - unwindowed).abs().max() > 1e-3  # the window changes the result


def _plan(block: int, coalesce: bool, window: int | None, docs: torch.Tensor | None) -> Any:
    spans = None if docs is None else document_spans(docs.numpy())
    return blockwise_plan(S, S, block, True, coalesce, Visibility(True, window, spans, S))


def test_block_plan_skips_keys_outside_the_window_and_documents() -> None:
    """Per query block, only key blocks some row sees are visited: the window's band
    (reference blocks of 4; a fused kernel gets one range from the first visible key),
    a document boundary (at 8 in every row) cuts the earlier blocks."""
    last = _plan(4, False, 4, None).blocks[-1]
    assert (last.i0, last.i1) == (12, 16)
    assert last.segments == (Segment(8, 12, "masked"), Segment(12, 16, "causal"))
    assert _plan(4, True, 4, None).blocks[-1].segments == (Segment(9, 16, "masked"),)
    assert _plan(4, True, 16, None).blocks[-1].segments == (
        Segment(0, 12, "full"),
        Segment(12, 16, "causal"),
    )
    docs = (torch.arange(S) >= 8).long().expand(B, S)  # documents [0, 8) and [8, 16)
    assert _plan(4, False, None, docs).blocks[3].segments == (
        Segment(8, 12, "full"),
        Segment(12, 16, "causal"),
    )
    assert _plan(4, True, None, docs).blocks[2].segments == (Segment(8, 12, "causal"),)
    start, end = document_spans(docs.numpy())
    assert start[0].tolist() == [0] * 8 + [8] * 8 and end[0].tolist() == [7] * 8 + [15] * 8


SYNCING = ("_local_scalar_dense", "nonzero", "is_nonzero", "item")


class CountSyncs(TorchDispatchMode):
    """Counts the aten ops that would make a GPU wait for the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in SYNCING:
            self.count[name] = self.count.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_blockwise_with_documents_and_window_does_not_sync(impl: str) -> None:
    """The block plan is built before the kernels from the ids on the host: a forward
    and backward with documents and a window run no ``.item()``/``nonzero``/``bool()``."""
    q, k, v, dout, docs = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with CountSyncs() as mode:
        out, _ = blockwise_attention(
            q,
            k,
            v,
            causal=True,
            block_size=4,
            impl=impl,
            doc_ids=docs,
            window=W,  # type: ignore[arg-type]
        )
        out.backward(dout)
    assert mode.count == {}
    assert q.grad is not None and q.grad.abs().sum() > 0


CFG = ModelConfig(
    vocab_size=32,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=S,
    sliding_window=W,
    layer_types=("sliding_attention", "full_attention"),
)


class DenseCore(nn.Module):
    """The reference core: :func:`dense_attention` with the layer's window."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_attention(q, k, v, None, self.window)


def _model(cfg: ModelConfig, dense: bool = False) -> Transformer:
    m = Transformer(cfg, seed=4).double()
    if dense:
        for layer in m.layers:
            layer.attention.core = DenseCore(layer.attention.core.window)  # type: ignore[union-attr]
    return m


def test_alternating_layers_equal_dense_cores() -> None:
    """layer_types picks the window per layer: SDPA and blockwise models equal dense
    cores (logits, 1e-10), and differ from all-full and all-sliding models."""
    x = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(2))
    assert [layer.attention.core.window for layer in _model(CFG).layers] == [W, None]  # type: ignore[union-attr]
    want = _model(CFG, dense=True)(x)
    for attention in ("sdpa", "blockwise"):
        cfg = ModelConfig(**{**CFG.__dict__, "attention": attention})
        torch.testing.assert_close(_model(cfg)(x), want, **TOL)
    for types in (("full_attention",) * 2, ("sliding_attention",) * 2):
        other = _model(ModelConfig(**{**CFG.__dict__, "layer_types": types}))(x)
        assert (other - want).abs().max() > 1e-4


SAMPLES = [5, 7, 4]  # packed into one window of S = 16 tokens, each ending with EOS


def packed_batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(tokens, targets) ``(1, S)`` of the packed samples (targets across a sample's end
    ignored) and each sample's own tokens."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in SAMPLES:
        s = torch.randint(1, CFG.vocab_size, (n,), generator=g)
        s[-1] = EOS
        samples.append(s)
    tokens = torch.cat(samples)[None]
    targets = torch.full_like(tokens, -100)
    at = 0
    for s in samples:
        targets[0, at : at + len(s) - 1] = s[1:]
        at += len(s)
    return tokens, targets, samples


def sample_losses(logits: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Summed cross-entropy of each packed sample ``(1, S, vocab)``."""
    per = F.cross_entropy(logits[0], targets[0], ignore_index=-100, reduction="none").detach()
    bounds = torch.cumsum(torch.tensor([0, *SAMPLES]), 0).tolist()
    return [float(per[a:b].sum()) for a, b in pairwise(bounds)]


def alone_losses(model: nn.Module, samples: list[torch.Tensor]) -> list[float]:
    """Each sample run alone: its summed next-token cross-entropy."""
    with torch.no_grad():
        return [
            float(F.cross_entropy(model(s[None])[0, :-1], s[1:], reduction="sum")) for s in samples
        ]


@pytest.mark.parametrize("attention", ["sdpa", "blockwise"])
def test_packed_samples_with_restarted_positions_equal_each_alone(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With restarted positions a packed sample's summed loss equals its loss alone
    (rtol 1e-9) and the rotary rows applied are those of positions ``0 .. n-1`` per
    sample (RoPE with document masks is shift-invariant in exact arithmetic, so the rows
    themselves are checked); explicit ``position_ids`` reach the rotation."""
    cfg = ModelConfig(
        **{**CFG.__dict__, "attention": attention, "sliding_window": None, "layer_types": None}
    )
    model = _model(cfg)
    tokens, targets, samples = packed_batch()
    want = alone_losses(model, samples)
    model.documents = DocumentIds(EOS, restart_positions=True)
    applied: list[torch.Tensor] = []
    rotate = transformer.apply_rotary

    def spy(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        applied.append(cos)
        return rotate(x, cos, sin)

    monkeypatch.setattr(transformer, "apply_rotary", spy)
    logits = model(tokens)
    assert sample_losses(logits, targets) == pytest.approx(want, rel=1e-9)
    pos = torch.cat([torch.arange(n) for n in SAMPLES])[None]  # (1, S)
    assert all(torch.equal(c, model.rope_cos[pos]) for c in applied)
    torch.testing.assert_close(model(tokens, position_ids=pos), logits, **TOL)
    model.documents = DocumentIds()  # no document mask: other positions, other logits
    assert (model(tokens, position_ids=pos) - model(tokens)).abs().max() > 1e-4


def test_window_and_layer_types_are_checked(tmp_path: Path) -> None:
    """Bad windows and layer lists are refused with one line; the CLI and TOML read the
    per-layer list, and a written config reads back equal."""
    with pytest.raises(ConfigError, match=r"sliding_window must be >= 1"):
        ModelConfig(sliding_window=0)
    with pytest.raises(ConfigError, match=r"layer_types has 1 entries; model\.n_layers is 2"):
        ModelConfig(n_layers=2, layer_types=("full_attention",))
    with pytest.raises(ConfigError, match="unknown kind"):
        ModelConfig(n_layers=1, layer_types=("local",))
    with pytest.raises(ConfigError, match=r"restart_positions needs data\.mask_documents"):
        DataConfig(restart_positions=True)
    cfg = load_config(
        None, ["model.n_layers=2", "model.layer_types=sliding_attention, full_attention"]
    )
    assert cfg.model.layer_types == ("sliding_attention", "full_attention")
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(str(path)) == cfg


def test_hugging_face_class_with_restarted_positions_equals_each_alone() -> None:
    """``data.mask_documents`` + ``data.restart_positions`` on model.family hf-llama:
    the restarted ``position_ids`` make ``transformers`` mask the packed samples and
    rotate them from 0, so each sample's summed loss equals its loss alone (rtol 1e-9),
    which it does not without them."""
    pytest.importorskip("transformers")
    model_cfg = ModelConfig(
        family="hf-llama", vocab_size=32, dim=32, n_layers=2, n_heads=4, max_seq_len=S
    )
    cfg = Config(model=model_cfg, data=DataConfig(mask_documents=True, restart_positions=True))
    torch.manual_seed(0)
    model = build_hf_llama(model_cfg).double().requires_grad_(False)
    tokens, targets, samples = packed_batch()
    want = [
        float(F.cross_entropy(model(s[None]).logits[0, :-1], s[1:], reduction="sum"))
        for s in samples
    ]
    assert sample_losses(model(tokens).logits, targets) != pytest.approx(want, rel=1e-6)
    enable_document_mask(model, cfg)
    assert sample_losses(model(tokens).logits, targets) == pytest.approx(want, rel=1e-9)
