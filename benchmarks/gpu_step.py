"""One training step on one device: plait against a plain PyTorch loop, eager and compiled.

Rows (same model, same seed, same batch, same number of steps):

* ``plait eager`` — ``parallelize`` + :class:`plait.optim.Optimizer` (what ``plait train``
  runs: bf16 parameters with fp32 masters on a GPU, gradient clipping 1.0, the default
  chunked loss ``--loss-chunk``);
* ``plait compiled`` — the same with ``train.compile = true`` (skipped, with a note, when
  this plait has no such field);
* ``plait compiled + float8`` — also ``precision.float8 = true`` (skipped where float8
  is refused: CPU, GPU below sm_89, no torchao);
* ``plain eager`` — plait's ``Transformer`` in a hand-written loop: fp32 weights, bf16
  autocast (on CUDA), ``F.cross_entropy``, AdamW (fused on CUDA) with plait's defaults
  (lr, betas, weight decay on matrices) and the same clipping (1.0, foreach);
* ``plain compiled`` — the same loop on ``torch.compile(model)``.

Columns: tokens/s (median step after the warm-up), MFU (6·N + attention FLOPs per token,
plait's ``flops_per_token``, over the device's peak), peak memory (CUDA's
``max_memory_allocated``; "-" on the CPU) and the loss of the last step.

The default model is issue 28's 0.89 B llama (dim 2048, 16 layers, 16 heads, 8 KV heads,
MLP 5632, vocabulary 32000), sequence 2048, batch 4. ``--device cpu --tiny`` runs a
tiny model on the CPU in seconds (CI checks the script with it).

    python benchmarks/gpu_step.py --device cuda --steps 20
    python benchmarks/gpu_step.py --device cpu --tiny --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from plait import init_mesh, parallelize
from plait.arch import flops_per_token
from plait.config import Config, ModelConfig, PrecisionConfig, TrainConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.float8 import check_float8
from plait.train.metrics import peak_flops
from plait.train.start import make_optimizer

ROWS = ("plait eager", "plait compiled", "plait compiled + float8", "plain eager", "plain compiled")


def model_config(a: argparse.Namespace) -> ModelConfig:
    """The benchmark's model (issue 28's 0.89 B llama, or the tiny one)."""
    if a.tiny:
        return ModelConfig(
            vocab_size=256,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=128,
            max_seq_len=a.seq,
        )
    return ModelConfig(
        vocab_size=a.vocab,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=a.heads,
        n_kv_heads=a.kv_heads,
        ffn_dim=a.ffn,
        max_seq_len=a.seq,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(
    step: Callable[[], float], a: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Run ``step`` warm-up + measured times; median seconds and the last loss."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], float("nan")
    for i in range(a.warmup + a.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"seconds": statistics.median(times), "loss": loss, "peak_bytes": peak}


def plait_row(
    cfg: ModelConfig,
    a: argparse.Namespace,
    x: torch.Tensor,
    y: torch.Tensor,
    compiled: bool,
    float8: bool,
) -> dict[str, Any]:
    """plait's own path: parallelize on a one-rank mesh, plait's Optimizer."""
    device = x.device
    train: dict[str, Any] = {"seq_len": a.seq, "global_batch": a.batch, "loss_chunk": a.loss_chunk}
    if compiled:
        train["compile"] = True
    run = Config(
        model=cfg,
        train=TrainConfig(**train),
        precision=PrecisionConfig(dtype=a.dtype, float8=float8),
    )
    with torch.device("meta"):
        model = Transformer(cfg, seed=0)
    pm = parallelize(model, init_mesh(device=device), run)
    opt = Optimizer(pm, make_optimizer(pm, run), max_norm=run.train.grad_clip)
    for group in opt.param_groups:  # the peak rate from the first step (no warm-up)
        group["lr"] = run.train.lr

    def step() -> float:
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return _timed(step, a, device)


def plain_row(
    cfg: ModelConfig, a: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, compiled: bool
) -> dict[str, Any]:
    """A hand-written loop: fp32 weights, bf16 autocast on CUDA, AdamW."""
    device = x.device
    model = Transformer(cfg, seed=0).to(device)
    fwd = torch.compile(model) if compiled else model
    t = TrainConfig()  # plait's defaults: lr, betas, weight decay on matrices, clip 1.0
    groups = [
        {"params": g["params"], "weight_decay": g["weight_decay"]}
        for g in make_optimizer(model, Config(train=t)).param_groups
    ]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device.type == "cuda")
    autocast = device.type == "cuda" and a.dtype != "fp32"
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = fwd(x)  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return _timed(step, a, device)


def _force_backend(backend: str) -> None:
    """Make every ``torch.compile`` of this process use ``backend`` (plait's per-block
    compile names inductor itself)."""
    real = torch.compile

    def compile_with(*args: Any, **kw: Any) -> Any:
        return real(*args, **{**kw, "backend": backend})

    torch.compile = compile_with  # type: ignore[assignment]


def skip_reason(row: str, device: torch.device) -> str | None:
    """Why ``row`` cannot run here (None: it can)."""
    if "float8" in row:
        try:
            check_float8(True, device.type)
        except ConfigError as e:
            return str(e).split(";")[0].split(".")[0]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 32)")
    p.add_argument("--batch", type=int, default=None, help="default 4 (tiny: 4)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per row")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per row")
    p.add_argument("--dtype", default=None, help="bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--loss-chunk", type=int, default=TrainConfig().loss_chunk)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--jsonl", default=None, help="append each row here as soon as measured")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend for the compiled rows ('eager': the CPU check of the "
        "wiring, without a compiler)",
    )
    a = p.parse_args(argv)
    if a.compile_backend != "inductor":
        _force_backend(a.compile_backend)
    device = torch.device(a.device)
    a.seq = a.seq or (32 if a.tiny else 2048)
    a.batch = a.batch or 4
    a.dtype = a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    cfg = model_config(a)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (batch, seq) each
    peak = peak_flops(device, a.peak_tflops)
    fpt = flops_per_token(cfg, a.seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"# gpu_step: {device} ({name}), "
        f"torch {torch.__version__}, dtype {a.dtype}, batch {a.batch} x seq {a.seq}, "
        f"{a.steps} steps after {a.warmup} warm-up, loss_chunk {a.loss_chunk}; peak: {peak.source}"
    )
    print("| run | tokens/s | MFU | peak memory GiB | loss after N steps |")
    print("|---|---:|---:|---:|---:|")
    results = []
    for row in [r.strip() for r in a.rows.split(",") if r.strip()]:
        if row not in ROWS:
            raise SystemExit(f"gpu_step: unknown row {row!r}; rows are {', '.join(ROWS)}")
        result = measure_row(row, cfg, a, x, y, fpt, peak.flops)
        results.append(result)
        if a.jsonl:  # as soon as measured: a later row that dies loses nothing
            with open(a.jsonl, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"device": str(device), "torch": torch.__version__, "rows": results}, f, indent=1
            )
    return 1 if any("error" in r for r in results) else 0


def measure_row(
    row: str,
    cfg: ModelConfig,
    a: argparse.Namespace,
    x: torch.Tensor,
    y: torch.Tensor,
    fpt: float,
    peak_flops_: float | None,
) -> dict[str, Any]:
    """One row, printed as soon as measured; a row that raises is printed and returned
    with its error (the next row still runs)."""
    device = x.device
    why = skip_reason(row, device)
    if why is not None:
        print(f"| {row} | skipped: {why} | | | |", flush=True)
        return {"run": row, "skipped": why}
    compiled = "compiled" in row
    try:
        if row.startswith("plait"):
            r = plait_row(cfg, a, x, y, compiled, "float8" in row)
        else:
            r = plain_row(cfg, a, x, y, compiled)
    except Exception as exc:  # recorded, and the next row runs
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"| {row} | failed: {type(exc).__name__}: {line} | | | |", flush=True)
        return {"run": row, "error": f"{type(exc).__name__}: {line}"}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset() if compiled else None
    tps = a.batch * a.seq / r["seconds"]
    mfu = tps * fpt / peak_flops_ if peak_flops_ else None
    mem = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
    mfu_s = "-" if mfu is None else f"{100 * mfu:.1f} %"
    print(f"| {row} | {tps:,.0f} | {mfu_s} | {mem} | {r['loss']:.4f} |", flush=True)
    return {"run": row, "tokens_per_s": tps, "mfu": mfu, **r}


if __name__ == "__main__":
    sys.exit(main())
