"""How a run's model and optimizer start: the one way the trainer and ``plait eval`` build
the one-device model on the meta device, give it its starting weights, shard it with
``parallelize`` and wrap its optimizer (AdamW, or Muon/Adafactor: :mod:`plait.train.matrix_optim`).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.checkpoint import Checkpointing
from plait.config import Config
from plait.mesh import Mesh
from plait.model.factory import build_meta_model
from plait.model.init import has_meta
from plait.optim import Optimizer
from plait.parallel.compression import adam_in_front
from plait.parallel.model import ParallelModel
from plait.parallel.parallelize import parallelize
from plait.parallel.precision import DynamicLossScaler, optimizer_kernel
from plait.train.lr_schedule import lr_at
from plait.train.mask_documents import enable_document_mask
from plait.train.matrix_optim import make_adafactor, make_muon


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms, biases or 1-D parameters),
    fused (or foreach) kernels where the device has them (:func:`optimizer_kernel`);
    plain SGD with the same decay where top-k compression applies Adam on each rank
    before the exchange (``parallel.compression_adam``: SGD's coupled decay then equals
    AdamW's decoupled one). ``train.optimizer`` 'muon' / 'adafactor': see
    :mod:`plait.train.matrix_optim`."""
    if cfg.train.optimizer == "muon":
        return make_muon(model, cfg, lr_at(0, cfg))
    if cfg.train.optimizer == "adafactor":
        return make_adafactor(model, cfg, lr_at(0, cfg))
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    t = cfg.train
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if adam_in_front(model):
        return torch.optim.SGD(groups, lr=lr_at(0, cfg), momentum=0.0)
    kernel = optimizer_kernel(p for p in model.parameters() if p.requires_grad)
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(t.beta1, t.beta2), **kernel)


def one_device_model(cfg: Config, device: torch.device) -> nn.Module:
    """The run's one-device model (built-in, ``model.family`` or ``model.factory``) on
    the meta device, seeded by ``train.seed``: ``parallelize`` allocates and initialises
    only this rank's pieces. A factory model that cannot be initialised piece by piece
    is built in full, on ``device`` (see :func:`~plait.model.factory.build_meta_model`)."""
    torch.manual_seed(cfg.train.seed)
    base = build_meta_model(cfg.model, seed=cfg.train.seed)
    return base if has_meta(base) else base.to(device)


def start_parallel(
    base: nn.Module, cfg: Config, mesh: Mesh, checkpoints: Checkpointing
) -> tuple[ParallelModel, Optimizer]:
    """``base`` given its starting weights (``train.init_from``: a plait checkpoint or a
    Hugging Face folder), sharded by ``parallelize``, and its optimizer: the one way the
    trainer and ``plait eval`` start a model. ``checkpoints.restore`` then reads each
    rank's own pieces of a checkpoint to resume from."""
    checkpoints.load_weights(base)  # before sharding: every layout starts from them
    enable_document_mask(base, cfg)  # data.mask_documents: the tokenizer's EOS id
    model = parallelize(base, mesh, cfg)
    prec = cfg.precision
    scaler = (
        DynamicLossScaler(prec.loss_scale, prec.loss_scale_window) if prec.dtype == "fp16" else None
    )
    optimizer = Optimizer(
        model,
        make_optimizer(model, cfg),
        max_norm=0.0 if adam_in_front(model) else cfg.train.grad_clip,  # clipped per rank
        scaler=scaler,
        nonfinite=prec.nonfinite,
    )
    return model, optimizer
