"""``plait checkpoint``: look into and convert plait checkpoints.

* ``plait checkpoint info PATH`` prints what a checkpoint holds: step, layout, optimizer,
  every shard file (sha256 verified) and every tensor with its global shape and the
  pieces it was saved in.
* ``plait checkpoint consolidate PATH -o model.safetensors`` writes the whole model
  into one safetensors file with one-device names; ``plait train --init-from FILE``
  starts a run from it under any layout.
* ``plait checkpoint export PATH --format hf -o DIR [--shard-size BYTES]`` writes the
  model as a Hugging Face Llama folder (``config.json``, safetensors shards and their
  index) that ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads,
  streaming tensor by tensor; a LoRA run's checkpoint needs ``--merge-lora`` (each
  adapted weight written as ``W + (alpha/r) B A``).
* ``plait checkpoint export PATH --format peft -o DIR`` writes a LoRA run's adapter as a
  PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that
  ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the ``transformers`` base.

PATH is a checkpoint folder (``step_<n>``) or a checkpoint root (what its ``latest``
names). A corrupt checkpoint is reported with the failing file (exit code 2). The
checkpoint reader (and torch) is imported when the command runs, not with this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from plait.cli.common import check_output_path

if TYPE_CHECKING:
    from plait.checkpoint import CheckpointReader


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plait checkpoint", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    info = sub.add_parser("info", help="print what a checkpoint holds")
    info.add_argument("path", help="checkpoint folder or checkpoint root")
    info.add_argument("--tensors", action="store_true", help="also list every tensor")
    cons = sub.add_parser("consolidate", help="write the full model as one safetensors file")
    cons.add_argument("path", help="checkpoint folder or checkpoint root")
    cons.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    exp = sub.add_parser("export", help="write the model in another format (Hugging Face)")
    exp.add_argument("path", help="checkpoint folder or checkpoint root")
    exp.add_argument(
        "--format",
        choices=["hf", "peft"],
        default="hf",
        help="hf: a Hugging Face folder; peft: the LoRA adapter as a PEFT adapter folder",
    )
    exp.add_argument(
        "--merge-lora",
        action="store_true",
        help="--format hf of a LoRA checkpoint: write each adapted weight as W + (alpha/r) B A",
    )
    exp.add_argument("-o", "--output", required=True, help="the folder to write (new or empty)")
    exp.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="largest safetensors file, in bytes (default 5 GB)",
    )
    return p


def _export(args: argparse.Namespace) -> int:
    """``plait checkpoint export``."""
    from plait.checkpoint import DEFAULT_SHARD_SIZE, export_hf
    from plait.checkpoint.format import CheckpointError
    from plait.checkpoint.peft_io import export_peft

    reader = _open(args.path)
    if args.format == "peft":
        if args.merge_lora:
            raise CheckpointError("--merge-lora goes with --format hf (merged weights)")
        got = export_peft(reader, args.output)
        print(
            f"plait: wrote the LoRA adapter (rank {got['rank']}, {got['tensors']} tensors) of "
            f"step {got['step']} of {reader.folder} to {args.output}; load it with "
            f"peft.PeftModel.from_pretrained(base_model, {str(args.output)!r})"
        )
        return 0
    summary = export_hf(
        reader, args.output, args.shard_size or DEFAULT_SHARD_SIZE, merge_lora=args.merge_lora
    )
    print(
        f"plait: wrote {args.output} ({len(summary['files'])} safetensors file(s), "
        f"{summary['tensors']} tensors, {summary['parameters']:,} parameters, "
        f"{summary['bytes']:,} bytes) from step {summary['step']} of {reader.folder}; load "
        f"it with transformers.AutoModelForCausalLM.from_pretrained({str(args.output)!r})"
    )
    return 0


def _open(path: str) -> CheckpointReader:
    from plait.checkpoint import find_checkpoint

    reader = find_checkpoint(path, None)
    assert reader is not None  # an explicit path never yields "no checkpoint"
    return reader


def describe(reader: CheckpointReader) -> str:
    """What a checkpoint holds, for ``plait checkpoint info``."""
    m = reader.meta
    lay = m["layout"]
    numel = sum(e.numel for e in reader.params.values())
    lines = [
        f"checkpoint {reader.folder} ({m['format']} v{m['version']}): step {m['step']} "
        f"(schedule step {m['sched_step']}, {m['optimizer']['skipped']} skipped)",
        f"layout: world {lay['world_size']} = dp {lay['dp']} x tp {lay['tp']} x pp "
        f"{lay['pp']} x cp {lay['cp']}; zero {lay['zero']}; dtype {lay['dtype']}",
        f"optimizer: {m['optimizer']['class']}; sampler step {m['sampler']['step']}; "
        f"loss scaler {m['optimizer']['scaler'] or '-'}",
        f"{len(reader.params)} tensors, {numel:,} parameters; files (sha256 verified):",
    ]
    for name, f in m["files"].items():
        lines.append(f"  {name}  {f['bytes']:,} bytes  sha256 {f['sha256'][:16]}")
    lines.append("tensors: name, global shape, stored dtype, pieces (file, tp block, range):")
    for name, e in reader.params.items():
        pieces = ", ".join(
            f"{p.file.split('.')[0]} "
            + (f"tp{p.tp.index // p.tp.replicas}/{p.tp.shards}@{p.tp.dim} " if p.tp else "")
            + f"[{p.start}:{p.end})"
            for p in e.pieces
        )
        lines.append(f"  {name}  {e.shape}  {e.dtype}  {pieces}")
    return "\n".join(lines)


def checkpoint_main(argv: Sequence[str]) -> int:
    """``plait checkpoint``; returns the exit code."""
    from plait.checkpoint import consolidate

    args = _parser().parse_args(list(argv))
    if args.action == "info":
        text = describe(_open(args.path))
        if not args.tensors:
            text = text.split("\ntensors:")[0]
        print(text)
        return 0
    if args.action == "export":
        return _export(args)
    check_output_path(args.output, "-o/--output")  # before the checkpoint is read
    reader = _open(args.path)
    out = Path(args.output)
    summary = consolidate(reader, out)  # verified once, by _open
    print(
        f"plait: wrote {out} ({summary['tensors']} tensors, {summary['parameters']:,} "
        f"parameters, {summary['bytes']:,} bytes) from step {summary['step']} of "
        f"{reader.folder}; start a run from it with --init-from {out}"
    )
    return 0
