"""Compute measurements of this machine: the rates training actually runs at.

Every function here times real PyTorch work on this process, on two clocks (:data:`CLOCKS`:
wall and process CPU time), and returns rates per clock:

* square fp32 matmul FLOP/s over sizes (its best point is the MFU peak);
* a linear layer in training, forward and both gradient GEMMs (the ``matmul`` curve the
  planner charges GEMMs at);
* causal fused attention forward + backward;
* the autograd chain of a block's memory-bound layers (norm, rotary, activation,
  residual), charged as :func:`plait.plan.compute.block_traffic` charges it;
* the fixed cost of one operator call, the training step of a tiny transformer block
  (the fixed cost of a block), and AdamW + clipping;
* a stack of plait's transformer blocks in training on a grid of shapes
  (:func:`measure_block_grid`), which calibrates what the operators cost together
  beyond their rates (``Hardware.block_scale``).

:func:`compute_body` runs them all on one rank of a pool; :mod:`plait.bench.calibrate`
adds the collectives and turns the results into a hardware profile. Like it, this module
is imported on demand and imports torch only inside its functions.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

MATMUL_SIZES = (64, 128, 256, 512, 1024)
ATTENTION_SEQS = (32, 64, 128, 256, 512)
"""Sequence lengths of the attention rate. 32 covers ring attention's chunks (``s/(2·cp)``
keys, :func:`plait.plan.overheads.attention_length`; 32 for cp = 2 at s = 128), which a
curve starting at 64 charged at the 64-point rate: 56 GFLOP/s against 40 measured at 32
(one process, CPU time)."""
ELEMENTWISE_ELEMS = (2**12, 2**14, 2**16, 2**18, 2**20, 2**21)
LINEAR_SIZES = (32, 64, 128, 256, 512)
ATTN_BATCH, ATTN_HEADS, ATTN_HEAD_DIM = 4, 4, 32


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed seconds, what a dedicated machine shows. ``cpu``: this process's CPU
seconds (every thread), blind to time spent descheduled, so a profile measured with it
on a shared machine predicts the work a step costs, not how long others delay it."""

Points = dict[str, list[tuple[float, float]]]
"""``(size, rate)`` points per clock."""


def _median_times(fn: Callable[[], object], reps: int, min_time: float = 0.0) -> dict[str, float]:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up) on every clock of
    :data:`CLOCKS`; calls are grouped so that each timed group lasts at least
    ``min_time``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-9)
    inner = max(1, int(min_time / once))
    samples: dict[str, list[float]] = {c: [] for c in CLOCKS}
    for _ in range(reps):
        start = {c: clock() for c, clock in CLOCKS.items()}
        for _ in range(inner):
            fn()
        for c, clock in CLOCKS.items():
            samples[c].append(max(clock() - start[c], 1e-9) / inner)
    return {c: statistics.median(v) for c, v in samples.items()}


def _rates(points: list[tuple[float, dict[str, float]]], work: Callable[[float], float]) -> Points:
    """``(size, seconds per clock)`` -> ``(size, work(size) / seconds)`` per clock."""
    return {c: [(size, work(size) / t[c]) for size, t in points] for c in CLOCKS}


def measure_matmul(sizes: Sequence[int], reps: int) -> Points:
    """``(n, FLOP/s)`` of an fp32 n x n x n matmul."""
    import torch

    out = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out.append((float(n), _median_times(functools.partial(torch.mm, a, b), reps, 0.02)))
    return _rates(out, lambda n: 2.0 * n**3)


def measure_attention(seqs: Sequence[int], reps: int) -> Points:
    """``(s, FLOP/s)`` of causal SDPA forward + backward, FLOPs = 3 x 4·b·s²·a·d."""
    import torch
    import torch.nn.functional as F

    out = []
    b, a, d = ATTN_BATCH, ATTN_HEADS, ATTN_HEAD_DIM
    for s in seqs:
        q, k, v = (torch.randn(b, a, s, d, requires_grad=True) for _ in range(3))
        g = torch.randn(b, a, s, d)

        def step(q: Any = q, k: Any = k, v: Any = v, g: Any = g) -> None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(g)

        out.append((float(s), _median_times(step, reps, 0.02)))
    return _rates(out, lambda s: 3 * 4.0 * b * s * s * a * d)


MEMORY_BOUND_ELEMENTS = 6 + 9 + 5 + 3
"""Forward elements read or written per element of the calibration chain, as
:func:`plait.plan.compute.block_traffic` charges them: an unfused RMSNorm (6), rotary
(9), silu(a)·b (5), a residual add (3)."""


