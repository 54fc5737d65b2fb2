"""``plait data``: prepare data for training.

* ``plait data prepare SRC -o DIR --tokenizer SPEC [--workers N] [--field text]
  [--shard-tokens N] [--dtype uint16|uint32]`` tokenizes SRC (a text file, a folder,
  JSONL, parquet, or a folder saved by Hugging Face ``datasets``) into fixed-size token
  shards with an index (:mod:`plait.data.prepare`); ``plait train --data DIR`` reads it.
  Re-running after an interruption finishes the missing shards only; a finished folder
  is verified and not rewritten.
* ``plait data info DIR`` prints a prepared folder's index and verifies its files.

Bad input (a missing file or field, an unreadable or empty source, a tokenizer whose
vocabulary does not fit the token dtype) exits with code 2, naming the file.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from plait.config import TOKEN_DTYPES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plait data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="tokenize a source into shards with an index")
    prep.add_argument("source", help="text file, folder, .jsonl, .parquet or a datasets folder")
    prep.add_argument("-o", "--output", required=True, help="the folder to write")
    prep.add_argument(
        "--tokenizer", required=True, help="byte, tiktoken:NAME, or hf:PATH (tokenizer.json)"
    )
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    prep.add_argument("--field", default="text", help="JSONL/parquet/datasets text field")
    prep.add_argument(
        "--shard-tokens", type=int, default=1 << 26, help="tokens per shard (default 2^26)"
    )
    prep.add_argument(
        "--dtype",
        choices=TOKEN_DTYPES,
        default=None,
        help="token dtype (default: uint16 when the vocabulary fits, else uint32)",
    )
    bar = prep.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None)
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    info = sub.add_parser("info", help="print a prepared folder's index and verify it")
    info.add_argument("path", help="a prepared folder")
    return p


def data_main(rest: Sequence[str]) -> int:
    """``plait data``."""
    args = _parser().parse_args(list(rest))
    if args.action == "info":
        from plait.data.index import read_index
        from plait.errors import DataError

        idx = read_index(args.path)
        bad = idx.problems()
        print(
            f"{idx.root}: {idx.documents:,} documents, {idx.tokens:,} tokens ({idx.dtype}) in "
            f"{len(idx.shards)} shard(s); tokenizer {idx.tokenizer} (vocabulary "
            f"{idx.vocab_size:,}, eos {idx.eos_id})"
        )
        if bad:
            raise DataError("; ".join(bad))
        print("every file verified (sizes and SHA-256)")
        return 0
    from plait.data.prepare import prepare

    summary = prepare(
        args.source,
        args.output,
        args.tokenizer,
        workers=args.workers,
        fld=args.field,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
        progress=args.progress,
    )
    print(f"plait: {summary.line()}")
    return 0
