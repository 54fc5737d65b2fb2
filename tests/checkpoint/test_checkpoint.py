"""Checkpoints: bit-exact resume, resharding across layouts, atomicity, corruption.

Protocol. A tiny transformer trains 6 steps in float32 under a layout, saving at step
3; a second run resumes from that checkpoint and trains steps 4-6.

* Resume under the same layout: the losses of steps 4-6 equal the uninterrupted run's
  bit for bit (``==`` on floats) and so do the final weights.
* Resume under another layout (reshard): the weights right after loading equal the
  source's full weights at step 3 exactly (gathered independently of the checkpoint
  code), and the losses of steps 4-6 match the source run's to rtol 1e-5 (the layouts
  only sum in a different order).
* A save killed (SIGKILL, from a test-only hook, no sleeps) after any of its stages
  leaves the previous checkpoint loadable and ``latest`` naming it.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait import init_mesh
from plait.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointSaveError,
    CorruptCheckpointError,
    TrainState,
    consolidate,
    find_checkpoint,
    read_latest,
    step_dirname,
)
from plait.config import (
    Config,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from plait.parallel.tensor.sharding_plan import gather_full_state
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer

M = "tests.checkpoint.test_checkpoint"
STEPS, SAVE_AT = 6, 3


def config(
    root: str | None = None,
    *,
    steps: int = STEPS,
    every: int = SAVE_AT,
    zero: int = 0,
    tp: int = 1,
    pp: int = 1,
    shard: int | None = None,
    dtype: str = "fp32",
    resume: str | None = None,
    init_from: str | None = None,
    n_layers: int = 2,
) -> Config:
    return Config(
        model=ModelConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=32),
        parallel=ParallelConfig(zero=zero, tp=tp, pp=pp, zero_shard_size=shard),
        precision=PrecisionConfig(dtype=dtype, loss_scale_window=2),  # type: ignore[arg-type]
        train=TrainConfig(
            steps=steps,
            global_batch=8,
            seq_len=32,
            warmup_steps=2,
            eval_every=SAVE_AT,
            eval_batches=1,
            checkpoint_dir=root,
            checkpoint_every=every if root else 0,
            keep_checkpoints=3,
            resume=resume,
            init_from=init_from,
        ),
        data=DataConfig(max_bytes=100_000),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )


def full_weights(tr: Trainer) -> dict[str, torch.Tensor]:
    """The one-device weights of a trainer's model, gathered over ZeRO and tp."""
    zero = tr.model.zero
    held = zero.gathered() if zero is not None else contextlib.nullcontext()
    with held:
        if tr.mesh.size("tp") > 1:
            return gather_full_state(tr.base, tr.mesh)
        return {n: p.detach().clone() for n, p in tr.base.named_parameters()}


