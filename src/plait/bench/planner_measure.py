"""The rank side of ``benchmarks/planner_vs_measured.py``: one layout trained on a pool's
ranks with plait's Trainer, its steps timed on both clocks, then the bytes it holds counted
(state from the tensors, the activations of one micro-batch through saved-tensor hooks)."""

from __future__ import annotations

import time
from typing import Any


def _storage_bytes(tensors: list[Any], exclude: set[int]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_body(ctx: Any, cfg_kwargs: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """On every rank: train ``warmup + steps`` steps, time them, then count bytes."""
    import torch

    from plait import comm
    from plait.config import Config, DataConfig, LogConfig, ModelConfig, ParallelConfig, TrainConfig
    from plait.parallel.data_parallel import DataParallel
    from plait.train.trainer import Trainer

    cfg = Config(
        model=ModelConfig(**cfg_kwargs["model"]),
        parallel=ParallelConfig(**cfg_kwargs["parallel"]),
        train=TrainConfig(**cfg_kwargs["train"]),
        data=DataConfig(max_bytes=2_000_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )
    p = cfg.parallel
    mesh = ctx.mesh(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp)
    trainer = Trainer(cfg, mesh, show_progress=False)
    world = mesh.axis("pp", "dp", "cp", "tp")
    times, cpu_times = [], []
    for step in range(warmup + steps):
        comm.barrier(world)
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)

    # one more micro-step, with every saved tensor counted
    base = trainer.base
    fixed = {t.untyped_storage().data_ptr() for t in [*base.parameters(), *base.buffers()]}
    saved: list[Any] = []

    def pack(t: Any) -> Any:
        saved.append(t)
        return t

    idx = next(iter(trainer.sampler.micro_batches(warmup + steps, trainer.micro_batch)))
    x, y = trainer.train_set.batch(idx)
    if trainer.model.context is not None:  # cp: this rank's tokens, as ParallelModel.step feeds
        x, y = trainer.model.context.shard(x), trainer.model.context.shard(y)
    stages = trainer.model.stages
    loss_fn = trainer.model.loss_fn
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if stages is None:
            loss = loss_fn(trainer.model(x).float(), y)
        else:  # this rank's pipeline stage on one micro-batch, as the runtime runs it
            piece = stages.chunks[0]
            if piece.tok_embeddings is not None:
                inp = x
            else:  # the hidden states a previous stage would send: (micro, seq, dim)
                inp = torch.randn(x.shape[0], x.shape[1], cfg.model.dim, requires_grad=True)
            out = piece(inp)
            loss = loss_fn(out.float(), y) if piece.output is not None else out.sum()
    activations = _storage_bytes(saved, fixed)
    saved.clear()
    loss.backward()
    # exact bytes of the state this rank holds (after a backward: gradients exist)
    report = trainer.memory_report().bytes
    wrapper = trainer.model.module
    buckets = (
        sum(b for _, _, b in wrapper.bucket_summary())
        if isinstance(wrapper, DataParallel)
        else None
    )
    # plait's gradients are views into its buckets: memory_report files the buckets as
    # gradients, and so does the planner (state); only bucket bytes beyond the
    # gradients they hold (copies, padding) are "DP buckets", as the planner files them
    grad_views = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    extra = max(0, buckets - grad_views) if buckets is not None else None
    grads = report["grads"] - (extra or 0)
    trainer.optimizer.zero_grad(set_to_none=True)
    return {
        "wrapper": type(trainer.model.module).__name__,
        "rank": mesh.rank,
        "times": times[warmup:],
        "cpu_times": cpu_times[warmup:],
        "params": report["params"],
        "grads": grads,
        "master": report["master"],
        "optimizer": report["optimizer"] + report["optimizer_scalars"],
        "buckets": extra,
        "activations": activations,
    }
