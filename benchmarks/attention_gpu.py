"""One attention layer's forward + backward on one GPU: SDPA vs blockwise attention.

The core of one layer (16 heads, 8 KV heads, head 128, bf16, causal, batch 1): torch's
``scaled_dot_product_attention`` against :func:`plait.model.blockwise_attention`
(through the fused CUDA kernels of :mod:`plait.model.attention_kernels`) at query
blocks of 128, 1024 and the whole sequence, and :class:`RingAttention` on a cp axis of
one rank (its own block as one causal kernel call: what a ring step costs per block),
for sequences 4096 and 16384. Time: median of ``--repeats`` runs after two warm-up runs,
CUDA-synchronised; the ratio is to SDPA at the same sequence (target: <= 1.3 for large
blocks). A blockwise or ring row during which a fused kernel failed (and the fallback
ran: :func:`plait.model.attention_kernels.fallbacks`) is refused: recorded as failed
with the kernel's error, not timed as fused. With document masking (``--documents N``:
an end-of-document token every N tokens) both sides use the block-causal mask (SDPA: a
boolean mask).

Usage (repository root): ``python benchmarks/attention_gpu.py [--out benchmarks/RESULTS.md]``;
``--tiny`` runs a small CPU version (float32, 4/2 heads of 16, sequences 64 and 128,
blocks 16/32/whole) that the test suite runs to keep the script working.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (two warm-up calls first)."""
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(
    core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
) -> Callable[[], None]:
    def run() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        core(qq, kk, vv).backward(dout)

    return run


def _cores(
    s: int, heads: int, kv_heads: int, device: torch.device, documents: int | None
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """SDPA, blockwise (``block_size`` keyword) and ring cores at sequence ``s``."""
    from plait import init_mesh
    from plait.model.blockwise_attention import blockwise_attention
    from plait.model.document_mask import document_ids, visible
    from plait.parallel.context.ring_attention import RingAttention

    ring = RingAttention(init_mesh(device=device.type).axis("cp"))
    docs = None
    mask = None
    if documents:
        tokens = torch.ones(1, s, dtype=torch.long, device=device)
        tokens[:, documents - 1 :: documents] = 0
        docs = document_ids(tokens, 0)  # (1, s)
        pos = torch.arange(s, device=device)
        mask = visible(docs, docs, pos, pos)  # (1, 1, s, s)
    groups = heads // kv_heads

    def sdpa(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if mask is None:
            return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
        b, c = b.repeat_interleave(groups, 1), c.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask)

    def blockwise(
        a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        return blockwise_attention(a, b, c, causal=True, block_size=block_size, doc_ids=docs)[0]

    def rg(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ring(a, b, c) if docs is None else ring(a, b, c, docs)

    return sdpa, blockwise, rg


def fused_problem() -> str | None:
    """Why the row just timed is not a fused-kernel figure: a kernel failed during it
    (at some call site) and the fallback ran instead; None when it is."""
    from plait.model import attention_kernels as kernels

    failed, fell = kernels.disabled(), kernels.fallbacks()
    if not failed and not fell:
        return None
    where = "; ".join(
        f"{k} at {site}: {line}" for site, d in failed.items() for k, line in d.items()
    )
    return f"ran the fallback ({sum(fell.values())} calls): {where or 'a kernel failed'}"


def measure(
    name: str, fused: bool, fn: Callable[[], None], device: torch.device, repeats: int
) -> tuple[float | None, str | None]:
    """(seconds, None), or (None, the error) when ``fn`` raised or (``fused``) a kernel
    failed and the fallback ran: such a row is refused, not reported as fused."""
    from plait.model import attention_kernels as kernels

    kernels.reset()
    try:
        t = _time(fn, device, repeats)
    except Exception as exc:  # recorded, and the next row runs
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"{type(exc).__name__}: {line}"
    problem = fused_problem() if fused else None
    return (None, problem) if problem else (t, None)


def rows(
    seqs: list[int],
    blocks: list[int | None],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    documents: int | None,
    jsonl: str | None = None,
) -> list[list[str]]:
    """Table rows (sequence, attention, ms, ratio to SDPA), each printed and appended to
    ``jsonl`` as soon as measured; a failing row is recorded with its error."""
    out = []
    for s in seqs:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (
            torch.randn(1, h, s, head_dim, generator=g, device=device).to(dtype)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        sdpa, blockwise, ring = _cores(s, heads, kv_heads, device, documents)
        cores: list[tuple[str, bool, Callable[..., torch.Tensor]]] = [("SDPA", False, sdpa)]
        for block in blocks:
            core = functools.partial(blockwise, block_size=s if block is None else block)
            cores.append((f"blockwise, block {'whole' if block is None else block}", True, core))
        cores.append(("ring, cp 1 (own block)", True, ring))
        base: float | None = None
        for name, fused, core in cores:
            t, error = measure(name, fused, _fwd_bwd(core, q, k, v, dout), device, repeats)
            if name == "SDPA":
                base = t
            if t is None:
                row = [str(s), name, f"failed: {error}", "-"]
            else:
                ratio = f"{t / base:.2f}" if base else "-"
                row = [str(s), name, f"{t * 1e3:.2f}", ratio]
            print(f"| {' | '.join(row)} |", flush=True)
            out.append(row)
            if jsonl:
                rec = {"sequence": s, "attention": name, "documents": documents}
                rec.update({"ms": t * 1e3} if t is not None else {"error": error})
                with open(jsonl, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small CPU run (for the tests)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--documents", type=int, default=None, help="EOS every N tokens")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--jsonl", default=None, help="append each row here as soon as measured")
    a = ap.parse_args()
    if a.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        seqs, blocks, shape = [64, 128], [16, 32, None], (4, 2, 16)
        repeats = 1
    else:
        if not torch.cuda.is_available():
            sys.exit("attention_gpu.py needs CUDA (or --tiny for the small CPU run)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        seqs, blocks, shape = [4096, 16384], [128, 1024, None], (16, 8, 128)
        repeats = a.repeats
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = (
        f"One attention layer, forward + backward: {shape[0]} heads, {shape[1]} KV heads, "
        f"head {shape[2]}, {str(dtype).removeprefix('torch.')}, causal, batch 1"
        + (f", documents of {a.documents} tokens" if a.documents else "")
        + f"; {dev}, torch {torch.__version__}; median of {repeats}."
    )
    print(head + "\n\n| sequence | attention | ms | x SDPA |\n|---:|---|---:|---:|", flush=True)
    table = rows(seqs, blocks, *shape, dtype, device, repeats, a.documents, a.jsonl)
    lines = [
        head,
        "",
        "| sequence | attention | ms | x SDPA |",
        "|---:|---|---:|---:|",
        *[f"| {' | '.join(r)} |" for r in table],
    ]
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    if any(r[2].startswith("failed") for r in table):
        sys.exit(1)


if __name__ == "__main__":
    main()
