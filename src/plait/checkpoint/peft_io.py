"""LoRA adapters in PEFT's format, and merged into their base weights.

A PEFT adapter folder holds ``adapter_config.json`` (``peft_type`` LORA, ``r``,
``lora_alpha``, ``lora_dropout``, ``target_modules``, ...) and
``adapter_model.safetensors``, whose keys are the ``transformers`` model's names under
PEFT's wrapper, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
(``(rank, in)``) and ``...lora_B.weight`` (``(out, rank)``). plait's one-device names of
the same tensors are ``layers.0.attention.wq.lora_A.weight`` (family ``plait``) or the
Hugging Face name itself (family ``hf-llama``); :func:`peft_key` and :func:`plait_key`
translate through :mod:`plait.checkpoint.hf`'s tables. No torch import of PEFT is needed:
``peft.PeftModel.from_pretrained`` reads what :func:`write_peft_adapter` writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint.format import CheckpointError
from plait.checkpoint.hf import hf_to_plait, plait_to_hf
from plait.checkpoint.read import CheckpointReader

ADAPTER_CONFIG = "adapter_config.json"
"""A PEFT adapter's configuration file."""

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A PEFT adapter's weights file."""

PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the ``transformers`` model's own names."""

_FACTORS = (".lora_A.weight", ".lora_B.weight")


def is_lora_name(name: str) -> bool:
    """Whether ``name`` is an adapter factor (``*.lora_A.weight`` / ``*.lora_B.weight``)."""
    return name.endswith(_FACTORS)


def _split(name: str) -> tuple[str, str]:
    """``"a.b.wq.lora_A.weight"`` -> (``"a.b.wq"``, ``".lora_A.weight"``)."""
    for f in _FACTORS:
        if name.endswith(f):
            return name[: -len(f)], f
    raise CheckpointError(f"{name!r} is not a LoRA factor (*.lora_A.weight or *.lora_B.weight)")


def peft_key(name: str, family: str = "plait") -> str:
    """PEFT's key of plait's adapter factor ``name``."""
    layer, factor = _split(name)
    hf = plait_to_hf(layer + ".weight", family)[: -len(".weight")]
    return f"{PEFT_PREFIX}{hf}{factor}"


def plait_key(key: str, family: str = "plait") -> str:
    """plait's one-device name of PEFT's adapter key ``key`` (inverse of :func:`peft_key`)."""
    if not key.startswith(PEFT_PREFIX):
        raise CheckpointError(f"PEFT adapter key {key!r} does not start with {PEFT_PREFIX!r}")
    layer, factor = _split(key[len(PEFT_PREFIX) :])
    ours = hf_to_plait(layer + ".weight", family)
    if ours is None:
        raise CheckpointError(f"PEFT adapter key {key!r} names no weight of the model")
    return ours[: -len(".weight")] + factor


