"""Your own training loop over ``plait.parallelize``: data, checkpoints and resume.

Run it on one process, or on several under torchrun (``plait.init_mesh`` joins the
world torchrun set up; gloo on CPU, NCCL on CUDA)::

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --steps 20 --ckpt ckpt
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --steps 40 --ckpt ckpt --resume

The second command continues from ``ckpt``'s latest checkpoint (weights, AdamW state,
data position, RNG) with the same losses an uninterrupted 40-step run has. The
checkpoint is plait's (sharded, atomic, reshardable): ``--tp``/``--zero`` and the
process count may change between the two runs. Replace ``build_model`` by your own
model (``docs/models.md``); it must map token ids ``(batch, seq)`` to logits.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import plait
from plait.checkpoint import TrainState, find_checkpoint, restore_training_state, save_checkpoint
from plait.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from plait.data import BatchSampler, TokenDataset, load_tokens
from plait.model import Transformer


def build_model(cfg: ModelConfig) -> nn.Module:
    """The full one-device model, the same on every rank (one seed)."""
    return Transformer(cfg, seed=0)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Train; returns this run's losses (the global batch's mean, one per step)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="train up to this step")
    ap.add_argument("--ckpt", default="ckpt", help="checkpoint folder (shared by all ranks)")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt's latest")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=1)
    args = ap.parse_args(argv)

    mesh = plait.init_mesh(tp=args.tp)  # joins torchrun's world; dp = world / tp
    cfg = Config(  # what the checkpoint records about the run
        model=ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=64),
        parallel=ParallelConfig(tp=args.tp, zero=args.zero),
        train=TrainConfig(global_batch=8, seq_len=64, steps=args.steps, checkpoint_dir=args.ckpt),
        data=DataConfig(max_bytes=200_000),  # the built-in corpus, byte-level tokens
    )
    model = build_model(cfg.model).to(mesh.device)
    reader = find_checkpoint("latest", Path(args.ckpt), mesh.rank == 0) if args.resume else None

    pm = plait.parallelize(model, mesh, cfg)  # tp, then ZeRO over dp
    opt = plait.optim.Optimizer(pm, torch.optim.AdamW(pm.parameters(), lr=3e-3), max_norm=1.0)

    data = TokenDataset(load_tokens(cfg.data), cfg.train.seq_len)
    sampler = BatchSampler(len(data), cfg.train.global_batch, mesh.index("dp"), mesh.size("dp"), 0)
    state = TrainState(pm, opt, sampler, mesh, cfg)  # what a checkpoint holds
    # resume: each rank reads only its own pieces (weights, optimizer state), after sharding
    start = restore_training_state(state, reader) if reader is not None else 0

    losses: list[float] = []
    for step in range(start, args.steps):
        x, y = data.batch(sampler.rank_indices(step))  # this dp rank's (batch, seq) slice
        loss = pm.step(x.to(mesh.device), y.to(mesh.device))  # forward + backward
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if mesh.rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:  # collective: every rank
            save_checkpoint(state, args.ckpt, done, keep=2)
    return losses


if __name__ == "__main__":
    main()
