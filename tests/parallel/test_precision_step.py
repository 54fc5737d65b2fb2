"""The mixed-precision step's kernels: one fused AdamW step, one fused copy back.

* :func:`optimizer_kernel` picks ``fused`` for floating-point parameters on the CPU or
  CUDA, ``foreach`` elsewhere, nothing on the meta device; the trainer's
  ``make_optimizer`` uses it, and under ZeRO the masters' optimizer inherits it.
* bf16 parameters with fp32 masters (ZeRO stage 0, one rank): after each step every
  bf16 parameter equals its fp32 master rounded to bf16 (exactly: the copy back is a
  cast), and the masters follow a plain fp32 AdamW on the same gradients — the fused
  kernel against torch's single-tensor loop, rtol 1e-6 (one float32 rounding order).
"""

from __future__ import annotations

import torch
from torch import nn

from plait import init_mesh
from plait.config import Config, ModelConfig, TrainConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.parallel.precision import optimizer_kernel
from plait.train.start import make_optimizer

CFG = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32, max_seq_len=8)


def test_optimizer_kernel_choice() -> None:
    assert optimizer_kernel([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)]) == {
        "fused": True
    }
    assert optimizer_kernel([torch.zeros(2, device="meta")]) == {}
    assert optimizer_kernel([]) == {}
    assert optimizer_kernel([torch.zeros(2, dtype=torch.complex64)]) == {"foreach": True}
    cfg = Config(model=CFG)
    opt = make_optimizer(Transformer(CFG, seed=0), cfg)
    assert opt.defaults["fused"] is True


def test_bf16_masters_step_fused_and_copy_back_exactly() -> None:
    """The fused master step equals a plain fp32 AdamW stepped on the same fp32
    gradients; each bf16 parameter is its master cast to bf16 after every step."""
    mesh = init_mesh()
    cfg = Config(model=CFG, train=TrainConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0))
    pm = parallelize(Transformer(CFG, seed=0), mesh, precision="bf16")
    opt = Optimizer(pm, make_optimizer(pm, cfg))
    assert opt.inner.defaults["fused"] is True  # the masters' optimizer kept the kernel
    masters = opt.master_tensors()
    ref = [nn.Parameter(m.detach().clone()) for m in masters]  # fp32, flat per unit
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 32, (2, 8), generator=g)  # (batch, seq)
        pm.step(x, x)
        grads = [gr.clone() for gr in opt.sharded.grads()]  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        for p, gr in zip(ref, grads, strict=True):
            p.grad = gr
        ref_opt.step()
        for m, r in zip(masters, ref, strict=True):
            torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
        for slot in opt.sharded.slots:  # type: ignore[union-attr]
            shard = opt.sharded.zero.param_shard(slot.unit)  # type: ignore[union-attr]
            assert shard.dtype == torch.bfloat16
            assert torch.equal(shard, slot.master.to(torch.bfloat16))