def measure_elementwise(elems: Sequence[int], reps: int) -> Points:
    """``(tensor bytes, bytes/s)`` of the memory-bound layers of a block *in training*:
    an RMSNorm written in plain PyTorch, a rotary-style rotation of halves, silu(a)·b and
    a residual add on an ``(n/128, 128)`` fp32 tensor, forward and backward, charged as
    the planner charges them (:data:`MEMORY_BOUND_ELEMENTS` x 4 bytes forward, twice that
    backward). Short autograd chains cost far more per byte than one streaming kernel
    (on a CPU ~3x for this chain), so the rate is measured on the chain, not on ``a*b``."""
    import torch
    import torch.nn.functional as F

    out = []
    for n in elems:
        rows = max(1, n // 128)
        x = torch.randn(rows, 128, requires_grad=True)
        w = torch.ones(128, requires_grad=True)
        c, sn = torch.rand(1, 64), torch.rand(1, 64)
        g = torch.randn(rows, 128)

        def step(x: Any = x, w: Any = w, c: Any = c, sn: Any = sn, g: Any = g) -> None:
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # RMSNorm
            y1, y2 = y.chunk(2, dim=-1)
            r = torch.cat((y1 * c - y2 * sn, y1 * sn + y2 * c), dim=-1)  # rotary
            z = F.silu(r) * y  # SwiGLU's activation
            (z + x).backward(g)  # residual

        out.append((4.0 * rows * 128, _median_times(step, reps, 0.01)))
    charged = 3.0 * MEMORY_BOUND_ELEMENTS  # forward + backward (2x)
    return _rates(out, lambda nbytes: charged * nbytes)


def measure_linear(sizes: Sequence[int], reps: int) -> Points:
    """``(size, FLOP/s)`` of a linear layer *in training*: ``y = x·Wᵀ`` with x ``(4n, n)``
    and W ``(n, n)``, forward and both gradients (three GEMMs of ``2·M·K·N`` FLOPs, some
    on transposed operands, and the gradient accumulation); size ``(M·K·N)^(1/3)``."""
    import torch

    out = []
    for n in sizes:
        x = torch.randn(4 * n, n, requires_grad=True)
        w = torch.randn(n, n, requires_grad=True)
        g = torch.randn(4 * n, n)

        def step(x: Any = x, w: Any = w, g: Any = g) -> None:
            (x @ w.t()).backward(g)

        out.append(((4.0 * n**3) ** (1.0 / 3.0), _median_times(step, reps, 0.02)))
    return _rates(out, lambda size: 3 * 2.0 * size**3)


def measure_op_overhead(reps: int) -> dict[str, float]:
    """Seconds of one operator call on a one-element tensor (dispatch cost), per clock."""
    import torch

    x, y = torch.ones(1), torch.ones(1)
    return _median_times(lambda: torch.add(x, y), reps, 0.01)


TINY_BLOCK = {"dim": 32, "n_heads": 2, "max_seq_len": 8}
"""The tiny transformer block whose training step measures the fixed cost of a block
(:func:`measure_tiny_block`); :data:`TINY_BATCH` sequences of its ``max_seq_len``."""
TINY_BATCH = 1


def tiny_block_config() -> Any:
    """The :class:`~plait.config.ModelConfig` of :data:`TINY_BLOCK` (one layer)."""
    from plait.config import ModelConfig

    t = TINY_BLOCK
    return ModelConfig(
        n_layers=1, vocab_size=256, dim=t["dim"], n_heads=t["n_heads"], max_seq_len=t["max_seq_len"]
    )


def measure_tiny_block(reps: int, device: str = "cpu") -> dict[str, float]:
    """Seconds of one forward + backward of plait's transformer :class:`Block` at the
    tiny shape of :data:`TINY_BLOCK`, per clock: almost all of it is the fixed cost of
    a block's module calls, operator dispatch and autograd bookkeeping."""
    import torch

    from plait.model.transformer import Block

    cfg = tiny_block_config()
    blk = Block(cfg).to(device)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.02)
    s, d = cfg.max_seq_len, cfg.dim
    x = torch.randn(TINY_BATCH, s, d, device=device, requires_grad=True)
    half = d // cfg.n_heads // 2
    cos, sin = torch.ones(s, half, device=device), torch.zeros(s, half, device=device)

    def step() -> None:
        blk(x, cos, sin).sum().backward()
        _sync(device)

    return _median_times(step, reps, 0.01)


BLOCK_GRID_DIMS = (64, 128, 256)
"""Hidden sizes of the block grid (:func:`measure_block_grid`): powers of two around small
CPU models. Two points (64 and 256) interpolated log-bilinearly charged a block of hidden
128 up to 10 % below its measured time (0.90 interpolated against 1.00 measured at 256
tokens, one process, CPU time): the ratio is not monotonic in the hidden size, so the
grid measures the power of two between them too."""
BLOCK_GRID_BATCHES = (2, 8, 16)
"""Sequences of :data:`BLOCK_GRID_SEQ` tokens per micro-batch on the grid: 256, 1024 and
2048 tokens."""
BLOCK_GRID_SEQ = 128
"""Sequence length of the block grid."""
BLOCK_GRID_HEAD_DIM = ATTN_HEAD_DIM
"""Head dimension of the grid's blocks (``hidden / 32`` heads): the one the attention rate
is calibrated at, so that the grid's ratio measures how a block's operators compose,
not how attention's rate changes with the head dimension (which its curve, a function
of the sequence length, does not model)."""
BLOCK_GRID_DEPTH = 2
"""Blocks in the timed stack: each block's inputs come from the previous block, as in a
model, not from a cache that one block keeps warm."""