def _mesh(ctx: WorkerContext | None, cfg: Config) -> Any:
    if ctx is None:
        return init_mesh()
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    return ctx.mesh(dp=ctx.world_size // (tp * pp), tp=tp, pp=pp)


def _train(
    ctx: WorkerContext | None,
    cfg: Config,
    *,
    weights_at: int | None = None,
    weights: Callable[[Trainer], dict[str, torch.Tensor]] | None = None,
) -> Any:
    """Run ``cfg``; returns losses, val losses, final full weights (and, with
    ``weights_at``, the full weights after that many steps); ``weights`` reads the
    one-device weights (default :func:`full_weights`)."""
    read = weights or full_weights
    tr = Trainer(cfg, _mesh(ctx, cfg), show_progress=False)
    start = tr.start_step
    loaded = read(tr)
    snap: dict[str, torch.Tensor] = {}
    if weights_at is not None:  # snapshot the full weights when step weights_at is done
        after = tr.checkpoints.after_step

        def after_step(state: TrainState, done: int, last: int, stop: bool) -> Any:
            if done == weights_at:
                snap.update(read(tr))
            return after(state, done, last, stop)

        tr.checkpoints.after_step = after_step  # type: ignore[method-assign]
    losses = tr.run().losses
    return {
        "start": start,
        "losses": losses,
        "loaded": loaded,
        "snap": snap,
        "final": read(tr),
    }


def _body(ctx: WorkerContext, cfg: Config, weights_at: int | None = None) -> Any:
    return _train(ctx, cfg, weights_at=weights_at)


def _merged(results: list[Any]) -> Any:
    """One result from every rank's: rank 0's losses; the union of the ranks' weights
    (pipeline stages hold different tensors; replicas must agree exactly)."""
    out = dict(results[0])
    for key in ("loaded", "snap", "final"):
        union: dict[str, torch.Tensor] = {}
        for r in results:
            for name, t in r[key].items():
                assert name not in union or torch.equal(union[name], t), name
                union[name] = t
        out[key] = union
    assert all(r["losses"] == out["losses"] for r in results)
    return out


def _pool_run(pools: Callable[[int], WorkerPool], world: int, cfg: Config, **kw: Any) -> Any:
    return _merged(pools(world).run(f"{M}:_body", cfg, **kw))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------- one process


def test_resume_is_bit_exact_one_process(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    full = _train(None, config(root))
    resumed = _train(None, config(root, resume=str(Path(root) / step_dirname(SAVE_AT))))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]  # bit for bit
    _assert_same_weights(resumed["final"], full["final"])
    # the layout on disk: two checkpoints, `latest` names the last, checksums recorded
    assert read_latest(Path(root)) == Path(root) / step_dirname(STEPS)
    meta = CheckpointReader(Path(root) / step_dirname(STEPS)).meta
    assert set(meta["files"]) == {"rank00000.safetensors"}
    assert meta["step"] == STEPS and meta["sampler"]["step"] == STEPS
    assert {"exp_avg", "exp_avg_sq"} <= set(meta["params"]["output.weight"]["pieces"][0]["keys"])


def test_resume_fp16_is_bit_exact_with_masters_and_loss_scale(tmp_path: Path) -> None:
    """fp16 parameters: fp32 masters are what is stored; the loss scaler (grows after 2
    clean steps, halves and skips on overflow) resumes where it was."""
    root = str(tmp_path / "ck")
    full = _train(None, config(root, dtype="fp16"))
    meta = CheckpointReader(Path(root) / step_dirname(SAVE_AT)).meta
    entry = meta["params"]["layers.0.attention.wq.weight"]
    assert (entry["dtype"], entry["param_dtype"]) == ("float32", "float16")
    scaler = meta["optimizer"]["scaler"]
    assert scaler is not None  # it moved before the save (halved on an overflow at least)
    assert scaler["skipped_steps"] > 0 or scaler["scale"] != 65536.0
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _train(None, config(root, dtype="fp16", resume=ck))
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    cfg = config(str(tmp_path), steps=3, every=1)
    cfg.train.keep_checkpoints = 2
    Trainer(cfg, init_mesh(), show_progress=False).run()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        step_dirname(2),
        step_dirname(3),
    ]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two")
    Trainer(config(str(root), steps=2, every=1), init_mesh(), show_progress=False).run()
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_shard_is_detected_and_previous_loads(
    two_checkpoints: Path, tmp_path: Path, damage: str
) -> None:
    root = _copy(two_checkpoints, tmp_path / "ck")
    shard = root / step_dirname(2) / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        shard.write_bytes(bytes(data[: len(data) - 100]))
    what = "fails its checksum" if damage == "flip" else "truncated"
    with pytest.raises(CorruptCheckpointError, match=f"rank00000.safetensors .*{what}"):
        CheckpointReader(root / step_dirname(2))
    with pytest.warns(RuntimeWarning, match=f"instead of the latest checkpoint: .*{what}"):
        reader = find_checkpoint("latest", root)
    assert reader is not None and reader.step == 1
    # a run resuming from `latest` falls back to step 1 and continues from there
    with pytest.warns(RuntimeWarning, match="resuming from step_00000001"):
        tr = Trainer(config(str(root), steps=2, resume="latest"), init_mesh(), show_progress=False)
    assert tr.start_step == 1
    # an explicitly named corrupt checkpoint is refused, not replaced
    with pytest.raises(CorruptCheckpointError):
        find_checkpoint(str(root / step_dirname(2)), None)


def test_model_mismatch_is_refused_naming_the_tensor(two_checkpoints: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no tensor 'layers\.2\.attention_norm\.weight'"):
        Trainer(
            config(str(two_checkpoints), resume="latest", n_layers=3),
            init_mesh(),
            show_progress=False,
        )
    cfg = config(str(two_checkpoints), resume="latest")
    cfg.model.ffn_dim = 64
    with pytest.raises(CheckpointError, match=r"'layers\.0\.feed_forward\.w1\.weight' has shape"):
        Trainer(cfg, init_mesh(), show_progress=False)


def _save_and_die(root: str, stage: str) -> None:
    """Child: save at step 1, then die (SIGKILL) at ``stage`` of the save at step 2."""
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
    saves = {"n": 0}

    def hook(name: str) -> None:
        if name == "latest":
            saves["n"] += 1
        if saves["n"] == 1 and name == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(config(root, steps=2, every=1), init_mesh(), show_progress=False)
    trainer.checkpoints.on_stage = hook
    trainer.run()
    os._exit(0)


@pytest.mark.parametrize("stage", ["shard", "metadata", "renamed"])
def test_save_killed_midway_leaves_previous_checkpoint(tmp_path: Path, stage: str) -> None:
    root = tmp_path / "ck"
    proc = mp.get_context("fork").Process(target=_save_and_die, args=(str(root), stage))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL
    assert read_latest(root) == root / step_dirname(1)
    reader = find_checkpoint("latest", root)
    assert reader is not None and reader.step == 1
    # the next save of step 2 replaces whatever the killed one left
    tr = Trainer(config(str(root), steps=2, every=1, resume="latest"), init_mesh(), False)
    tr.run()
    assert read_latest(root) == root / step_dirname(2)
    assert not list(root.glob(".tmp-*"))
    assert CheckpointReader(root / step_dirname(2)).step == 2


def test_save_failing_with_disk_full_leaves_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saves = {"n": 0}

    def hook(name: str) -> None:
        saves["n"] += name == "latest"
        if saves["n"] == 1 and name == "shard":
            raise OSError(errno.ENOSPC, "No space left on device")

    trainer = Trainer(config(str(tmp_path), steps=2, every=1), init_mesh(), False)
    trainer.checkpoints.on_stage = hook
    with pytest.raises(CheckpointSaveError, match="No space left"):
        trainer.run()
    assert not list(tmp_path.glob(".tmp-*"))  # the failed save's temporary folder is gone
    assert read_latest(tmp_path) == tmp_path / step_dirname(1)
    reader = find_checkpoint("latest", tmp_path)
    assert reader is not None and reader.step == 1


# ---------------------------------------------------------------------------- layouts

LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "dp2": (2, {}),
    "zero3_dp2": (2, {"zero": 3}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bit_exact(
    pools: Callable[[int], WorkerPool], tmp_path: Path, layout: str
) -> None:
    world, kw = LAYOUTS[layout]
    root = str(tmp_path / "ck")
    full = _pool_run(pools, world, config(root, **kw))
    ck = str(Path(root) / step_dirname(SAVE_AT))
    resumed = _pool_run(pools, world, config(root, resume=ck, **kw))
    assert resumed["start"] == SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])


