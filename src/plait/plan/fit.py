"""Will a training config fit? The check ``plait train`` runs before starting anything.

:func:`check_fits` maps a :class:`plait.config.Config` to the planner's model, layout,
precision and runtime, predicts the worst rank's memory and returns a
:class:`FitVerdict` whose :meth:`~FitVerdict.message` says, in one paragraph, what does
not fit and which single change would make it fit. :func:`refuse_unless_fits` is the
hook ``plait train`` calls after validating the config: it turns a "does not fit"
verdict into a :class:`~plait.errors.ConfigError` (exit code 2) unless
``launch.check_memory`` is false.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from plait.config import Config
from plait.errors import ConfigError
from plait.plan.estimate import Estimate
from plait.plan.evaluate import layout_estimate
from plait.plan.hardware import PRESETS, Curve, Hardware, Link
from plait.plan.layout import Layout, Precision, Runtime, precision_preset
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.query import Query
from plait.plan.text import gib

_DTYPE_PRECISION = {"fp32": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}


@dataclass(frozen=True)
class FitVerdict:
    """The answer of :func:`check_fits`."""

    fits: bool
    """Whether the worst rank is predicted to fit."""
    reasons: tuple[str, ...]
    """Why not (empty when it fits), then what would fit instead."""
    estimate: Estimate
    """The full prediction."""

    def message(self) -> str:
        """One paragraph for the user."""
        e = self.estimate
        if self.fits:
            return (
                f"predicted to fit: {gib(e.memory.total)} of {gib(e.usable_bytes)} usable per "
                f"rank on {e.hardware.name}."
            )
        return " ".join(self.reasons)


def precision_runtime(cfg: Config) -> tuple[Precision, Runtime]:
    """The planner's precision and runtime for a run of ``cfg``."""
    prec_cfg: Any = getattr(cfg, "precision", None)
    dtype = getattr(prec_cfg, "dtype", "fp32")
    precision = precision_preset(_DTYPE_PRECISION.get(dtype, "fp32"))
    return precision, Runtime(bucket_mb=cfg.parallel.bucket_mb)


def plan_inputs(cfg: Config, world_size: int) -> tuple[ModelSpec, Layout, Precision, Runtime]:
    """The planner's view of ``cfg`` on ``world_size`` ranks."""
    layout = Layout.from_config(cfg, world_size)
    precision, runtime = precision_runtime(cfg)
    return ModelSpec.from_config(cfg.model, "model"), layout, precision, runtime


def host_hardware(ranks_per_host: int) -> Hardware:
    """This host's CPU as a device: its RAM shared by the local ranks (rates unknown:
    only the memory verdict is meaningful)."""
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 8e9
    unit = Curve.constant(1e10)
    link = Link(1e-4, 1e9)
    return Hardware(
        "cpu-host",
        ram / max(1, ranks_per_host),
        1e10,
        unit,
        unit,
        unit,
        1e10,
        0.0,
        max(1, ranks_per_host),
        link,
        link,
        "host RAM from sysconf; rates placeholders",
    )


def cuda_hardware(name: str, total_memory: float) -> Hardware:
    """The preset matching a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), with the
    device's reported memory."""
    low = name.lower()
    for key in ("h200", "h100", "a100"):
        if key in low:
            candidates = [k for k in PRESETS if k.startswith(key)]
            best = min(candidates, key=lambda k: abs(PRESETS[k].memory_bytes - total_memory))
            return PRESETS[best].with_memory(total_memory)
    return PRESETS["a100-80gb"].with_memory(total_memory)


def device_hardware(
    device: str, ranks_per_host: int, cuda: tuple[str, float] | None = None
) -> Hardware:
    """The device a run on ``launch.device`` will use: the CUDA GPU ``cuda`` = (name,
    total memory in bytes, as the caller's ``torch.cuda`` reports it; None: no GPU) as
    its preset with that memory (``cuda``, or ``auto`` with a GPU), else this host's RAM
    shared by ``ranks_per_host`` ranks. The planner itself never imports torch."""
    if device in ("cuda", "auto") and cuda is not None:
        return cuda_hardware(cuda[0], cuda[1])
    return host_hardware(ranks_per_host)


