"""Adafactor's statistics on pieces (plait.optimizers.factored), in one process, no ranks:
a tensor cut as the layouts cut it (a tensor-parallel block along any dimension, padded
where the length does not divide, then flat ZeRO ranges of the block) gives, summed over
the pieces, torch.optim.Adafactor's row and column means of the whole tensor, and each
piece's update is its elements of the whole update (float64, 1e-12)."""

from __future__ import annotations

import itertools

import pytest
import torch

from plait.optimizers.factored import Held, Split, partial_sums, piece_update, runs, whole_means

EPS1 = torch.finfo(torch.float64).eps


@pytest.mark.parametrize(
    ("rows", "cols", "start", "end"), [(4, 5, 0, 40), (4, 5, 3, 37), (3, 7, 8, 9), (2, 3, 5, 6)]
)
def test_runs_tile_the_range_within_matrices(rows: int, cols: int, start: int, end: int) -> None:
    seen: list[int] = []
    for r_lo, r_hi, c_lo, c_hi, off in runs(start, end, rows, cols):
        assert r_hi - r_lo == 1 or (c_lo, c_hi) == (0, cols)  # one row, or whole rows
        assert r_lo // rows == (r_hi - 1) // rows  # within one matrix
        flat = [r * cols + c for r in range(r_lo, r_hi) for c in range(c_lo, c_hi)]
        assert flat[0] - start == off
        seen += flat
    assert seen == list(range(start, end))


def _whole_update(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.Adafactor's first-step row and column means and update, written as
    torch writes them (a fresh factor lerped with weight 1 is the mean)."""
    row = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
    col = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
    var = (row @ col).div_(row.mean(dim=-2, keepdim=True).clamp_(min=EPS1))
    return row, col, var.clamp_(min=EPS1 * EPS1).rsqrt_().mul_(g)


@pytest.mark.parametrize(
    ("shape", "dim", "shards", "cuts"),
    [
        ((6, 5), None, 1, 3),  # ZeRO only: flat ranges of the whole matrix
        ((7, 5), 0, 2, 2),  # column-parallel rows, padded 7 -> 8, then 2 ZeRO ranges
        ((6, 7), 1, 3, 1),  # row-parallel columns, padded 7 -> 9
        ((5, 4, 3), 0, 2, 3),  # experts (or a leading dim) cut, padded 5 -> 6
        ((2, 6, 5), 2, 2, 2),  # a stack cut along its columns
    ],
)
def test_pieces_add_up_to_the_whole(
    shape: tuple[int, ...], dim: int | None, shards: int, cuts: int
) -> None:
    torch.manual_seed(0)
    g = torch.randn(shape, dtype=torch.float64)
    row, col, update = _whole_update(g)
    if dim is None:
        blocks, block, padded = [g], 0, 0
    else:
        block = -(-shape[dim] // shards)
        padded = block * shards
        pad = list(shape)
        pad[dim] = padded - shape[dim]
        gp = torch.cat([g, g.new_zeros(pad)], dim=dim)
        blocks = list(gp.split(block, dim=dim))
    helds: list[tuple[Held, torch.Tensor]] = []
    for i, b in enumerate(blocks):
        flat = b.reshape(-1)
        edges = [round(k * flat.numel() / cuts) for k in range(cuts + 1)]
        split = Split(dim, i * block, padded, True) if dim is not None else None
        for a, e in itertools.pairwise(edges):
            helds.append((Held(shape, tuple(b.shape), a, e, split, (), None), flat[a:e]))
    sums = [partial_sums(h, piece) for h, piece in helds]
    rows = torch.stack([s[0] for s in sums]).sum(0)
    cols = torch.stack([s[1] for s in sums]).sum(0)
    row_mean, col_mean = whole_means(helds[0][0], rows, cols)
    torch.testing.assert_close(row_mean, row, rtol=1e-12, atol=0)
    torch.testing.assert_close(col_mean, col, rtol=1e-12, atol=0)
    got = [piece_update(h, piece, row, col, EPS1) for h, piece in helds]
    if dim is None:
        want = update.reshape(-1)
    else:
        up = torch.cat([update, update.new_zeros(pad)], dim=dim)
        want = torch.cat([u.reshape(-1) for u in up.split(block, dim=dim)])
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-12, atol=0)
