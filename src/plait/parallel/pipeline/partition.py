"""Stage balancing: pipeline boundaries chosen from the measured cost of each block.

A pipeline runs at the pace of its slowest piece, so the boundaries should equalise
time, not block counts (blocks differ: a wider MLP, the embedding in the first piece,
the vocabulary-sized head and loss in the last). :func:`profile_blocks` runs each block
of the full model forward and backward on a random micro-batch a few times and keeps
the median time, the bytes autograd saves for backward (activation memory per
micro-batch) and the parameter bytes; the embedding and the norm + head are profiled
as fixed extras of the first and last piece. :func:`best_partition` then finds the
contiguous split minimising the slowest piece *exactly* (dynamic programming over
``(blocks used, pieces used)``, O(pieces · n²)), optionally under a per-piece memory
cap. The equal-count split (:func:`~plait.parallel.pipeline.split.equal_boundaries`)
stays available; :func:`format_partition` prints either with its predicted per-piece
times.

Under ``parallelize`` every rank profiles the same full model (SPMD, so tensor-parallel
blocks run their collectives together) and the profiles are averaged over the world
before the split, so every rank derives the same boundaries.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from plait import comm
from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.parallel.pipeline.split import check_split, equal_boundaries


@dataclass(frozen=True)
class BlockCost:
    """Measured cost of one block for one micro-batch."""

    seconds: float
    """Median forward + backward time."""
    activation_bytes: int
    """Bytes autograd saves in forward for backward (held while the micro-batch is in flight)."""
    param_bytes: int
    """Bytes of the block's parameters."""


@dataclass(frozen=True)
class Profile:
    """Per-block costs plus the fixed extras of the first and last piece."""

    blocks: tuple[BlockCost, ...]
    first: BlockCost
    """The token embedding (first piece)."""
    last: BlockCost
    """Final norm + output head (last piece)."""

    def piece_seconds(self, boundaries: Sequence[int]) -> list[float]:
        """Predicted forward + backward time of each piece for one micro-batch."""
        return _piece_sums(
            [b.seconds for b in self.blocks], boundaries, self.first.seconds, self.last.seconds
        )

    def piece_memory(self, boundaries: Sequence[int]) -> list[int]:
        """Parameter + one micro-batch's activation bytes of each piece."""
        per = [b.param_bytes + b.activation_bytes for b in self.blocks]
        first = self.first.param_bytes + self.first.activation_bytes
        last = self.last.param_bytes + self.last.activation_bytes
        return [int(x) for x in _piece_sums(per, boundaries, first, last)]


def _piece_sums(
    costs: Sequence[float], boundaries: Sequence[int], first: float, last: float
) -> list[float]:
    out = [float(sum(costs[boundaries[k] : boundaries[k + 1]])) for k in range(len(boundaries) - 1)]
    out[0] += first
    out[-1] += last
    return out


