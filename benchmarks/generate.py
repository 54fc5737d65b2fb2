"""Decode speed on one CPU process: plait's KV cache against recomputing the sequence,
and against Hugging Face transformers' own ``generate`` on a Llama of the same shape.

Four implementations generate greedy tokens after the same 32-token prompt, one torch
thread, fp32, batch 1:

* ``plait kv-cache`` — :class:`plait.model.generate.CachedDecoder` on plait's
  Transformer (prefill, then one token per step over the cache);
* ``plait recompute`` — :class:`~plait.model.generate.RecomputeDecoder`: the model on
  the whole growing sequence for every token (what a loop without a cache does);
* ``plait hf-cache`` — :class:`~plait.model.generate.HFCachedDecoder`: plait's loop over
  transformers' ``LlamaForCausalLM`` with its ``DynamicCache`` (``model.family
  hf-llama``);
* ``hf generate`` — ``LlamaForCausalLM.generate(do_sample=False)``, transformers' own
  loop and cache, on the same Llama weights.

Each cell is the median (and inter-quartile range) of ``--repeats`` runs of new tokens
per second, prefill included; the implementations rotate inside every repeat. The last
column says whether the tokens equal those of the reference of the same model (plait's
recompute for the Transformer, ``hf generate`` for the Llama).

Run from the repository root::

    python benchmarks/generate.py                            # print the table
    python benchmarks/generate.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from plait.bench.results import command_line, environment, load_average, write_section
from plait.bench.timing import median_iqr
from plait.config import ModelConfig
from plait.model.factory import build_model
from plait.model.generate import SampleSettings, generate, make_decoder

PROMPT = 32


def _shape(family: str, dim: int, layers: int) -> ModelConfig:
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=4,
        max_seq_len=2048,
        family=family,
        tie_embeddings=False,
    )


def _runners(dim: int, layers: int, new: int) -> dict[str, Callable[[], list[int]]]:
    """Each implementation as a function returning its new tokens."""
    torch.manual_seed(0)
    plait = build_model(_shape("plait", dim, layers), seed=0).eval()
    hf = build_model(_shape("hf-llama", dim, layers), seed=0).eval()
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1))
    ids = [int(i) for i in prompt]
    s = SampleSettings(max_new_tokens=new)
    size = PROMPT + new

    def hf_generate() -> list[int]:
        with torch.no_grad():
            out = hf.generate(  # type: ignore[operator]
                prompt[None],
                max_new_tokens=new,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                eos_token_id=None,
                min_new_tokens=new,
            )
        return [int(i) for i in out[0, PROMPT:]]

    return {
        "plait kv-cache": lambda: generate(make_decoder(plait, size), ids, s),
        "plait recompute": lambda: generate(make_decoder(plait, size, kv_cache=False), ids, s),
        "plait hf-cache": lambda: generate(make_decoder(hf, size), ids, s),
        "hf generate": hf_generate,
    }


REFERENCE = {
    "plait kv-cache": "plait recompute",
    "plait recompute": "plait recompute",
    "plait hf-cache": "hf generate",
    "hf generate": "hf generate",
}


def measure(
    dim: int, layers: int, new: int, repeats: int
) -> list[tuple[str, float, float, float, bool]]:
    runners = _runners(dim, layers, new)
    names = list(runners)
    rates: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            tokens[name] = runners[name]()
            rates[name].append(new / (time.perf_counter() - t0))
    rows = []
    for name in names:
        med, lo, hi = median_iqr(rates[name])
        rows.append((name, med, lo, hi, tokens[name] == tokens[REFERENCE[name]]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    ap.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    args = ap.parse_args()
    if args.tiny:
        args.dim, args.layers, args.new, args.repeats = 32, 1, [4], 2
    torch.set_num_threads(1)
    load0 = load_average()
    lines = [
        "| model | new tokens | implementation | tokens/s (median) | IQR "
        "| same tokens as its reference |",
        "|---|---|---|---|---|---|",
    ]
    for new in args.new:
        for name, med, lo, hi, same in measure(args.dim, args.layers, new, args.repeats):
            model = f"dim {args.dim}, {args.layers} layers, 8 heads / 4 kv"
            lines.append(f"| {model} | {new} | {name} | {med:.1f} | {lo:.1f}-{hi:.1f} | {same} |")
    print("\n".join(lines), flush=True)
    if args.out is None:
        return
    text = "\n".join(
        [
            "## Generation: KV cache against recompute and transformers' generate (CPU)",
            "",
            f"Measured by `{command_line(__file__)}`: one process, 1 torch thread, fp32, "
            f"batch 1, greedy, a {PROMPT}-token prompt (prefill included in tokens/s); "
            f"load average {load0:.1f} -> {load_average():.1f}; {environment()}.",
            "",
            *lines,
        ]
    )
    write_section(args.out, "generate", text)
    print(f"wrote the section 'generate' of {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
