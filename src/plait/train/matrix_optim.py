"""The optimizer of ``train.optimizer = 'muon' | 'adafactor'`` (AdamW is
:func:`plait.train.start.make_optimizer`'s own) and the banner's line about it.

Muon's learning rate follows train.lr's schedule: each group carries ``lr_ratio`` (its
peak over train.lr's peak) and the trainer sets ``lr = scheduled lr · lr_ratio``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.config import Config
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.optimizers import Muon, split_params
from plait.optimizers.adafactor import ShardedAdafactor
from plait.parallel.adafactor import held_whole, is_block
from plait.parallel.tensor.layers import shard_info


def make_muon(model: nn.Module, cfg: Config, lr0: float) -> Muon:
    """Muon on ``model``'s hidden matrices, AdamW (train.lr, betas, decay on 2-D only) on
    the rest, starting at the schedule's first lr ``lr0``.
    Raises :class:`ConfigError` when the model has no hidden matrix."""
    t, o = cfg.train, cfg.optim
    split = split_params(model)
    if not split.muon:
        raise ConfigError(
            "train.optimizer = 'muon' on a model with no 2-D hidden weight matrix (Muon "
            "steps the attention/MLP matrices; embeddings, head, norms and biases are "
            "AdamW's); use train.optimizer = 'adamw'."
        )
    ratio = o.muon_lr / t.effective_lr()
    muon: dict[str, Any] = {"muon": True, "lr": lr0 * ratio, "lr_ratio": ratio}
    plain = [p for _, p in split.muon if id(p) not in split.in_out]
    stacked = [p for _, p in split.muon if id(p) in split.in_out]
    adam: dict[str, Any] = {"muon": False, "lr": lr0, "betas": (t.beta1, t.beta2)}
    decay = [p for _, p in split.adamw if p.dim() >= 2]
    no_decay = [p for _, p in split.adamw if p.dim() < 2]
    groups = [
        {**muon, "params": plain, "in_out": False},
        {**muon, "params": stacked, "in_out": True},
        {**adam, "params": decay, "weight_decay": t.weight_decay},
        {**adam, "params": no_decay, "weight_decay": 0.0},
    ]
    opt = Muon(
        [g for g in groups if g["params"]],
        lr=o.muon_lr,
        weight_decay=o.muon_weight_decay,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_coefficients=(o.muon_ns_a, o.muon_ns_b, o.muon_ns_c),
        eps=o.muon_eps,
        ns_steps=o.muon_ns_steps,
        adjust_lr_fn=o.muon_lr_adjust,
        ns_dtype=o.muon_ns_dtype,
        betas=(t.beta1, t.beta2),
    )
    mesh = getattr(model, "mesh", None)
    if isinstance(mesh, Mesh) and mesh.size("tp") > 1:  # matrices cut over tp
        opt.tp = (shard_info, mesh.axis("tp"))
    return opt


def make_adafactor(model: nn.Module, cfg: Config, lr0: float) -> torch.optim.Optimizer:
    """torch.optim.Adafactor on every trainable parameter at train.lr's schedule; under
    tensor or expert parallelism plait's
    :class:`~plait.optimizers.adafactor.ShardedAdafactor` over the blocks (row and column
    sums all-reduced over tp or ep). Under ZeRO either is
    rebuilt over the master shards (:class:`plait.parallel.zero.optim.ShardedMasters`)."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs: dict[str, Any] = {
        "lr": lr0,
        "beta2_decay": o.adafactor_beta2_decay,
        "d": o.adafactor_d,
        "weight_decay": o.adafactor_weight_decay,
    }
    mesh = getattr(model, "mesh", None)
    if isinstance(mesh, Mesh) and any(is_block(p) for p in params):
        return ShardedAdafactor(params, held_whole(params, mesh), **kwargs)
    return torch.optim.Adafactor(params, **kwargs)


def optimizer_note(model: nn.Module, cfg: Config) -> str:
    """The banner's line on the optimizer ('' for AdamW): for Muon, which parameters each
    rule steps (counted on this rank's pieces of ``model``)."""
    o = cfg.optim
    if cfg.train.optimizer == "muon":
        return (
            f"optimizer muon (lr {o.muon_lr:.2e}, momentum {o.muon_momentum}, "
            f"Newton-Schulz {o.muon_ns_steps} steps in {o.muon_ns_dtype}, lr adjust "
            f"{o.muon_lr_adjust}): {split_params(model).line()}"
        )
    if cfg.train.optimizer == "adafactor":
        return "optimizer adafactor on every parameter (torch.optim.Adafactor)"
    return ""
