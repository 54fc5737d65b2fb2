"""float8 training of the linear layers through torchao (``precision.float8 = true``).

The blocks' linear layers compute their matmuls in float8 (e4m3 forward, e5m2 gradients,
dynamic per-tensor scaling: torchao's ``Float8LinearConfig`` defaults), the weights and
the optimizer staying in the run's dtype (bf16 with fp32 masters). As torchtitan does,
the output head stays in high precision (its logits feed the loss) and so does any layer
whose sizes are not multiples of 16 (float8 tensor cores need them).

* Plain ``nn.Linear`` layers (tp = 1) become torchao's ``Float8Linear``
  (``torchao.float8.convert_to_float8_training``).
* plait's tensor-parallel layers (tp > 1) keep their regions and shards; their local
  product becomes a float8 one (:func:`float8_matmul`, torchao's ``Float8Linear``
  applied to the local shard through ``torch.func.functional_call``). The scales are
  per shard (each rank's amax), not over the whole matrix.
* ZeRO-3 composes as is: its flat units gather the weights in the run's dtype and the
  float8 cast happens after the gather, inside the layer. torchao's float8 all-gather
  (``enable_fsdp_float8_all_gather``) is an extension of FSDP2's per-parameter
  ``fsdp_pre_all_gather`` hook, which plait's flat units do not call, so it is not used
  (the gather moves 2 bytes per parameter, not 1).

Applied by ``parallelize`` after tensor and context parallelism, before the pipeline
split, recomputation and ZeRO/DP. Refused before any rank starts
(:func:`check_float8`, one line, exit 2) on the CPU, on a GPU below compute capability
8.9 (Ada, Hopper and later have float8 tensor cores) and without torchao. See
docs/gpu.md.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError
from plait.parallel.tensor.layers import ColumnParallelLinear, LocalMatmul, RowParallelLinear

MIN_CAPABILITY = (8, 9)
"""The first CUDA compute capability with float8 tensor cores (Ada; Hopper is 9.0)."""

SKIP_NAMES = ("output", "lm_head")
"""Modules (last name component) kept in high precision: the output head (plait's
``output``, Hugging Face's ``lm_head``); see :func:`high_precision_names`."""


def float8_problem(
    device: str, capability: tuple[int, int] | None, has_torchao: bool
) -> str | None:
    """Why float8 training cannot run (None: it can). ``device`` is "cpu" or "cuda";
    ``capability`` the GPU's compute capability (None on the CPU)."""
    if device != "cuda" or capability is None:
        return (
            "precision.float8 needs a CUDA GPU with float8 tensor cores (compute capability "
            "8.9+: Ada, Hopper, Blackwell); this run is on the CPU. Leave precision.float8 "
            "false here."
        )
    if tuple(capability) < MIN_CAPABILITY:
        cc = ".".join(map(str, capability))
        return (
            f"precision.float8 needs float8 tensor cores (compute capability 8.9+); this GPU "
            f"has {cc}. Leave precision.float8 false (bf16 is the fastest dtype here)."
        )
    if not has_torchao:
        return (
            "precision.float8 needs torchao, which is not installed: pip install "
            "'plait[float8]' (a torchao release built for this torch; see docs/gpu.md)."
        )
    return None


def check_float8(enabled: bool, device: str) -> None:
    """Raise :class:`ConfigError` (one line) when ``precision.float8`` is on and cannot
    run on ``device`` ("auto", "cpu", "cuda")."""
    if not enabled:
        return
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cap = (
        torch.cuda.get_device_capability()
        if device == "cuda" and torch.cuda.is_available()
        else None
    )
    problem = float8_problem(device, cap, importlib.util.find_spec("torchao") is not None)
    if problem is not None:
        raise ConfigError(problem)


def _fits(in_features: int, out_features: int) -> bool:
    return in_features % 16 == 0 and out_features % 16 == 0


def float8_matmul(in_features: int, out_features: int, config: Any = None) -> LocalMatmul:
    """A :data:`~plait.parallel.tensor.layers.LocalMatmul` computing ``x Wᵀ (+ b)`` with
    torchao's float8 linear for a local weight of ``(out_features, in_features)``."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        template = nn.Linear(in_features, out_features, bias=False)
    f8 = Float8Linear.from_float(template, config=config or Float8LinearConfig())

    def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = torch.func.functional_call(f8, {"weight": w}, (x,))  # (..., out_features)
        return y if b is None else y + b.to(y.dtype)

    return matmul


def high_precision_names(model: nn.Module) -> set[str]:
    """Names of ``model``'s modules that stay in high precision: the output head, found
    by name (:data:`SKIP_NAMES`) or as the module ``model.get_output_embeddings()``
    returns (Hugging Face models name their head as they like)."""
    names = {n for n, _ in model.named_modules() if n and n.rsplit(".", 1)[-1] in SKIP_NAMES}
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        names |= {n for n, m in model.named_modules() if m is head}
    return names


def apply_float8(model: nn.Module) -> int:
    """Convert ``model``'s linear layers to float8 in place (see the module docstring);
    returns how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig()  # dynamic tensorwise scaling; no FSDP2 float8 gather
    count = 0
    skip = high_precision_names(model)
    for name, mod in model.named_modules():
        if name in skip:
            continue
        if isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            rows, cols = mod.weight.shape  # (local out, local in)
            if _fits(cols, rows):
                mod.local_matmul = float8_matmul(cols, rows, config)
                count += 1

    def keep(mod: nn.Module, fqn: str) -> bool:
        nonlocal count
        ok = (
            isinstance(mod, nn.Linear)
            and fqn not in skip
            and _fits(mod.in_features, mod.out_features)
        )
        count += int(ok)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return count
