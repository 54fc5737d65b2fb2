"""``plait data``: prepare data for training.

* ``plait data prepare SRC -o DIR --tokenizer SPEC [--workers N] [--field text]
  [--shard-tokens N] [--dtype uint16|uint32]`` tokenizes SRC (a text file, a folder,
  JSONL, parquet, or a folder saved by Hugging Face ``datasets``) into fixed-size token
  shards with an index (:mod:`plait.data.prepare`); ``plait train --data DIR`` reads it.
  Re-running after an interruption finishes the missing shards only; a finished folder
  is verified and not rewritten.
* Chat or instruction JSONL (``{"messages": [...]}`` or ``{"prompt", "completion"}``
  records, told by the first record) is rendered with the tokenizer folder's chat template
  (``--chat-template FILE`` otherwise) and gets a loss mask (``--train-on
  all|assistant|last``, default assistant); ``--pack SEQ_LEN`` packs samples (chat or
  text documents) whole into windows of SEQ_LEN + 1 tokens (first-fit decreasing over a
  buffer of ``--pack-buffer`` samples; ``--long-samples truncate|refuse``).
* ``plait data info DIR`` prints a prepared folder's index and verifies its files.

A folder source is read by the rule ``plait train --data DIR`` uses: hidden entries,
``__pycache__`` and binary files are skipped, and prepare prints what it skipped.

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
    prep.add_argument(
        "--train-on",
        choices=("all", "assistant", "last"),
        default=None,
        help="chat data: the tokens trained (default assistant: every assistant turn)",
    )
    prep.add_argument("--chat-template", default=None, help="a jinja chat template file")
    prep.add_argument(
        "--pack", type=int, default=None, metavar="SEQ_LEN", help="pack samples into windows"
    )
    prep.add_argument(
        "--long-samples",
        choices=("truncate", "refuse"),
        default="truncate",
        help="--pack: a sample longer than a window is cut (default) or refused",
    )
    prep.add_argument(
        "--pack-buffer", type=int, default=2048, help="--pack: samples packed together"
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
        if idx.samples is not None:
            from plait.data.sample_folder import sample_line

            print(sample_line(idx))
        if bad:
            raise DataError("; ".join(bad))
        print("every file verified (sizes and SHA-256)")
        return 0
    from plait.data.prepare import prepare
    from plait.data.sample_folder import looks_like_chat
    from plait.data.sample_prepare import SampleOptions
    from plait.errors import ConfigError

    chat = looks_like_chat(args.source)
    if not chat and (args.train_on or args.chat_template):
        raise ConfigError(
            f"--train-on and --chat-template are for chat data; {args.source} does not start "
            'with a {"messages": ...} or {"prompt", "completion"} record.'
        )
    samples = None
    if chat or args.pack is not None:
        samples = SampleOptions(
            chat=chat,
            train_on=args.train_on or "assistant",
            chat_template=args.chat_template,
            pack=args.pack,
            long_samples=args.long_samples,
            buffer=args.pack_buffer,
        )
    summary = prepare(
        args.source,
        args.output,
        args.tokenizer,
        workers=args.workers,
        fld=args.field,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
        progress=args.progress,
        samples=samples,
    )
    for note in summary.notes:
        print(f"plait: {note}")
    print(f"plait: {summary.line()}")
    return 0
