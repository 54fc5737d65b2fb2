"""Pretrained weights out: import, train, export, and transformers computes the same.

A tiny Llama made with transformers (:func:`tests.checkpoint.test_hf.make_hf_llama`) is
imported under tp2×pp2 with ZeRO-1 (4 ranks), trained 5 steps and checkpointed; ``plait
checkpoint export --format hf`` writes it as a Hugging Face folder in several shards,
``transformers.AutoModelForCausalLM.from_pretrained`` loads it, and its loss on the same
tokens equals the trained plait model's (rel 1e-5, float32) and its logits equal those of
plait's built-in transformer started from the same checkpoint (rel 1e-5, abs 1e-5). The
same for a tied model (ZeRO-3 dp2) and for ``hf-llama`` (tp2, identity names). The
export streams: it never holds more than one tensor (checked on the largest).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint import CheckpointReader, export_hf, step_dirname
from plait.checkpoint.read import CheckpointReader as _Reader
from plait.cli import main
from plait.mesh import init_mesh
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_hf import BATCH, make_hf_llama, run_config, tokens

transformers = pytest.importorskip("transformers")

STEPS = 5


def _train_body(
    ctx: WorkerContext, folder: str, family: str, layout: dict[str, int], root: str
) -> float:
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    dp = ctx.world_size // (tp * pp)
    cfg = run_config(Path(folder), family, layout, steps=STEPS)
    cfg.train.checkpoint_dir = root  # saved after the last step
    tr = Trainer(cfg, ctx.mesh(dp=dp, tp=tp, pp=pp), False)
    tr.run()
    x, y = tokens()
    per, i = BATCH // dp, tr.mesh.index("dp")
    return float(tr.model.evaluate(x[i * per : (i + 1) * per], y[i * per : (i + 1) * per]))


def _plait_logits(ckpt: Path, family: str) -> torch.Tensor:
    """Logits of :func:`tokens` from one process started from plait checkpoint ``ckpt``."""
    meta = CheckpointReader(ckpt).meta["config"]
    cfg = run_config(Path(meta["train"]["init_from"]), family, {}, steps=1)
    cfg.train.init_from = str(ckpt)
    tr = Trainer(cfg, init_mesh(), False)
    with torch.no_grad():
        out = tr.model(tokens()[0])
    return out if isinstance(out, torch.Tensor) else out.logits


CASES = [
    ("untied", "plait", 4, {"tp": 2, "pp": 2, "zero": 1}),
    ("tied", "plait", 2, {"zero": 3}),
    ("untied", "hf-llama", 2, {"tp": 2, "zero": 1}),
    ("scaled", "plait", 2, {"tp": 2}),
]


@pytest.mark.parametrize("kind,family,world,layout", CASES, ids=lambda v: str(v))
def test_export_round_trip(
    pools: Callable[[int], WorkerPool],
    tmp_path: Path,
    kind: str,
    family: str,
    world: int,
    layout: dict[str, int],
) -> None:
    src = make_hf_llama(tmp_path / "src", tied=kind == "tied", scaled=kind == "scaled")
    root = tmp_path / "ck"
    trained = pools(world).run(_train_body, str(src), family, layout, str(root))
    ckpt = root / step_dirname(STEPS)
    out = tmp_path / "out"
    args = ["checkpoint", "export", str(ckpt), "--format", "hf", "-o", str(out)]
    assert main([*args, "--shard-size", "20000"]) == 0
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert ("lm_head.weight" in index["weight_map"]) == (kind != "tied")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == ("llama3" if kind == "scaled" else "default")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    x, y = tokens()
    with torch.no_grad():
        logits = model(x).logits  # (batch, seq, vocab)
    loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    for got in trained:
        assert loss == pytest.approx(got, rel=1e-5)
    before = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    after = model.state_dict()
    moved = max(float((after[k] - v).abs().max()) for k, v in before.items())
    assert moved > 1e-5, moved  # it did train (the loss on one batch may hardly move)
    ours = _plait_logits(ckpt, family)
    torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)


def test_export_streams_one_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor is read once, alone, and the reader keeps no cache of them."""
    src = make_hf_llama(tmp_path / "src", tied=False)
    root = tmp_path / "ck"
    cfg = run_config(src, "plait", {}, steps=1)
    cfg.train.checkpoint_dir = str(root)
    Trainer(cfg, init_mesh(), False).run()
    reads: list[tuple[str, int]] = []
    real = _Reader.read

    def spy(self: Any, name: str, kind: str, tp: Any, start: int, end: int) -> torch.Tensor:
        reads.append((name, end - start))
        assert not self._cache  # nothing assembled and kept
        return real(self, name, kind, tp, start, end)

    monkeypatch.setattr(_Reader, "read", spy)
    summary = export_hf(root / step_dirname(1), tmp_path / "out", shard_size=10_000)
    reader = CheckpointReader(root / step_dirname(1))
    assert sorted(n for n, _ in reads) == sorted(reader.params)
    assert all(n == reader.params[name].numel for name, n in reads)
    assert summary["parameters"] == sum(n for _, n in reads)
    assert len(summary["files"]) > 1
