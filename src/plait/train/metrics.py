"""Per-step metrics: throughput, MFU, communication; JSONL output; progress display."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' datasheets, for the MFU estimate.
_GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


PEAK_SIZES = (256, 512, 1024)
"""Square fp32 matmul sizes the CPU peak is measured at (the best size's rate counts)."""


@dataclass(frozen=True)
class Peak:
    """The per-device peak FLOP/s that MFU divides by, and where it came from."""

    flops: float | None
    """FLOP/s per device; None when it could not be known (MFU is then not reported)."""
    source: str
    """How it was obtained, for the banner (``measured fp32 matmul, 2 threads ...``)."""


def _rates(device: torch.device, size: int, reps: int) -> list[float]:
    """FLOP/s of ``reps`` timed ``size``³ matmuls after two untimed warm-up runs."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    out: list[float] = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if i >= 2:
            out.append(2.0 * size**3 / dt)
    return out


def measure_peak_flops(
    device: torch.device, sizes: tuple[int, ...] = PEAK_SIZES, reps: int = 5, spread: float = 2.0
) -> Peak:
    """The fp32 matmul rate of this process at its own thread count (what a rank trains
    with), robustly: two warm-up runs per size, the median of ``reps`` timed runs at each
    of ``sizes``, the best size's median. If the timed runs at that size disagree by more
    than ``spread`` times (a machine busy with other work), the peak is reported unknown
    rather than a number that would make MFU swing from run to run.
    """
    best: tuple[float, list[float], int] | None = None
    for size in sizes:
        rates = sorted(_rates(device, size, reps))
        median = rates[len(rates) // 2]
        if best is None or median > best[0]:
            best = (median, rates, size)
    assert best is not None
    median, rates, size = best
    threads = torch.get_num_threads()
    if rates[-1] > spread * rates[0]:
        return Peak(
            None,
            f"unknown: fp32 matmul rates at {size} on {threads} thread(s) varied "
            f"{rates[-1] / rates[0]:.1f}x (a busy machine); set log.peak_tflops to report MFU",
        )
    return Peak(
        median,
        f"measured: fp32 matmul median at {size}, {threads} thread(s), "
        f"{median / 1e9:,.1f} GFLOP/s per rank",
    )


def peak_flops(device: torch.device, override_tflops: float | None) -> Peak:
    """Peak FLOP/s of one device: the override, a datasheet figure, or a measurement."""
    if override_tflops is not None:
        return Peak(override_tflops * 1e12, f"log.peak_tflops = {override_tflops:g} TFLOP/s")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return Peak(tflops * 1e12, f"{name} datasheet bf16 dense, {tflops:g} TFLOP/s")
    return measure_peak_flops(device)


@dataclass
class StepMetrics:
    """What one optimizer step reports (rank 0 writes one JSON line of these)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    mfu: float | None
    """Model FLOPs utilization; None when the device's peak is unknown."""
    step_seconds: float
    comm_bytes: float
    comm_seconds: float
    val_loss: float | None = None
    skipped: bool = False
    """The step was skipped (non-finite loss/gradients): weights and schedule unchanged."""
    loss_scale: float | None = None
    """fp16: the dynamic loss scale this step's loss was multiplied by."""
    peak_memory_bytes: float | None = None
    """Peak device memory allocated during the step, where the device reports it (CUDA)."""
    memory: dict[str, int] | None = None
    """Per-rank state bytes by category (plait.train.memory), on the first step."""
    stragglers: list[dict[str, float]] | None = None
    """Ranks whose compute time this step exceeded the median by train.straggler_factor:
    ``{"rank", "factor"}`` each (plait.train.faults)."""
    moe: dict[str, float] | None = None
    """Mixture of experts: the step's load-balancing and z-loss, fewest/most assignments
    per expert, dropped assignments (``ParallelModel.moe_summary``); None: dense model."""

    def line(self) -> str:
        """A plain log line."""
        mfu = "n/a" if self.mfu is None else f"{100 * self.mfu:.1f}%"
        s = (
            f"step {self.step:5d} | loss {self.loss:.4f} | lr {self.lr:.2e} | "
            f"grad {self.grad_norm:.3f} | {self.tokens_per_s:,.0f} tok/s | "
            f"mfu {mfu} | comm {self.comm_bytes / 2**20:.2f} MiB "
            f"{1000 * self.comm_seconds:.0f} ms"
        )
        if self.loss_scale is not None:
            s += f" | scale {self.loss_scale:g}"
        if self.peak_memory_bytes is not None:
            s += f" | peak {self.peak_memory_bytes / 2**20:.0f} MiB"
        if self.moe:
            m = self.moe
            s += (
                f" | moe aux {m['moe_aux_loss']:.3f} load {m['moe_load_min']:.0f}-"
                f"{m['moe_load_max']:.0f} dropped {m['moe_dropped']:.0f}"
            )
        if self.skipped:
            s += " | SKIPPED"
        if self.val_loss is not None:
            s += f" | val {self.val_loss:.4f}"
        return s


class MetricsWriter:
    """Appends one JSON object per step to a file (rank 0 only)."""

    def __init__(self, path: str | None, keep_steps: int = 0) -> None:
        """``keep_steps`` > 0 (a resumed run): keep the file's rows of steps up to it and
        append after them (rows of later steps, from the interrupted run, are dropped)."""
        self._f: IO[str] | None = None
        if path:
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if keep_steps > 0 and p.is_file():
                for line in p.read_text("utf-8").splitlines():
                    try:
                        if int(json.loads(line)["step"]) <= keep_steps:
                            kept.append(line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue
            self._f = p.open("w", encoding="utf-8")
            self._f.writelines(kept)

    def write(self, m: StepMetrics | dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(asdict(m) if isinstance(m, StepMetrics) else m) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class Progress:
    """A live tqdm bar on a terminal, plain log lines otherwise, or nothing."""

    def __init__(self, total: int, mode: str, log_every: int, enabled: bool) -> None:
        self.enabled = enabled and mode != "none"
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self.log_every = log_every
        self.total = total
        self._bar: Any = None
        if self.enabled and mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def message(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def update(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            post = {"loss": f"{m.loss:.3f}", "tok/s": f"{m.tokens_per_s:,.0f}"}
            if m.val_loss is not None:
                post["val"] = f"{m.val_loss:.3f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
            if m.val_loss is not None:
                self._bar.write(m.line())
        elif m.step % self.log_every == 0 or m.step == self.total or m.val_loss is not None:
            print(m.line(), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
