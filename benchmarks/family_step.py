"""The cost of each Hugging Face family's block features: CPU step time against Llama.

One process, plait's built-in ``Transformer`` at the same size for every family, the
family's features turned on as its spec maps them (:mod:`plait.arch.families`): Qwen2's
q/k/v biases, Qwen3's per-head q/k norms (and its head width, here dim / heads so the
matmuls are the same), Phi-3 (Llama's block: its fused tensors exist only in the files),
OLMo 2's q/k norms over the projection and post-norms. Each is timed for ``--steps``
forward + backward + AdamW steps after ``--warmup``; the table gives the median wall time
per step and the ratio to Llama's (the features' cost).

Run from the repository root::

    python benchmarks/family_step.py              # dim 256, 4 layers, seq 256, batch 4
    python benchmarks/family_step.py --tiny       # the test's smallest form
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FEATURES: dict[str, dict[str, object]] = {
    "llama": {},
    "qwen2": {"attention_bias": "qkv"},
    "qwen3": {"qk_norm": "head"},
    "phi3": {},
    "olmo2": {"qk_norm": "projection", "norm_placement": "post"},
}
"""The ModelConfig fields each family's spec turns on (Mistral is Llama's block plus a
window, timed by the attention benchmarks)."""


def _setup(family: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from plait.config import ModelConfig
    from plait.model import Transformer

    cfg = ModelConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        n_kv_heads=args.heads // 2, max_seq_len=args.seq, arch=family,  # type: ignore[arg-type]
        **FEATURES[family],  # type: ignore[arg-type]
    )  # fmt: skip
    model = Transformer(cfg, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_ms(args: argparse.Namespace) -> dict[str, float]:
    """Median wall milliseconds of one training step of each family's model; the
    families take turns step by step, so a load that comes and goes hits each alike."""
    runs = {f: _setup(f, args) for f in FEATURES}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    times: dict[str, list[float]] = {f: [] for f in FEATURES}
    for i in range(args.warmup + args.steps):
        for f, (model, opt) in runs.items():
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i >= args.warmup:
                times[f].append(time.perf_counter() - t0)
    return {f: 1e3 * statistics.median(t) for f, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the smallest form (tests)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if args.tiny:
        args.dim, args.layers, args.heads, args.seq, args.batch = 32, 2, 4, 16, 2
        args.vocab, args.steps, args.warmup = 64, 2, 1
    torch.manual_seed(0)
    ms = step_ms(args)
    print(
        f"dim {args.dim}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, {torch.get_num_threads()} CPU threads"
    )
    print("| family | step (ms) | / llama |")
    print("|---|---|---|")
    for f, t in ms.items():
        print(f"| {f} | {t:.1f} | {t / ms['llama']:.2f} |")


if __name__ == "__main__":
    main()