def _body_sigterm(ctx: WorkerContext, cfg: Config) -> Any:
    """Rank 1 gets SIGTERM during step 2: every rank saves after step 2 and stops."""
    tr = Trainer(cfg, ctx.mesh(dp=ctx.world_size), show_progress=False)
    if ctx.rank == 1:
        step = tr.train_step

        def signalled(k: int) -> Any:
            if k == 1:
                signal.raise_signal(signal.SIGTERM)
            return step(k)

        tr.train_step = signalled  # type: ignore[method-assign]
    before = signal.getsignal(signal.SIGTERM)
    s = tr.run()
    return {"losses": s.losses, "handler": signal.getsignal(signal.SIGTERM) is before}


def test_sigterm_saves_at_step_boundary_and_resume_matches(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    cfg = config(str(root), steps=4, every=0)
    got = pools(2).run(f"{M}:_body_sigterm", cfg)
    assert [len(r["losses"]) for r in got] == [2, 2]  # both stopped after step 2
    assert all(r["handler"] for r in got)  # handlers restored
    assert read_latest(root) == root / step_dirname(2)
    resumed = _pool_run(pools, 2, config(str(root), steps=4, every=0, resume="latest"))
    full = _pool_run(pools, 2, config(None, steps=4))
    assert got[0]["losses"] + resumed["losses"] == full["losses"]


RESHARD: dict[str, tuple[tuple[int, dict[str, int]], tuple[int, dict[str, int]]]] = {
    "dp2->dp1": ((2, {}), (1, {})),
    "zero3_dp4->zero1_dp2": ((4, {"zero": 3}), (2, {"zero": 1})),
    "zero2_hybrid_F2_dp4->dp1": ((4, {"zero": 2, "shard": 2}), (1, {})),
    "dp2->tp2": ((2, {}), (2, {"tp": 2})),
    "tp2->zero2_dp2": ((2, {"tp": 2}), (2, {"zero": 2})),
    "tp2->pp2": ((2, {"tp": 2}), (2, {"pp": 2})),
    "zero1_pp2xdp2->tp2xdp2": ((4, {"pp": 2, "zero": 1}), (4, {"tp": 2})),
}


def _run_on(pools: Callable[[int], WorkerPool], world: int, cfg: Config, **kw: Any) -> Any:
    if world == 1:
        return _train(None, cfg, **kw)
    return _pool_run(pools, world, cfg, **kw)


@pytest.mark.parametrize("case", list(RESHARD))
def test_reshard(pools: Callable[[int], WorkerPool], tmp_path: Path, case: str) -> None:
    (w_src, kw_src), (w_dst, kw_dst) = RESHARD[case]
    root = str(tmp_path / "ck")
    src = _run_on(pools, w_src, config(root, **kw_src), weights_at=SAVE_AT)
    ck = str(Path(root) / step_dirname(SAVE_AT))
    dst = _run_on(pools, w_dst, config(None, resume=ck, **kw_dst))
    assert dst["start"] == SAVE_AT
    _assert_same_weights(dst["loaded"], src["snap"])
    assert dst["losses"] == pytest.approx(src["losses"][SAVE_AT:], rel=1e-5)


def test_consolidate_then_start_from_it_under_another_layout(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    src = _pool_run(pools, 4, config(str(root), zero=3), weights_at=SAVE_AT)
    out = tmp_path / "model.safetensors"
    summary = consolidate(root / step_dirname(SAVE_AT), out)
    assert summary["step"] == SAVE_AT and summary["tensors"] == len(src["snap"])
    dst = _pool_run(pools, 2, config(None, steps=1, tp=2, init_from=str(out)))
    assert dst["start"] == 0
    _assert_same_weights(dst["loaded"], src["snap"])
