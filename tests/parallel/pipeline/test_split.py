"""Cutting the built-in transformer into pipeline pieces."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from plait import init_mesh
from plait.errors import ConfigError
from plait.model import Transformer
from plait.parallel.pipeline.split import (
    check_boundaries,
    check_split,
    equal_boundaries,
    split_transformer,
)
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.pipeline.test_runtime import SEQ, VOCAB, model_config

M = "tests.parallel.pipeline.test_split"


def test_equal_boundaries() -> None:
    assert equal_boundaries(8, 4) == [0, 2, 4, 6, 8]
    assert equal_boundaries(7, 3) == [0, 3, 5, 7]
    assert equal_boundaries(4, 4) == [0, 1, 2, 3, 4]


def test_too_few_blocks_names_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"3 transformer block\(s\) but the pipeline needs 4 "):
        check_split(3, 4)
    with pytest.raises(ConfigError, match=r"needs 8 pieces \(pp 4 x chunks 2\)"):
        check_split(6, 8, stages=4)


@pytest.mark.parametrize("bad", [[0, 2, 8], [1, 4, 6, 8], [0, 4, 4, 8], [0, 5, 3, 8], [0, 4, 6, 9]])
def test_bad_boundaries_refused(bad: list[int]) -> None:
    """Too few entries, not from 0, an empty piece, decreasing, past the last block."""
    assert check_boundaries([0, 4, 6, 8], 8, 3) == [0, 4, 6, 8]
    with pytest.raises(ConfigError, match="not 4 strictly increasing block indices from 0 to 8"):
        check_boundaries(bad, 8, 3)


@pytest.mark.parametrize("tied", [False, True])
def test_pieces_in_order_equal_the_full_model(tied: bool) -> None:
    """One pipeline rank with 4 chunks: running the pieces in order is the model."""
    full = Transformer(model_config(tied=tied), seed=3)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    want = full(x)
    model = Transformer(model_config(tied=tied), seed=3)
    stages = split_transformer(model, init_mesh(), chunks=4, boundaries=[0, 1, 2, 5, 8])
    assert [len(p.layers) for p in stages.chunks] == [1, 1, 3, 3]  # type: ignore[arg-type]
    h = x
    for piece in stages.chunks:
        h = piece(h)
    assert torch.equal(h, want)
    assert stages.tied is None  # first and last piece on the same rank: one shared matrix


def _body_layout(ctx: WorkerContext, tied: bool) -> dict[str, object]:
    mesh = ctx.mesh(dp=1, pp=2)
    model = Transformer(model_config(tied=tied), seed=3)
    stages = split_transformer(model, mesh, chunks=2)
    names = {k: v.detach().clone() for p in stages.chunks for k, v in p.state_dict().items()}
    return {
        "stages": [p.stage for p in stages.chunks],  # type: ignore[attr-defined]
        "names": names,
        "kept": sum(p.numel() for p in model.parameters()),
        "own": sum(p.numel() for p in stages.parameters()),
        "foreign_identity": sum(isinstance(b, nn.Identity) for b in model.layers),
        "tied": stages.tied is not None,
    }


@pytest.mark.parametrize("tied", [False, True])
def test_each_rank_keeps_its_round_robin_pieces(
    pools: Callable[[int], WorkerPool], tied: bool
) -> None:
    full = Transformer(model_config(tied=tied), seed=3).state_dict()
    res = pools(2).run(f"{M}:_body_layout", tied)
    assert [r["stages"] for r in res] == [[0, 2], [1, 3]]  # piece k on rank k % 2
    union: dict[str, torch.Tensor] = {}
    for r in res:
        assert r["foreign_identity"] == 4  # the other rank's 4 blocks were released
        assert r["kept"] == r["own"]  # the full model holds nothing else any more
        for k, v in r["names"].items():
            assert torch.equal(v, full[k])  # the one-device weights, by one-device name
        union.update(r["names"])
    assert set(union) == set(full)
    assert [r["tied"] for r in res] == [tied, tied]  # a copy on each end when tied
