"""The optimizer's one protocol: every model it accepts describes its layout the same way.

:class:`plait.optim.Optimizer` reads a model only through
:class:`plait.optim.OptimizerTarget` (parameters, norm groups, norm weights, local
pieces, the ZeRO wrapper whose shards it steps). Checked here on one process: a bare
:class:`DataParallel`, a bare :class:`ZeroDataParallel` (stages 0 and 3) and the
:class:`ParallelModel` that ``parallelize`` returns (plain and ZeRO) all satisfy it, a
plain module does not and is adapted by :class:`PlainModule`, and the gradient norm the
optimizer measures (and clips by) is the same float64 value through every path, equal
to ``torch.nn.utils.clip_grad_norm_``'s on the same model and batch (rtol 1e-12). The
same check across ranks (dp x tp, with a bare ZeRO wrapper beside the others):
tests/parallel/tensor/test_clipping.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait import init_mesh
from plait.config import ModelConfig
from plait.mesh import Mesh
from plait.model import Transformer
from plait.optim import Optimizer, OptimizerTarget, PlainModule
from plait.parallel.data_parallel import DataParallel
from plait.parallel.model import ParallelModel
from plait.parallel.parallelize import parallelize
from plait.parallel.zero import ZeroDataParallel

VOCAB, SEQ, BATCH = 32, 8, 4
MAX_NORM = 1e-3  # small enough that the step clips


def _model() -> nn.Module:
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ
    )
    return Transformer(cfg, seed=0).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (3 * x + 1) % VOCAB


def _targets(mesh: Mesh) -> dict[str, tuple[nn.Module | OptimizerTarget, nn.Module]]:
    """name -> (what the optimizer wraps, the module to call forward on)."""
    dp = DataParallel(_model(), mesh)
    z0 = ZeroDataParallel(_model(), mesh, stage=0)
    z3 = ZeroDataParallel(_model(), mesh, stage=3)
    pm = parallelize(_model(), mesh)
    pz = parallelize(_model(), mesh, zero=3)
    plain, adapted = _model(), _model()
    return {
        "DataParallel": (dp, dp),
        "ZeroDataParallel-0": (z0, z0),
        "ZeroDataParallel-3": (z3, z3),
        "ParallelModel": (pm, pm),
        "ParallelModel-zero3": (pz, pz),
        "plain": (plain, plain),
        "PlainModule": (PlainModule(adapted), adapted),
    }


def test_wrappers_and_parallel_model_are_optimizer_targets() -> None:
    mesh = init_mesh()
    targets = _targets(mesh)
    for name in ("DataParallel", "ZeroDataParallel-3", "ParallelModel", "PlainModule"):
        assert isinstance(targets[name][0], OptimizerTarget), name
    assert not isinstance(targets["plain"][0], OptimizerTarget)
    # statically too (mypy): each is assignable to the protocol
    dp: OptimizerTarget = DataParallel(_model(), mesh)
    zero: OptimizerTarget = ZeroDataParallel(_model(), mesh, stage=1)
    pm: OptimizerTarget = parallelize(_model(), mesh)
    assert dp.zero_wrapper() is None and zero.zero_wrapper() is zero
    assert pm.zero_wrapper() is None
    pz = parallelize(_model(), mesh, zero=3)
    assert isinstance(pz, ParallelModel) and pz.zero_wrapper() is pz.module
    for t in (dp, zero, pm, pz):  # one rank: nothing to sum over, every tensor counts once
        assert t.norm_groups() == []
        assert {t.norm_weight(p) for p in t.parameters()} == {1.0}
    with pytest.raises(TypeError, match="does not describe its pieces"):
        Optimizer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1)).local_pieces()


def test_clipping_norm_is_the_same_through_every_path() -> None:
    ref = _model()
    x, y = _batch()
    nn.functional.cross_entropy(ref(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    assert want > MAX_NORM
    for name, (target, forward) in _targets(init_mesh()).items():
        opt = Optimizer(target, torch.optim.SGD(forward.parameters(), lr=0.1), max_norm=MAX_NORM)
        if isinstance(forward, ParallelModel):
            forward.step(x, y)
        else:
            nn.functional.cross_entropy(forward(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        report = opt.step()
        assert not report.skipped
        assert report.grad_norm == pytest.approx(want, rel=1e-12), name