def best_partition(
    costs: Sequence[float],
    pieces: int,
    first: float = 0.0,
    last: float = 0.0,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
) -> list[int]:
    """Boundaries of the contiguous split of ``costs`` into ``pieces`` non-empty runs
    that minimises the largest run sum (``first`` added to run 0, ``last`` to the last
    run); with ``memory`` and ``memory_cap``, runs whose memory sum exceeds the cap are
    not allowed. Exact; ties go to the earliest boundaries. Raises ConfigError when no
    split fits the cap."""
    n = len(costs)
    check_split(n, pieces)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    mprefix = [0.0]
    for c in memory or [0.0] * n:
        mprefix.append(mprefix[-1] + c)
    inf = float("inf")

    def run(k: int, i: int, j: int) -> float:  # cost of blocks i..j-1 as piece k
        if memory_cap is not None and mprefix[j] - mprefix[i] > memory_cap:
            return inf
        extra = (first if k == 0 else 0.0) + (last if k == pieces - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    # best[k][j]: minimal slowest piece covering blocks 0..j-1 with k + 1 pieces
    best = [[inf] * (n + 1) for _ in range(pieces)]
    cut = [[0] * (n + 1) for _ in range(pieces)]
    for j in range(1, n + 1):
        best[0][j] = run(0, 0, j)
    for k in range(1, pieces):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                v = max(best[k - 1][i], run(k, i, j))
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    if best[pieces - 1][n] == inf:
        raise ConfigError(
            f"no split of {n} blocks into {pieces} pieces keeps every piece under the memory "
            f"cap of {memory_cap:.3g} bytes; raise the cap or use more pieces."
        )
    bounds = [n]
    for k in range(pieces - 1, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.append(0)
    return bounds[::-1]


def _saved_bytes(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Run ``fn(x)`` and count the distinct storages autograd saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(seen.values())


def _measure(
    module: nn.Module,
    make_input: Callable[[], torch.Tensor],
    call: Callable[[torch.Tensor], torch.Tensor],
    repeats: int,
) -> BlockCost:
    times = []
    act = 0
    for r in range(repeats + 1):  # the first run warms up and is not timed
        x = make_input()
        t0 = time.perf_counter()
        out, act = _saved_bytes(call, x)
        torch.autograd.backward(out, torch.ones_like(out))
        if r:
            times.append(time.perf_counter() - t0)
    module.zero_grad(set_to_none=True)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return BlockCost(statistics.median(times), act, params)


def profile_blocks(
    model: nn.Module, micro: int, seq: int, repeats: int = 3, seq_factor: int = 1
) -> Profile:
    """Profile every block of the built-in transformer ``model`` (see the module doc)
    on a random micro-batch of ``micro`` sequences of ``seq`` tokens."""
    p0 = next(model.parameters())
    dtype, device = p0.dtype, p0.device
    mcfg = cast(ModelConfig, model.cfg)
    dim, vocab = mcfg.dim, mcfg.vocab_size
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]  # type: ignore[index]
    g = torch.Generator(device="cpu").manual_seed(0)

    def hidden() -> torch.Tensor:
        h = torch.randn(micro, seq // seq_factor, dim, generator=g, dtype=torch.float64)
        return h.to(device, dtype).requires_grad_(True)

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (micro, seq), generator=g).to(device)

    layers, emb, norm, head = model.layers, model.tok_embeddings, model.norm, model.output
    assert isinstance(layers, nn.ModuleList) and isinstance(emb, nn.Module)
    assert isinstance(norm, nn.Module) and isinstance(head, nn.Module)
    blocks = []
    for block in layers:

        def call(x: torch.Tensor, b: nn.Module = block) -> torch.Tensor:
            return cast(torch.Tensor, b(x, cos, sin))

        blocks.append(_measure(block, hidden, call, repeats))
    first = _measure(emb, tokens, emb, repeats)
    last = _measure(head, hidden, lambda x: head(norm(x)), repeats)
    return Profile(tuple(blocks), first, last)


def agreed_profile(profile: Profile, mesh: Mesh) -> Profile:
    """The profile averaged over every rank of ``mesh`` (all ranks then agree)."""
    costs = [profile.first, profile.last, *profile.blocks]
    t = torch.tensor(
        [[c.seconds, c.activation_bytes, c.param_bytes] for c in costs], dtype=torch.float64
    )  # (blocks + 2, 3)
    comm.all_reduce(t, mesh.world(), op="avg")
    out = [BlockCost(float(r[0]), round(float(r[1])), round(float(r[2]))) for r in t]
    return Profile(tuple(out[2:]), out[0], out[1])


def measured_boundaries(profile: Profile, pieces: int) -> list[int]:
    """The time-optimal contiguous split of ``profile`` into ``pieces`` pieces."""
    return best_partition(
        [b.seconds for b in profile.blocks], pieces, profile.first.seconds, profile.last.seconds
    )


def format_partition(profile: Profile, boundaries: Sequence[int], label: str) -> str:
    """A small table: each piece's blocks, predicted time and memory per micro-batch."""
    secs = profile.piece_seconds(boundaries)
    mem = profile.piece_memory(boundaries)
    lines = [
        f"pipeline split ({label}): boundaries {list(boundaries)}; "
        f"slowest piece {max(secs) * 1e3:.2f} ms"
    ]
    for k in range(len(boundaries) - 1):
        lines.append(
            f"  piece {k}: blocks {boundaries[k]}-{boundaries[k + 1] - 1}  "
            f"predicted {secs[k] * 1e3:8.2f} ms  params+activations {mem[k] / 2**20:8.2f} MiB"
        )
    return "\n".join(lines)


def choose_boundaries(
    model: nn.Module,
    mesh: Mesh,
    pieces: int,
    balance: str,
    micro: int,
    seq: int,
    seq_factor: int = 1,
) -> tuple[list[int], str]:
    """Boundaries for ``balance`` ("equal" or "measured") and the printable table (the
    measured profile's predictions for both splits when measured)."""
    n = len(model.layers)  # type: ignore[arg-type]
    equal = equal_boundaries(n, pieces)
    if balance == "equal":
        return equal, f"pipeline split (equal): boundaries {equal}"
    if balance != "measured":
        raise ConfigError(f"parallel.balance must be equal or measured, got {balance!r}")
    profile = agreed_profile(profile_blocks(model, micro, seq, seq_factor=seq_factor), mesh)
    chosen = measured_boundaries(profile, pieces)
    text = (
        format_partition(profile, chosen, "measured")
        + "\n"
        + format_partition(profile, equal, "equal-count, for comparison")
    )
    return chosen, text
