"""Generation without the whole model on any rank: under ZeRO-3 each unit is gathered,
used and freed in turn per fed token; under tp each rank keeps its shard.

On 2 ranks (ZeRO-3 dp2, tp2) a float64 model decodes 8 greedy tokens with the key/value
cache; the tokens equal one process's from the same initial weights, token for token.
Memory is counted from the tensors (:class:`plait.testing.LiveBytes`): one process's
decode adds ``W`` bytes (its cache and activations) to what it holds; each rank's decode
adds at most ``W`` plus its largest ZeRO-3 unit (padded; 0 under tp) to what the rank
holds before it (its shards), and leaves no unit gathered. The former whole-model gather
(``ZeroDataParallel.gathered()``) added every unit, 4x the largest here, and fails it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from plait import init_mesh
from plait.config import ModelConfig
from plait.model import Transformer
from plait.model.generate import SampleSettings
from plait.parallel.parallelize import parallelize
from plait.testing import LiveBytes, WorkerContext, WorkerPool
from plait.train.sample import sample_tokens

M = "tests.train.test_sample_memory"
SEED = 3
CFG = ModelConfig(
    vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_dim=80
)
PROMPT = [5, 17, 2, 41, 9, 33]
SETTINGS = SampleSettings(max_new_tokens=8)


def _decode(mesh: Any, **layout: Any) -> dict[str, Any]:
    """Build, parallelize and decode under a :class:`LiveBytes` count."""
    with LiveBytes() as counter:
        model = Transformer(CFG, seed=SEED).to(torch.float64)
        pm = parallelize(model, mesh, **layout)
        before = counter.live()
        counter.reset_peak()
        tokens = sample_tokens(pm, PROMPT, SETTINGS).tokens
        after, peak = counter.live(), counter.peak
    zero = pm.zero
    largest = max(u.padded * 8 for u in zero.units) if zero is not None else 0
    gathered = zero.gathered_bytes if zero is not None else 0
    return {
        "tokens": tokens,
        "added": peak - before,
        "left": after - before,
        "largest": largest,
        "gathered": gathered,
    }


def _body(ctx: WorkerContext, dp: int, tp: int, zero: int) -> dict[str, Any]:
    return _decode(ctx.mesh(dp=dp, tp=tp), zero=zero)


@pytest.mark.parametrize(("dp", "tp", "zero"), [(2, 1, 3), (1, 2, 0)], ids=["zero3-dp2", "tp2"])
def test_generation_holds_shards_plus_one_unit(
    pools: Callable[[int], WorkerPool], dp: int, tp: int, zero: int
) -> None:
    one = _decode(init_mesh())
    assert one["largest"] == 0 and one["added"] > 0
    for r in pools(2).run(f"{M}:_body", dp, tp, zero):
        assert r["tokens"] == one["tokens"]
        assert r["gathered"] == 0 and r["left"] == 0  # every unit and the cache freed
        assert r["added"] <= one["added"] + r["largest"], (r, one["added"])
        if zero == 3:
            whole = sum(p.numel() for p in Transformer(CFG, seed=SEED).parameters()) * 8
            assert r["largest"] < whole / 3  # the bound is well below the whole model