def adapter_config(
    rank: int, alpha: float, dropout: float, modules: list[str], base: str | None
) -> dict[str, Any]:
    """``adapter_config.json`` of a plain LoRA adapter (no bias, no rsLoRA, no DoRA) on
    the ``modules`` (last name components, PEFT's ``target_modules``)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_peft_adapter(
    folder: str | Path,
    tensors: Mapping[str, torch.Tensor],
    alpha: float,
    dropout: float = 0.0,
    family: str = "plait",
    base: str | None = None,
) -> Path:
    """Write the adapter factors among ``tensors`` (one-device names -> full tensors) as
    a PEFT adapter folder; the rank is read from the factors. Returns the folder."""
    from safetensors.torch import save_file

    factors = {n: t for n, t in tensors.items() if is_lora_name(n)}
    if not factors:
        raise CheckpointError("the checkpoint holds no LoRA adapter (no *.lora_A.weight)")
    ranks = {int(t.shape[0]) for n, t in factors.items() if n.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise CheckpointError(f"the adapters have several ranks: {sorted(ranks)}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    keys = {peft_key(n, family): t.detach().cpu().contiguous() for n, t in factors.items()}
    save_file(keys, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    modules = [_split(k)[0].rpartition(".")[2] for k in keys]
    cfg = adapter_config(ranks.pop(), alpha, dropout, modules, base)
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def read_peft_config(folder: str | Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, checked to be a plain LoRA adapter."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    cfg: dict[str, Any] = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {cfg.get('peft_type')!r}, plait reads LORA")
    for flag in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise CheckpointError(f"{path}: {flag} is set, which plait's adapters do not do")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise CheckpointError(f"{path}: per-layer rank_pattern/alpha_pattern are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise CheckpointError(f"{path}: trained biases or modules_to_save are not supported")
    return cfg


def read_peft_adapter(
    folder: str | Path, rank: int, alpha: float, family: str = "plait"
) -> dict[str, torch.Tensor]:
    """The factors of the PEFT adapter in ``folder`` by plait's one-device names; its
    ``r`` and ``lora_alpha`` must equal ``rank`` and ``alpha``."""
    from safetensors.torch import load_file

    cfg = read_peft_config(folder)
    if int(cfg["r"]) != rank or float(cfg["lora_alpha"]) != float(alpha):
        raise CheckpointError(
            f"{folder}: the adapter has r={cfg['r']}, lora_alpha={cfg['lora_alpha']}, but "
            f"the run has lora.rank={rank}, lora.alpha={alpha}; set them to the adapter's"
        )
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {ADAPTER_WEIGHTS}")
    return {plait_key(k, family): t for k, t in load_file(str(path)).items()}


def merge_lora(tensors: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter merged (``W + scale · B A``, computed in
    float32 at least, cast back to W's dtype) and the factors dropped."""
    out = {n: t for n, t in tensors.items() if not is_lora_name(n)}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        layer = name[: -len(".lora_A.weight")]
        b = tensors[layer + ".lora_B.weight"]  # (out, rank)
        w = out[layer + ".weight"]  # (out, in)
        wide = torch.promote_types(w.dtype, torch.float32)
        delta = scale * (b.to(wide) @ a.to(wide))  # (out, in)
        out[layer + ".weight"] = (w.to(wide) + delta).to(w.dtype)
    return out


def lora_factors(layer: str) -> tuple[str, str]:
    """The names of ``layer``'s two factors (A, B)."""
    return f"{layer}.lora_A.weight", f"{layer}.lora_B.weight"


def lora_scale(meta: Mapping[str, Any]) -> float:
    """alpha / rank of the run a checkpoint's metadata records (its ``lora`` section)."""
    lora = meta.get("config", {}).get("lora", {})
    rank, alpha = lora.get("rank"), lora.get("alpha")
    if not rank or alpha is None:
        raise CheckpointError("the checkpoint holds LoRA factors but records no lora.rank/alpha")
    return float(alpha) / int(rank)


def read_tensor(reader: CheckpointReader, name: str) -> torch.Tensor:
    """The whole one-device tensor ``name`` of a checkpoint, in its stored dtype."""
    shape = list(reader.entry(name).shape)
    numel = int(torch.Size(shape).numel())
    return reader.read(name, "param", None, 0, numel).view(shape)


def export_peft(reader: CheckpointReader, out: str | Path) -> dict[str, Any]:
    """Write the LoRA adapter of checkpoint ``reader`` as a PEFT adapter folder ``out``
    (a new or empty folder; the base model stays where it came from). Returns a summary
    (step, tensors, rank, files)."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target} exists and is not an empty folder; choose a new -o")
    cfg = reader.meta.get("config", {})
    lora = cfg.get("lora", {})
    names = [n for n in reader.params if is_lora_name(n)]
    if not names:
        raise CheckpointError(f"checkpoint {reader.folder} holds no LoRA adapter")
    lora_scale(reader.meta)  # records its rank and alpha
    tensors = {n: read_tensor(reader, n) for n in names}
    family = cfg.get("model", {}).get("family", "plait")
    base = cfg.get("train", {}).get("init_from")
    write_peft_adapter(
        target, tensors, float(lora["alpha"]), float(lora.get("dropout", 0.0)), family, base
    )
    return {
        "step": reader.step,
        "tensors": len(tensors),
        "rank": int(lora["rank"]),
        "files": [ADAPTER_CONFIG, ADAPTER_WEIGHTS],
    }