def block_grid_config(dim: int) -> Any:
    """The :class:`~plait.config.ModelConfig` of a grid block of hidden size ``dim``."""
    from plait.config import ModelConfig

    return ModelConfig(
        n_layers=BLOCK_GRID_DEPTH,
        vocab_size=256,
        dim=dim,
        n_heads=max(1, dim // BLOCK_GRID_HEAD_DIM),
        max_seq_len=BLOCK_GRID_SEQ,
    )


def measure_block_grid(
    reps: int,
    dims: Sequence[int] = BLOCK_GRID_DIMS,
    batches: Sequence[int] = BLOCK_GRID_BATCHES,
) -> dict[str, list[tuple[float, float, float]]]:
    """Per clock, ``(hidden, tokens, seconds)`` of one block's forward + backward in
    training, for each hidden size x batch of the grid: a stack of
    :data:`BLOCK_GRID_DEPTH` of plait's :class:`Block` on ``(batch, BLOCK_GRID_SEQ,
    hidden)`` inputs, every gradient set to None before each step (as the trainer's
    ``zero_grad`` does), timed whole and divided by the depth."""
    import torch

    from plait.model.transformer import Block

    out: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CLOCKS}
    for dim in dims:
        cfg = block_grid_config(dim)
        blocks = [Block(cfg, i) for i in range(BLOCK_GRID_DEPTH)]
        params = [p for b in blocks for p in b.parameters()]
        for p in params:
            torch.nn.init.normal_(p, std=0.02)
        s, half = BLOCK_GRID_SEQ, cfg.head_dim // 2
        cos, sin = torch.rand(s, half), torch.rand(s, half)
        for batch in batches:
            x = torch.randn(batch, s, dim, requires_grad=True)  # (batch, seq, hidden)
            g = torch.randn(batch, s, dim)

            def step(
                x: Any = x,
                g: Any = g,
                blocks: Any = blocks,
                params: Any = params,
                rope: Any = (cos, sin),
            ) -> None:
                for p in (*params, x):
                    p.grad = None
                h = x
                for b in blocks:
                    h = b(h, *rope)
                h.backward(g)

            t = _median_times(step, reps)
            for c in CLOCKS:
                out[c].append((float(dim), float(batch * s), t[c] / BLOCK_GRID_DEPTH))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure_optimizer(params: int, tensors: int, reps: int) -> dict[str, float]:
    """Bytes/s of AdamW + gradient clipping per clock, charged 40 bytes per fp32
    parameter (the traffic :func:`plait.plan.estimate.step_time` uses: weights and two
    moments read and written, the gradient read once for the update and three times for
    clipping)."""
    import torch

    per = max(1, params // tensors)
    ps = [torch.nn.Parameter(torch.randn(per)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn(per)
    opt = torch.optim.AdamW(ps, lr=1e-3)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        opt.step()

    t = _median_times(step, reps)
    return {c: 40.0 * per * tensors / t[c] for c in CLOCKS}


def compute_body(ctx: Any, quick: bool) -> dict[str, Any]:
    """On every rank at once: the compute measurements (wall clock; CPU time under
    ``"cpu"``)."""
    import torch

    torch.set_num_threads(1)
    reps = 3 if quick else 7
    sizes = MATMUL_SIZES[:4] if quick else MATMUL_SIZES
    mm = measure_matmul(sizes, reps)
    lin = measure_linear(LINEAR_SIZES[:4] if quick else LINEAR_SIZES, reps)
    at = measure_attention(ATTENTION_SEQS[:4] if quick else ATTENTION_SEQS, reps)
    ew = measure_elementwise(ELEMENTWISE_ELEMS[:4] if quick else ELEMENTWISE_ELEMS, reps)
    oo = measure_op_overhead(reps)
    tb = measure_tiny_block(reps)
    op = measure_optimizer(2**19 if quick else 2**21, 16, reps)
    grid = (
        measure_block_grid(2, BLOCK_GRID_DIMS[:1], BLOCK_GRID_BATCHES[:1])
        if quick
        else (measure_block_grid(5))
    )
    per = {
        c: {
            "matmul": mm[c],
            "linear": lin[c],
            "attention": at[c],
            "elementwise": ew[c],
            "op_overhead": oo[c],
            "tiny_block": tb[c],
            "optimizer": op[c],
            "block_grid": grid[c],
        }
        for c in CLOCKS
    }
    return {**per["wall"], "cpu": per["cpu"]}
