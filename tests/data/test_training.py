"""Training on a prepared folder: dp2 equals one process (losses, rtol 1e-5: only the
summation order differs), the data order does not depend on dp (the global batches are
the same tokens), ZeRO-3 dp2 resumes bit-exactly from a mid-run checkpoint, a mixture
trains, and a model vocabulary smaller than the data's is refused before launch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import init_mesh
from plait.checkpoint import step_dirname
from plait.cli import main
from plait.config import Config, DataConfig, LogConfig, ModelConfig, ParallelConfig, TrainConfig
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer

M = "tests.data.test_training"
STEPS, SAVE_AT = 6, 3


def config(
    source: str,
    *,
    zero: int = 0,
    root: str | None = None,
    resume: str | None = None,
    prefetch: int = 2,
) -> Config:
    return Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
        parallel=ParallelConfig(zero=zero),
        train=TrainConfig(
            steps=STEPS,
            global_batch=8,
            seq_len=32,
            warmup_steps=2,
            eval_every=SAVE_AT,
            eval_batches=1,
            checkpoint_dir=root,
            checkpoint_every=SAVE_AT if root else 0,
            resume=resume,
        ),
        data=DataConfig(source=source, val_fraction=0.1, prefetch=prefetch),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )


def _run(ctx: WorkerContext | None, cfg: Config) -> dict[str, Any]:
    mesh = ctx.mesh(dp=ctx.world_size) if ctx is not None else init_mesh()
    tr = Trainer(cfg, mesh, show_progress=False)
    batches = [tr._read_batch(s)[0] for s in range(STEPS)]  # this rank's inputs per step
    start = tr.start_step
    s = tr.run()
    final = {}
    zero = tr.model.zero
    if zero is not None:
        with zero.gathered():
            final = {n: p.detach().clone() for n, p in tr.base.named_parameters()}
    return {
        "losses": s.losses,
        "vals": s.val_losses,
        "batches": batches,
        "start": start,
        "final": final,
    }


def _body(ctx: WorkerContext, cfg: Config) -> dict[str, Any]:
    return _run(ctx, cfg)


def test_dp2_equals_one_process_and_order_independent_of_dp(
    pools: Callable[[int], WorkerPool], byte_folder: Path
) -> None:
    cfg = config(str(byte_folder))
    ref = _run(None, config(str(byte_folder), prefetch=0))  # no loader thread: same data
    results = pools(2).run(f"{M}:_body", cfg)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert [v for _, v in r["vals"]] == pytest.approx([v for _, v in ref["vals"]], rel=1e-5)
    for step in range(STEPS):  # rank 0's half then rank 1's is the one-process batch
        joined = torch.cat([r["batches"][step] for r in results])
        assert torch.equal(joined, ref["batches"][step])


def test_zero3_dp2_resumes_bit_exactly(
    pools: Callable[[int], WorkerPool], byte_folder: Path, tmp_path: Path
) -> None:
    root = str(tmp_path / "ck")
    full = pools(2).run(f"{M}:_body", config(str(byte_folder), zero=3, root=root))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = pools(2).run(f"{M}:_body", config(str(byte_folder), zero=3, root=root, resume=ck))
    for f, r in zip(full, resumed, strict=True):
        assert r["start"] == SAVE_AT
        assert r["losses"] == f["losses"][SAVE_AT:]  # bit for bit
        assert f["final"].keys() == r["final"].keys() and f["final"]
        for k in f["final"]:
            assert torch.equal(f["final"][k], r["final"][k]), k


def test_mixture_trains_dp2_like_one_process(
    pools: Callable[[int], WorkerPool], byte_folder: Path, byte_folder_b: Path
) -> None:
    spec = f"{byte_folder}:0.6,{byte_folder_b}:0.4"
    ref = _run(None, config(spec))
    for r in pools(2).run(f"{M}:_body", config(spec)):
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def test_vocabulary_refused_before_launch(
    bpe: Path,
    jsonl_file: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from plait.data.prepare import prepare

    folder = tmp_path / "bpe_data"
    prepare(str(jsonl_file[0]), str(folder), f"hf:{bpe}")
    args = [
        "train",
        "--data",
        str(folder),
        "--model.vocab_size",
        "300",
        "--nproc",
        "2",
        "--log.dir",
        str(tmp_path / "run"),
        "--steps",
        "1",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "vocabulary of 400 tokens but model.vocab_size is 300" in err
    assert str(folder) in err and not (tmp_path / "run").exists()
