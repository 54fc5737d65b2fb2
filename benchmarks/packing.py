"""Packed vs padded: training tokens/s on chat-like samples of a realistic length spread.

The samples' lengths are log-normal around a sixth of the window (sigma 0.9, cut at the
window), as conversations in instruction sets spread; their tokens are random. *Padded*
puts each sample alone in a window padded to ``seq_len + 1`` (the padding's targets
ignored), as a trainer without packing does; *packed* packs them whole with plait's
first-fit decreasing (:mod:`plait.data.packing`) into the same windows, each sample's
first target and the padding ignored. Both train plait's built-in ``Transformer`` with
AdamW on batches of ``--batch`` windows on one device for the same samples; the table
gives windows, the share of real tokens, and real (sample) tokens per second. Attention
in a packed window spans its samples here (the document mask and restarted positions
are the attention side's and cost about the same per token).

    python benchmarks/packing.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from plait.bench.results import command_line, environment, load_average, write_section
from plait.data.packing import first_fit_decreasing
from plait.parallel.loss import cross_entropy_loss


def length_mix(n: int, seq: int, seed: int = 0) -> np.ndarray:
    """``(n,)`` sample lengths: log-normal around seq/6, sigma 0.9, in [4, seq + 1]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(np.log(seq / 6), 0.9, n)).astype(int), 4, seq + 1)


def windows(
    lengths: np.ndarray, seq: int, vocab: int, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(inputs, targets, real_tokens)``: ``(n_windows, seq)`` twice."""
    rng = np.random.default_rng(1)
    samples = [rng.integers(1, vocab, size=int(n)) for n in lengths]
    groups = (
        first_fit_decreasing(lengths.tolist(), seq + 1)
        if packed
        else [[i] for i in range(len(samples))]
    )
    tok = np.zeros((len(groups), seq + 1), dtype=np.int64)  # pad id 0
    keep = np.zeros((len(groups), seq + 1), dtype=bool)
    for w, group in enumerate(groups):
        at = 0
        for i in group:
            n = len(samples[i])
            tok[w, at : at + n] = samples[i]
            keep[w, at + 1 : at + n] = True  # a sample's first token is not a target
            at += n
    x = torch.from_numpy(tok[:, :-1])
    y = torch.from_numpy(np.where(keep[:, 1:], tok[:, 1:], -100))
    return x, y, int(lengths.sum())


def train_rate(x: torch.Tensor, y: torch.Tensor, real: int, a: argparse.Namespace) -> float:
    """Real tokens per second of one pass over the windows (after one warm-up batch)."""
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=a.vocab,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=4,
        n_kv_heads=4,
        max_seq_len=a.seq,
    )
    torch.manual_seed(0)
    model = Transformer(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = cross_entropy_loss()

    def step(lo: int) -> None:
        loss_fn(model(x[lo : lo + a.batch]), y[lo : lo + a.batch]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    t0 = time.perf_counter()
    for lo in range(0, len(x), a.batch):
        step(lo)
    return real / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None, help="record the section in this file")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = p.parse_args()
    if a.tiny:
        a.samples, a.seq, a.batch, a.dim, a.vocab = 48, 64, 4, 32, 128
    lengths = length_mix(a.samples, a.seq)
    rows = []
    for name, packed in (("padded", False), ("packed", True)):
        x, y, real = windows(lengths, a.seq, a.vocab, packed)
        rows.append((name, len(x), real / (len(x) * (a.seq + 1)), train_rate(x, y, real, a)))
    base = rows[0][3]
    lines = [
        "## Packing: packed vs padded windows",
        "",
        f"`{command_line(__file__)}`: {a.samples} samples of log-normal lengths around "
        f"{a.seq // 6} tokens (median {int(np.median(lengths))}, max {int(lengths.max())}) in "
        f"windows of {a.seq} + 1; plait's Transformer dim {a.dim}, {a.layers} layers, batch "
        f"{a.batch} windows, AdamW, CPU; {environment()}; {torch.get_num_threads()} threads; "
        f"load average {load_average():.1f}.",
        "",
        "| layout | windows | real tokens | real tokens/s | vs padded |",
        "|---|---:|---:|---:|---:|",
        *(f"| {n} | {w} | {s:.1%} | {r:,.0f} | {r / base:.2f} |" for n, w, s, r in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if a.out is not None:
        write_section(a.out, "packing", text)


if __name__ == "__main__":
    main()
