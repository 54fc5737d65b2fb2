"""Data loader and ``plait data prepare`` throughput (tokens/s), printed as tables.

Part 1 (loader, one rank). A prepared folder of random tokens (``--tokens``, uint16,
shards of 2^24 tokens, documents of ~2,000 tokens, 5 % held out) is read the way a rank
of a 0.9B-style run reads it: sequences of 2048 tokens, 4 per rank per step, the
sampler's random order over the whole folder. Rows: the batch read in the step
(``data.prefetch 0``), through the background thread (what the trainer does by default;
the consumer takes the batches as fast as they come), and a mixture of two folders
(0.7 / 0.3). tokens/s counts the inputs' tokens (4 x 2048 per step). On CUDA the
background thread also pins the batches.

Part 2 (prepare). ``plait data prepare`` of a JSONL file of text cut from the built-in
corpus, with a byte-level BPE of ``--vocab`` tokens trained here (``tokenizers``), for 1
and 2 worker processes; tokens/s and tokens/s per worker (wall time of the whole command:
reading, tokenizing, writing, checksums).

Run from the repository root::

    python benchmarks/data_loader.py                       # print the tables
    python benchmarks/data_loader.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from plait.config import DataConfig
from plait.data import BackgroundLoader, BatchSampler, make_datasets, read_corpus
from plait.data.index import DOCUMENTS_NAME, ShardIndex, sha256_file, shard_name
from plait.data.prepare import prepare

SEQ, PER_RANK = 2048, 4
SHARD = 1 << 24


def random_folder(root: Path, tokens: int, seed: int) -> Path:
    """A prepared folder of random tokens (vocabulary 32,000, eos 0)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    ends = np.unique(rng.integers(1, tokens, tokens // 2000)).astype(np.uint64)
    ends = np.append(ends, np.uint64(tokens))
    shards = []
    for i, lo in enumerate(range(0, tokens, SHARD)):
        n = min(SHARD, tokens - lo)
        rng.integers(1, 32_000, n, dtype=np.uint16).tofile(root / shard_name(i))
        shards.append({"file": shard_name(i), "tokens": n, "sha256": ""})
    ends.tofile(root / DOCUMENTS_NAME)
    doc = {"file": DOCUMENTS_NAME, "sha256": sha256_file(root / DOCUMENTS_NAME)}
    ShardIndex(
        root, "random", 32_000, 0, "uint16", SHARD, len(ends), tokens, shards, doc, {}
    ).write()
    return root


def loader_rows(folder: Path, other: Path, steps: int) -> list[tuple[str, float]]:
    """(row, tokens/s) of one rank's reads."""
    rows = []
    pin = torch.cuda.is_available()
    for name, source in (
        ("prepared folder", str(folder)),
        ("mixture 0.7/0.3", f"{folder}:0.7,{other}:0.3"),
    ):
        train, _ = make_datasets(DataConfig(source=source), SEQ, 32_000)
        sampler = BatchSampler(len(train), PER_RANK * 8, 3, 8, seed=0)  # rank 3 of dp 8

        def read(step: int, train=train, sampler=sampler) -> tuple[torch.Tensor, torch.Tensor]:
            return train.batch(sampler.rank_indices(step))

        read(0)
        t = time.perf_counter()
        for step in range(steps):
            read(step)
        direct = steps * PER_RANK * SEQ / (time.perf_counter() - t)
        rows.append((f"{name}, read in the step", direct))
        loader = BackgroundLoader(read, depth=4, pin=pin)
        loader.get(0)
        t = time.perf_counter()
        for step in range(1, steps + 1):
            loader.get(step)
        rows.append(
            (f"{name}, background thread", steps * PER_RANK * SEQ / (time.perf_counter() - t))
        )
        loader.close()
    return rows


def prepare_rows(tmp: Path, mb: int, vocab: int) -> list[tuple[int, float, int]]:
    """(workers, tokens/s, tokens) of ``plait data prepare``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = read_corpus(DataConfig(max_bytes=mb << 20)).decode("utf-8", "replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text[: 4 << 20].split("\n\n"), trainer)
    tok.save(str(tmp / "tokenizer.json"))
    src = tmp / "docs.jsonl"
    with src.open("w", encoding="utf-8") as f:
        for i in range(0, len(text), 4000):
            f.write(json.dumps({"text": text[i : i + 4000]}) + "\n")
    rows = []
    for workers in (1, 2):
        s = prepare(str(src), str(tmp / f"out{workers}"), f"hf:{tmp}", workers=workers)
        rows.append((workers, s.tokens_per_s, s.tokens))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200_000_000, help="tokens of the folder")
    p.add_argument("--steps", type=int, default=300, help="steps read per row")
    p.add_argument("--prepare-mb", type=int, default=16, help="MiB of text to prepare")
    p.add_argument("--vocab", type=int, default=8_000, help="BPE vocabulary")
    p.add_argument("--out", type=Path, default=None, help="append the section to this file")
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    p.add_argument("--no-prepare", action="store_true", help="part 1 only (gpu_all's row)")
    a = p.parse_args()
    if a.tiny:
        a.tokens, a.steps, a.prepare_mb, a.vocab = 1_000_000, 2, 1, 512
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        folder = random_folder(tmp / "a", a.tokens, 0)
        other = random_folder(tmp / "b", a.tokens // 4, 1)
        loads = loader_rows(folder, other, a.steps)
        (tmp / "prep").mkdir()
        preps = [] if a.no_prepare else prepare_rows(tmp / "prep", a.prepare_mb, a.vocab)
    load = os.getloadavg()[0]
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else platform.processor() or "CPU"
    )
    lines = [
        "<!-- data_loader:begin -->",
        "## Data loader and `plait data prepare` throughput",
        "",
        f"Measured by `python benchmarks/data_loader.py`: one rank (rank 3 of dp 8) reading "
        f"sequences of {SEQ} tokens, {PER_RANK} per step, in the sampler's random order from "
        f"{a.tokens / 1e6:.0f} M random uint16 tokens in shards of 2^24 (memory-mapped); "
        f"{a.steps} steps per row; {device}, {os.cpu_count()} cores, load average {load:.1f}; "
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
        f"Python {platform.python_version()}.",
        "",
        "| loader | tokens/s per rank | x 1 M tokens/s (issue 29's need) |",
        "|---|---|---|",
        *(f"| {n} | {v:,.0f} | {v / 1e6:.1f} |" for n, v in loads),
        "",
        f"`plait data prepare` of {a.prepare_mb} MiB of the built-in corpus as JSONL "
        f"(records of 4,000 characters) with a byte-level BPE of {a.vocab:,} tokens:",
        "",
        "| workers | tokens | tokens/s | tokens/s per worker |",
        "|---|---|---|---|",
        *(f"| {w} | {t:,} | {v:,.0f} | {v / w:,.0f} |" for w, v, t in preps),
        "",
        "<!-- data_loader:end -->",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        with a.out.open("a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    sys.exit(main())
