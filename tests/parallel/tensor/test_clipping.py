"""Gradient clipping of a tensor-parallel model: the global norm spans dp shards and tp.

:class:`plait.optim.Optimizer` sums the squared gradient norm over the tp axis, counting
a tensor held identically by k tp ranks 1/k on each rank, whether it wraps the
``ParallelModel`` that ``parallelize`` returns (norm groups from the mesh: what the
trainer and a user's loop use) or a bare ``DataParallel`` / ZeRO wrapper (each
answering from its own mesh: the ``OptimizerTarget`` protocol).

Protocol: the model of ``test_tensor_model`` (vocab 37 padded, 4 heads, 2 KV heads: at
tp 4 each KV head is replicated on two ranks; tied embeddings at tp 4) in float64. The
reference is one process with ``torch.nn.utils.clip_grad_norm_`` at a max norm small
enough that every step clips. Each layout reports the pre-clipping norm of every step
(compared at rtol 1e-10) and the gathered weights after STEPS steps (rtol 1e-9 /
atol 1e-12, or the fp32-rotary tolerance of ``test_tensor_model`` with replicated KV
heads). Counting a replicated tensor once per tp rank, or leaving out the tp sum,
changes the norm by far more than that.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.data_parallel import DataParallel
from plait.parallel.parallelize import parallelize
from plait.parallel.tensor.loss import vocab_parallel_loss
from plait.parallel.tensor.sharding_plan import (
    apply_tensor_parallel,
    gather_full_state,
)
from plait.parallel.zero import ZeroDataParallel
from plait.testing import WorkerContext, WorkerPool
from tests.parallel.tensor.test_model import FP32_ROPE, GLOBAL_BATCH, IGN, V, _batches, _cfg

M = "tests.parallel.tensor.test_clipping"
Pools = Callable[[int], WorkerPool]
MAX_NORM = 0.05


def _adamw(params: object) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # type: ignore[arg-type]


def _reference(tie: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = Transformer(_cfg(tie), seed=7).double()
    opt = _adamw(model.parameters())
    norms = []
    for x, y in _batches():
        F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=IGN).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, model.state_dict()


def _body(ctx: WorkerContext, dp: int, tp: int, tie: bool, kind: str) -> dict[str, object]:
    mesh = ctx.mesh(dp=dp, tp=tp)
    model = Transformer(_cfg(tie), seed=7).double()
    r, per = mesh.index("dp"), GLOBAL_BATCH // dp
    norms = []
    if kind == "parallelize":
        pm = parallelize(model, mesh, ignore_index=IGN)
        opt = Optimizer(pm, _adamw(model.parameters()), max_norm=MAX_NORM)
        for x, y in _batches():
            pm.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
            norms.append(opt.step().grad_norm)
            opt.zero_grad(set_to_none=True)
        return {"norms": norms, "weights": gather_full_state(model, mesh)}
    apply_tensor_parallel(model, mesh)
    wrapped: DataParallel | ZeroDataParallel
    if kind == "zero":
        wrapped = ZeroDataParallel(model, mesh, stage=2)
    else:
        wrapped = DataParallel(model, mesh)
    opt = Optimizer(wrapped, _adamw(model.parameters()), max_norm=MAX_NORM)
    loss_fn = vocab_parallel_loss(mesh, V, IGN)
    for x, y in _batches():
        loss_fn(wrapped(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per]).backward()
        norms.append(opt.step().grad_norm)
        opt.zero_grad(set_to_none=True)
    if isinstance(wrapped, ZeroDataParallel):
        wrapped.wait_params()  # the updated shards' all-gathers, launched by the step
    return {"norms": norms, "weights": gather_full_state(model, mesh)}


@pytest.mark.parametrize(
    ("dp", "tp", "tie", "kind"),
    [
        pytest.param(1, 4, True, "parallelize", id="tp4-kv-replicated-tied-parallelize"),
        pytest.param(1, 4, True, "wrapper", id="tp4-kv-replicated-tied-wrapper"),
        pytest.param(2, 2, False, "parallelize", id="dp2xtp2-parallelize"),
        pytest.param(2, 2, False, "wrapper", id="dp2xtp2-wrapper"),
        pytest.param(2, 2, False, "zero", id="dp2xtp2-zero2-wrapper"),
    ],
)
def test_clipping_norm_matches_one_process(
    pools: Pools, dp: int, tp: int, tie: bool, kind: str
) -> None:
    """ "parallelize": Optimizer on the ParallelModel; "wrapper": on a DataParallel
    wrapper around the TP model; "zero": on a bare ZeRO-2 wrapper around it (its shard
    group and tp are both summed). Every path reads the same OptimizerTarget protocol
    (one process, every path at once: tests/test_optim.py)."""
    want_norms, want_weights = _reference(tie)
    assert min(want_norms) > MAX_NORM  # every step clips
    replicated_kv = _cfg(tie).kv_heads < tp
    rtol, atol = FP32_ROPE["weights"] if replicated_kv else (1e-9, 1e-12)
    for res in pools(dp * tp).run(f"{M}:_body", dp, tp, tie, kind):
        norm_rtol = 1e-10 if not replicated_kv else 1e-6
        assert res["norms"] == pytest.approx(want_norms, rel=norm_rtol)
        for k, w in want_weights.items():
            torch.testing.assert_close(res["weights"][k], w, rtol=rtol, atol=atol, msg=k)
