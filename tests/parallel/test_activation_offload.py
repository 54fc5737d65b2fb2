"""Activation offloading (``train.activation_offload``): the same run, the activations on
the host between forward and backward.

* Parity (2 gloo ranks, float64, 2 SGD steps): under dp2, ZeRO-3 dp2, tp2 + sequence
  parallelism, pp2, cp2 and dp2 with selective recomputation, the losses and every
  weight piece a rank holds are bit-identical (``torch.equal``) with and without
  offloading; the offload pool copied bytes on every layout.
* Storages (one process): after a forward, the device storages of the tensors the
  offloaded blocks saved are released except the one the head still uses (the last
  block's output, ``batch x seq x dim``), the copies are in the pool, and the pool is
  empty again once backward has freed the graph. A pack hook that hands back the
  original (or a view of it) keeps every original alive and fails this.
* Bytes: the saved bytes left on the device (counted by saved-tensor hooks outside the
  blocks) drop by one block's bytes per offloaded block, as the planner's device term
  ``(L - N) / L`` says, and the planner puts the rest on the host.
* Bad input exits 2 with the reason.
* On a GPU (the ``gpu`` mark: ``benchmarks/gpu_all.py``'s pytest_gpu row): bit-exact,
  the device peak lower by the pool's bytes, and the copies overlapping compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from plait import init_mesh
from plait.cli import main
from plait.config import ModelConfig
from plait.model import Transformer
from plait.optim import Optimizer
from plait.parallel.parallelize import parallelize
from plait.parallel.recompute import SavedActivations
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.memory import memory_per_rank
from plait.plan.modelspec import ModelSpec
from plait.testing import WorkerContext, WorkerPool
from tests.plan.queries import query
from tests.tiny import tiny_args

M = "tests.parallel.test_activation_offload"
CFG = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_dim=48
)
SEED, BATCH, SEQ = 5, 4, 16
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"mesh": {"dp": 2}},
    "zero3-dp2": {"mesh": {"dp": 2}, "zero": 3},
    "tp2-sp": {"mesh": {"tp": 2}, "sequence_parallel": True},
    "pp2": {"mesh": {"pp": 2}},
    "cp2": {"mesh": {"cp": 2}},
    "dp2-selective": {"mesh": {"dp": 2}, "recompute": "selective"},
}


def _run(mesh: Any, kw: dict[str, Any], offload: bool) -> tuple[list[float], dict[str, Any], int]:
    model = Transformer(CFG, seed=SEED).to(torch.float64)
    pm = parallelize(model, mesh, activation_offload=offload, **kw)
    opt = Optimizer(pm, torch.optim.SGD(pm.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    dp, r = mesh.size("dp"), mesh.index("dp")
    rows = BATCH // dp
    losses = []
    for _ in range(2):
        x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
        inputs, targets = x[r * rows : (r + 1) * rows, :-1], x[r * rows : (r + 1) * rows, 1:]
        losses.append(float(pm.step(inputs, targets)))
        opt.step()
        opt.zero_grad()
    pieces = {f"{p.name}@{p.start}": p.value.detach().clone() for p in opt.local_pieces()}
    copied = pm.offload_pool.copied_bytes if pm.offload_pool is not None else 0
    return losses, pieces, copied


def _body(ctx: WorkerContext, layout: str) -> dict[str, Any]:
    kw = dict(LAYOUTS[layout])
    mesh = ctx.mesh(**kw.pop("mesh"))
    base_losses, base_pieces, _ = _run(mesh, kw, offload=False)
    losses, pieces, copied = _run(mesh, kw, offload=True)
    same = base_pieces.keys() == pieces.keys() and all(
        torch.equal(v, pieces[k]) for k, v in base_pieces.items()
    )
    return {"losses": (base_losses, losses), "same": same, "copied": copied}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_is_bit_exact_under_every_layout(
    pools: Callable[[int], WorkerPool], layout: str
) -> None:
    for r in pools(2).run(f"{M}:_body", layout):
        base, offloaded = r["losses"]
        assert offloaded == base  # bit-identical losses
        assert r["same"]  # and every weight piece after two steps
        assert r["copied"] > 0  # the saved activations went through the pool


def _model(offload: bool, blocks: int = 0, layers: int = 2) -> Any:
    cfg = ModelConfig(**{**CFG.__dict__, "n_layers": layers})
    model = Transformer(cfg, seed=SEED).to(torch.float64)
    return parallelize(
        model, init_mesh(), activation_offload=offload, activation_offload_blocks=blocks
    )


def test_originals_released_and_copies_in_the_pool() -> None:
    pm = _model(True)
    pool = pm.offload_pool
    originals: list[tuple[StorageWeakRef, int]] = []
    pack = pool.pack

    def watched(t: torch.Tensor) -> Any:
        out = pack(t)
        if out is not t:  # offloaded: its storage must go once nothing else holds it
            originals.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out

    pool.pack = watched  # type: ignore[method-assign]
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    logits = pm(x)  # (batch, seq, vocab)
    alive = sum(n for ref, n in originals if not ref.expired())
    one = BATCH * SEQ * CFG.dim * 8  # the last block's output: the final norm saves it
    assert originals and sum(n for _, n in originals) > 4 * one
    assert alive <= one, (alive, one)
    assert pool.live_bytes == pool.copied_bytes > 0  # every copy held, by the graph
    logits.pow(2).mean().backward()
    del logits
    assert pool.live_bytes == 0  # freed with the graph


def _device_saved(blocks: int, offload: bool) -> int:
    pm = _model(offload, blocks, layers=3)
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    exclude = [*pm.parameters(), *pm.buffers()]
    with SavedActivations(exclude) as saved:  # the blocks' own hooks take their tensors
        pm(x).sum().backward()
    return saved.bytes


def test_device_bytes_drop_by_the_planners_share() -> None:
    none, all_, first = _device_saved(0, False), _device_saved(0, True), _device_saved(1, True)
    block = (none - all_) / 3
    assert block > 0 and first == none - block  # one of three blocks on the host
    spec = ModelSpec.from_config(ModelConfig(**{**CFG.__dict__, "n_layers": 3}))
    plans = {}
    for name, lay in {
        "none": Layout(),
        "first": Layout(activation_offload=True, activation_offload_blocks=1),
        "all": Layout(activation_offload=True),
    }.items():
        plans[name] = memory_per_rank(
            query(spec, lay, PRECISIONS["fp32"], RUNTIMES["plait"], SEQ), lay
        )
    per = plans["none"].layer_activation
    assert plans["first"].activations == pytest.approx(plans["none"].activations * 2 / 3)
    assert plans["first"].host_activations == pytest.approx(per)
    assert plans["all"].activations == 0 and plans["all"].host_activations == 3 * per
    assert plans["all"].buffers == pytest.approx(plans["none"].buffers + 2 * per)  # refetched


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--train.activation_offload_blocks", "1"], "needs train.activation_offload = true"),
        (
            ["--train.activation_offload", "true", "--train.activation_offload_blocks", "3"],
            "more blocks than a rank holds (model.n_layers = 2: at most 2)",
        ),
    ],
    ids=["blocks-without-offload", "more-blocks-than-held"],
)
def test_bad_offload_config_exits_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *tiny_args(), "--steps", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait: error: ") and needle in err and "Traceback" not in err


def test_search_offloads_a_layout_that_fits_only_so() -> None:
    """One device whose memory lies between a layout's need with and without offloading:
    the search returns it offloaded; without offloading in the space, nothing fits."""
    from dataclasses import replace

    from plait.plan import HARDWARE_PRESETS, MODEL_SPECS
    from plait.plan.search import search
    from plait.plan.space import Space

    spec, hw = MODEL_SPECS["llama3-8b"], HARDWARE_PRESETS["h100-80gb"]
    base = Layout(micro_batch=1, recompute="selective")
    need = {}
    for on in (False, True):
        lay = replace(base, activation_offload=on)
        q = query(spec, lay, PRECISIONS["bf16-mixed"], RUNTIMES["plait"], 32768, hw)
        need[on] = memory_per_rank(q, lay).total
    assert need[True] < need[False]
    small = replace(hw, memory_bytes=int((need[True] + need[False]) / 2))
    q = replace(q, hardware=small)
    space = Space(tp=(1,), pp=(1,), cp=(1,), zero=(0,), micro_batch=(1,), recompute=("selective",))
    found = search(q, space, top=1).ranked
    assert [e.layout.activation_offload for e in found] == [True]
    assert found[0].time.other > 0  # 32k tokens' copies exceed the stage's compute here
    assert search(q, replace(space, activation_offload=False), top=1).ranked == []


def test_offload_around_compiled_blocks() -> None:
    """Blocks compiled first (``aot_eager``: the compiled graph's saved tensors, without
    needing a C++ compiler), then offloaded: the graph's saved tensors go through the
    pool, and loss and gradients equal the compiled run without offloading, bit for bit."""
    from plait.parallel.activation_offload import OffloadPool, apply_activation_offload
    from plait.parallel.compile import apply_compile

    torch._dynamo.reset()
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    runs = []
    for offload in (False, True):
        model = Transformer(CFG, seed=SEED).to(torch.float64)
        apply_compile(model, backend="aot_eager")
        pool = OffloadPool(torch.device("cpu"))
        if offload:
            apply_activation_offload(model, pool)
        loss = model(x).pow(2).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((loss.detach(), grads, pool.copied_bytes))
    (base, base_grads, _), (loss, grads, copied) = runs
    assert copied > 0 and torch.equal(loss, base)
    assert grads.keys() == base_grads.keys()
    assert all(torch.equal(grads[k], g) for k, g in base_grads.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_frees_the_device_and_overlaps_its_copies() -> None:
    """On a GPU (fp32, 8 blocks, 4 x 1024 tokens): the loss and gradients equal the run
    without offloading (rtol 1e-4: CUDA's attention backward may sum in another order
    from run to run); once the forward's copies are done the device holds at least half
    of the pool's bytes less; and the copies overlap compute: with ``t0`` the step
    without offloading, ``t1`` with it and ``c`` the same bytes copied out and back
    alone (pinned), ``(t0 + c - t1) / min(t0, c)`` (0: serialised, 1: fully hidden) is
    above 0.3."""
    cfg = ModelConfig(vocab_size=1024, dim=1024, n_layers=8, n_heads=8, max_seq_len=1024)
    x = torch.randint(0, 1024, (4, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    mesh = init_mesh(device="cuda")
    runs = {}
    for offload in (False, True):
        pm = parallelize(Transformer(cfg, seed=0).cuda(), mesh, activation_offload=offload)
        for _ in range(3):  # two warm-ups (the pinned-memory cache), then the measured step
            pm.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            out = pm(x)  # (batch, seq, vocab)
            loss = out.pow(2).mean()
            loss.backward()
            torch.cuda.synchronize()
            step = time.perf_counter() - t
            out = pm(x)  # again, to read what the forward leaves on the device
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - base
            del out
        grads = [p.grad.clone() for p in pm.parameters()]
        held = pm.offload_pool.peak_bytes if pm.offload_pool is not None else 0
        runs[offload] = (loss.detach(), grads, kept, step, held)
    (loss0, grads0, kept0, t0, _), (loss1, grads1, kept1, t1, held) = runs[False], runs[True]
    torch.testing.assert_close(loss1, loss0, rtol=1e-4, atol=0.0)
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert held > 0 and kept1 < kept0 - held / 2, (kept0, kept1, held)
    block = torch.empty(held // 4, device="cuda")
    host = torch.empty(held // 4, pin_memory=True)
    torch.cuda.synchronize()
    c0 = time.perf_counter()
    host.copy_(block, non_blocking=True)
    block.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    c = time.perf_counter() - c0
    assert (t0 + c - t1) / min(t0, c) > 0.3, (t0, t1, c)
