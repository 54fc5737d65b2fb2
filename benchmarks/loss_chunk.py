"""The default loss's forward + backward, whole vs chunked over tokens (``train.loss_chunk``).

For logits ``(tokens, vocab)`` it times plait's default loss (``cross_entropy_loss``)
at several chunk sizes, median of ``--repeat`` runs (ABAB order within one process), and
counts the bytes alive at the peak of forward + backward beyond the logits and their
gradient (a ``TorchDispatchMode`` that follows every storage operators return). Prints a
table; this is what chose ``train.loss_chunk``'s default.

    python benchmarks/loss_chunk.py --tokens 4096 --vocab 8192
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from plait.parallel.loss import cross_entropy_loss, loss_input


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages operators return, while they are alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.nbytes() and s._cdata not in self.refs:
                    self.refs[s._cdata] = (StorageWeakRef(s), s.nbytes())
        for k in [k for k, (r, _) in self.refs.items() if r.expired()]:
            del self.refs[k]
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def run(chunk: int, logits: torch.Tensor, targets: torch.Tensor, count: bool) -> tuple[float, int]:
    fn = cross_entropy_loss(chunk=chunk)
    x = logits.clone().requires_grad_(True)
    mode = PeakBytes() if count else None
    t0 = time.perf_counter()
    if mode is not None:
        with mode:
            fn(loss_input(fn, x), targets).backward()
    else:
        fn(loss_input(fn, x), targets).backward()
    return time.perf_counter() - t0, (mode.peak if mode is not None else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--chunks", default="0,512,1024,2048,4096")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--tiny", action="store_true", help="smallest run (the test suite's)")
    a = p.parse_args()
    if a.tiny:
        a.tokens, a.vocab, a.chunks, a.repeat = 64, 128, "0,32", 1
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(a.tokens, a.vocab, generator=g).to(dtype)  # (tokens, vocab)
    targets = torch.randint(0, a.vocab, (a.tokens,), generator=g)
    chunks = [int(c) for c in a.chunks.split(",")]
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for _ in range(a.repeat):
        for c in chunks:
            times[c].append(run(c, logits, targets, False)[0])
    base = statistics.median(times[chunks[0]])
    both = 2 * logits.numel() * logits.element_size()  # the logits and their gradient
    print(
        f"# loss_chunk: tokens {a.tokens}, vocab {a.vocab}, {a.dtype}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, median of {a.repeat}"
    )
    print("| loss_chunk | fwd+bwd ms | vs first | peak MiB beyond logits + grad |")
    print("|---:|---:|---:|---:|")
    for c in chunks:
        med = statistics.median(times[c])
        peak = run(c, logits, targets, True)[1] - both
        print(f"| {c} | {1e3 * med:.1f} | {med / base:.2f} | {peak / 2**20:.1f} |")


if __name__ == "__main__":
    main()
