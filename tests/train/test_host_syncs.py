"""The operations that would make a GPU wait for the host, counted in one training step.

On the CPU nothing syncs, but the same aten operations run: a ``TorchDispatchMode``
counts those that read a device value on the host (``_local_scalar_dense``: ``.item()``,
``float()``, ``int()``, ``bool()``; ``nonzero``; ``is_nonzero``) and ``Tensor.tolist``
(patched: it reads memory without dispatching) and
:meth:`plait.host_scalar.HostScalar.value` (a wait for one value, not for the queue,
but still a wait). Each case is one step of the tiny model in this process, on 1 rank,
after one unmeasured step (the first step builds state: optimizer moments, caches);
the allow-list per case is written below with the reason of each entry. On a GPU
(``gpu`` mark) the library step also runs under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait import init_mesh
from plait.config import Config, DataConfig, ModelConfig, TrainConfig
from plait.host_scalar import HostScalar
from plait.train.trainer import Trainer
from tests.tiny import tiny_config

_aten = torch.ops.aten
SYNC_OPS = {_aten._local_scalar_dense, _aten.nonzero, _aten.is_nonzero}


class SyncCounter(TorchDispatchMode):
    """Counts host reads of tensor values, keyed ``op @ file:function`` (the innermost
    plait frame that asked, so a failure names the code to fix)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def note(self, op: str) -> None:
        where = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/plait/" in frame.filename and "host_scalar" not in frame.filename:
                where = f"{Path(frame.filename).stem}:{frame.name}"
                break
        self.counts[f"{op} @ {where}"] += 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func.overloadpacket in SYNC_OPS:
            self.note(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    mode = SyncCounter()
    real_tolist, real_value = torch.Tensor.tolist, HostScalar.value

    def tolist(t: torch.Tensor) -> Any:
        mode.note("tolist")
        return real_tolist(t)

    def value(h: HostScalar) -> float:
        mode.note("HostScalar.value")
        return real_value(h)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", tolist)
        m.setattr(HostScalar, "value", value)
        with mode:
            yield mode.counts


def _corpus(folder: Path, document: int | None = None) -> str:
    """A small byte corpus (this file) as a .npy source, an end-of-document byte (0) every
    ``document`` tokens when given (several documents a window)."""
    text = np.frombuffer(Path(__file__).read_bytes(), dtype=np.uint8).astype(np.uint16)
    text = text.copy()
    if document:
        text[::document] = 0
    path = folder / f"corpus{document or ''}.npy"
    np.save(path, text)
    return str(path)


def _config(clip: float, source: str, **model: Any) -> Config:
    cfg = tiny_config(steps=2)
    cfg = replace(cfg, data=replace(cfg.data, source=source))
    return replace(
        cfg,
        model=replace(cfg.model, max_seq_len=16, **model),
        train=replace(cfg.train, grad_clip=clip, eval_every=0, global_batch=2, seq_len=16),
        data=replace(cfg.data, prefetch=0),
    )


def _trainer_step(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    tr = Trainer(cfg, init_mesh(), show_progress=False)
    tr.train_step(0)
    with counting(monkeypatch) as counts:
        tr.train_step(1)
    return counts


NORM = "_local_scalar_dense @ optim:_global_norm"
LOSS_ITEM = "_local_scalar_dense @ trainer:train_step"
LOSS_AFTER = "HostScalar.value @ trainer:train_step"
# a sync-free step checks the previous step's norm from its host copy: a wait for that
# value only (done long before on a GPU), which keeps the host at most a step ahead
PREV_NORM = "HostScalar.value @ optim:check_pending"
SYNC_FREE = {LOSS_AFTER: 1, PREV_NORM: 1}

CASES: dict[str, tuple[float, str, dict[str, int]]] = {
    # clipping needs the norm's value before the update: one read; the trainer reads the
    # loss before the step to decide on skipping
    "sdpa, clipped": (1.0, "sdpa", {NORM: 1, LOSS_ITEM: 1}),
    # no clipping: the optimizer reads nothing; the trainer reads the loss once, after
    # the optimizer's kernels are launched (to log it and stop on a non-finite loss)
    "sdpa, no clipping": (0.0, "sdpa", SYNC_FREE),
    "blockwise, no clipping": (0.0, "blockwise", SYNC_FREE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_step_syncs(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip, attention, allowed = CASES[case]
    cfg = _config(clip, _corpus(tmp_path), attention=attention)
    assert dict(_trainer_step(cfg, monkeypatch)) == allowed


def _documents(tmp_path: Path, attention: str) -> Config:
    cfg = _config(0.0, _corpus(tmp_path, document=10), attention=attention)
    return replace(cfg, data=replace(cfg.data, mask_documents=True))


def test_document_masking_sdpa_step_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Document masking with SDPA (a boolean mask from the document ids): no read beyond
    the logged loss and the previous step's norm."""
    assert dict(_trainer_step(_documents(tmp_path, "sdpa"), monkeypatch)) == SYNC_FREE


def test_document_masking_blockwise_step_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Document masking in the blockwise kernel: which key ranges each query block sees
    is decided once per batch from the document ids, before the kernels: no read beyond
    the logged loss and the previous step's norm."""
    counts = _trainer_step(_documents(tmp_path, "blockwise"), monkeypatch)
    assert dict(counts) == SYNC_FREE


def test_ring_attention_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring attention on a cp axis of one rank (its own block), with and without
    document ids, forward and backward: no host read at all."""
    from plait.model.document_mask import document_ids
    from plait.parallel.context.ring_attention import RingAttention

    ring = RingAttention(init_mesh().axis("cp"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 32, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    tokens = torch.ones(1, 32, dtype=torch.long)
    tokens[:, 9::10] = 0
    docs = document_ids(tokens, 0)  # (1, 32)
    with counting(monkeypatch) as counts:
        ring(q, k, v).sum().backward()
        ring(q, k, v, docs).sum().backward()
    assert dict(counts) == {}


def _library_step(clip: float, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """``pm.step`` + ``Optimizer.step`` (what ``benchmarks/gpu_step.py`` and a user's own
    loop run), the loss kept as a tensor."""
    from plait import parallelize
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.train.start import make_optimizer

    cfg = Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
        train=TrainConfig(global_batch=2, seq_len=16, grad_clip=clip),
        data=DataConfig(max_bytes=10_000),
    )
    pm = parallelize(Transformer(cfg.model, seed=0), init_mesh(), cfg)
    opt = Optimizer(pm, make_optimizer(pm, cfg), max_norm=clip)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for i in range(2):
        with counting(monkeypatch) if i else _nothing() as counts:
            pm.step(x[:, :-1], x[:, 1:])
            opt.step()
            opt.zero_grad()
    return counts


@contextmanager
def _nothing() -> Iterator[collections.Counter[str]]:
    yield collections.Counter()


def test_optimizer_step_without_clipping_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clipping reads the norm once; without it the step reads nothing of its own (its
    norm is checked from its host copy when the report is read or at the next step: here
    the previous step's, at this step's start)."""
    assert dict(_library_step(1.0, monkeypatch)) == {NORM: 1}
    assert dict(_library_step(0.0, monkeypatch)) == {PREV_NORM: 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_optimizer_step_without_clipping_does_not_sync_on_a_gpu() -> None:
    """The same on a GPU under CUDA's own sync detector (errors on a synchronising call)."""
    from plait import parallelize
    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.train.start import make_optimizer

    cfg = Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
        train=TrainConfig(global_batch=2, seq_len=16, grad_clip=0.0),
        data=DataConfig(max_bytes=10_000),
    )
    with torch.device("meta"):
        model = Transformer(cfg.model, seed=0)
    pm = parallelize(model, init_mesh(device="cuda"), cfg)
    opt = Optimizer(pm, make_optimizer(pm, cfg), max_norm=0.0)
    x = torch.randint(0, 256, (2, 17), device="cuda")
    for i in range(3):
        if i == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = pm.step(x[:, :-1], x[:, 1:])
            report = opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert report.grad_norm > 0 and float(loss) > 0