def refuse_unless_fits(
    cfg: Config, world_size: int, ranks_per_host: int, cuda: tuple[str, float] | None = None
) -> FitVerdict:
    """What ``plait train`` runs before starting: raise :class:`ConfigError` (exit code
    2) with :meth:`FitVerdict.message` when the layout is predicted not to fit the
    device (``cuda``: see :func:`device_hardware`); ``launch.check_memory = false``
    skips the check."""
    hw = device_hardware(cfg.launch.device, ranks_per_host, cuda)
    verdict = check_fits(cfg, world_size, hw, ranks_per_host=ranks_per_host)
    if not verdict.fits:
        raise ConfigError(
            verdict.message() + " To start anyway (the prediction may be pessimistic, e.g. "
            "with unified or swap memory), set launch.check_memory = false "
            "(--launch.check_memory false)."
        )
    return verdict


def check_fits(
    cfg: Config,
    world_size: int,
    hardware: Hardware | None = None,
    headroom: float = 0.05,
    ranks_per_host: int | None = None,
) -> FitVerdict:
    """Predict whether ``cfg`` fits on ``hardware`` (default: this host's RAM shared by
    ``ranks_per_host`` ranks, all ``world_size`` by default).

    When it does not, the reasons name the worst rank's memory by component and list the
    single changes (ZeRO stage, recomputation, micro-batch) predicted to fit.
    """
    spec, layout, precision, runtime = plan_inputs(cfg, world_size)
    hw = hardware or host_hardware(ranks_per_host or world_size)
    moe = MoESpec.from_config(cfg.model)  # an MoE model: its experts' memory at its ep
    q = Query.of_layout(spec, layout, hw, precision, runtime, cfg.train.seq_len, headroom, moe)
    e = layout_estimate(q, layout)
    if e.fits:
        return FitVerdict(True, (), e)
    m = e.memory
    reasons = [
        f"the layout {layout.describe()} is predicted not to fit: the worst rank (pipeline "
        f"stage {m.stage}) needs {gib(m.total)} ({gib(m.state)} weights, gradients and "
        f"optimizer state, {gib(m.activations + m.embedding_head)} activations, "
        f"{gib(m.buffers)} buffers) but {hw.name} has {gib(e.usable_bytes)} usable per rank."
    ]
    options: list[tuple[str, Layout]] = []
    if layout.dp > 1:
        options += [
            (f"parallel.zero={z}", replace(layout, zero=z)) for z in (1, 2, 3) if z > layout.zero
        ]
    if layout.recompute != "full":
        options.append(("train.recompute=full", replace(layout, recompute="full")))
    if layout.offload == "none":  # ZeRO-Offload: masters and optimizer state on the host
        z = max(layout.zero, 1)
        label = "parallel.offload=optimizer" + ("" if layout.zero else " parallel.zero=1")
        options.append((label, replace(layout, zero=z, offload="optimizer")))
    if layout.micro_batch > 1:
        options.append(
            (
                "train.micro_batch=1",
                replace(layout, micro_batch=1, microbatches=layout.global_batch // layout.dp),
            )
        )
    fixes = []
    for label, alt in options:
        a = layout_estimate(q, alt)
        if a.fits:
            fixes.append(f"{label} ({gib(a.memory.total)})")
    if fixes:
        reasons.append("Predicted to fit with: " + "; ".join(fixes) + ".")
    else:
        reasons.append(
            "No single change of ZeRO stage, recomputation or micro-batch fits; use more "
            "ranks, tensor or pipeline parallelism (`plait plan --search` ranks them)."
        )
    return FitVerdict(False, tuple(reasons), e)
