"""Rank-local loading: each rank reads exactly its own pieces, not the checkpoint.

A zero3 dp4 run saves at step 3 (4 files, each a quarter of the model and its AdamW
state). Resumes under other layouts report what each rank read
(``Checkpointing.load_report``): the tensor bytes equal, to the byte, the pieces the
rank holds in its new layout (values + ``exp_avg`` + ``exp_avg_sq`` of every piece, one
4-byte ``step`` scalar per piece, and its RNG states), each file's sha256 was checked by
exactly one rank of the host, and the weights loaded equal the source's (the reshard
matrix of test_checkpoint.py checks losses too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plait.checkpoint import step_dirname
from plait.checkpoint.files import ShardFile
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.checkpoint.test_checkpoint import (
    SAVE_AT,
    _assert_same_weights,
    _run_on,
    config,
    full_weights,
)

M = "tests.checkpoint.test_load_local"


def _expected_bytes(tr: Trainer, folder: Path) -> int:
    """The tensor bytes of this rank's pieces, computed from its pieces and the files'
    headers (not from the reader)."""
    pieces = {(p.name, p.start, p.end, str(p.tp)): p for p in tr.optimizer.local_pieces()}
    for p in tr.model.local_pieces():
        pieces.setdefault((p.name, p.start, p.end, str(p.tp)), p)
    kinds = 3  # param, exp_avg, exp_avg_sq (fp32 here: 4 bytes each)
    total = sum((p.end - p.start) * 4 * kinds + 4 for p in pieces.values())  # + step scalar
    files = sorted(folder.glob("rank*.safetensors"))
    rng_file = ShardFile(files[tr.mesh.rank % len(files)])
    for key in ("rng/torch", "rng/python", "rng/numpy"):
        _, _, a, b = rng_file.info(key)
        total += b - a
    rng_file.close()
    return total


def _load_body(ctx: WorkerContext, ck: str, kw: dict[str, int]) -> Any:
    cfg = config(None, resume=ck, steps=SAVE_AT + 1, **kw)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    tr = Trainer(cfg, ctx.mesh(dp=ctx.world_size // (tp * pp), tp=tp, pp=pp), False)
    report = dict(tr.checkpoints.load_report)
    return {
        "report": report,
        "expected": _expected_bytes(tr, Path(ck)),
        "loaded": full_weights(tr),
    }


@pytest.fixture(scope="module")
def zero3_dp4(pools: Callable[[int], WorkerPool], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("z3")
    src = _run_on(pools, 4, config(str(root), zero=3), weights_at=SAVE_AT)
    return root / step_dirname(SAVE_AT), src


@pytest.mark.parametrize(
    "world,kw", [(4, {"zero": 3}), (2, {"zero": 3}), (2, {"zero": 1}), (4, {"pp": 2, "zero": 1})]
)
def test_each_rank_reads_only_its_pieces(
    pools: Callable[[int], WorkerPool], zero3_dp4: Any, world: int, kw: dict[str, int]
) -> None:
    folder, src = zero3_dp4
    files = sorted(folder.glob("rank*.safetensors"))
    data_bytes = 0
    for f in files:
        sf = ShardFile(f)
        data_bytes += sum(sf.info(k)[3] - sf.info(k)[2] for k in sf.entries)
        sf.close()
    got = pools(world).run(f"{M}:_load_body", str(folder), kw)
    for rank, r in enumerate(got):
        assert r["report"]["bytes_read"] == r["expected"], rank  # exactly its own pieces
        assert r["report"]["bytes_read"] < data_bytes, rank  # never the whole checkpoint
    hashed = sorted(f for r in got for f in r["report"]["hashed"])
    assert hashed == [f.name for f in files]  # every file checksummed once on this host
    union: dict[str, Any] = {}
    for r in got:
        union.update(r["loaded"])
    _assert_same_weights(union, src["snap"])


def test_checkpoint_written_by_the_safetensors_library_still_loads(tmp_path: Path) -> None:
    """Checkpoints from before the rank-local loader (files serialised by
    ``safetensors.torch.save``, another header order) load bit-exactly: the format is
    the same, only the writer changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from plait.checkpoint.files import sha256_file
    from tests.checkpoint.test_checkpoint import _train

    root = tmp_path / "ck"
    full = _train(None, config(str(root)))
    old = tmp_path / "old"
    shutil.copytree(root / step_dirname(SAVE_AT), old)
    meta = json.loads((old / "metadata.json").read_text())
    for name in meta["files"]:
        save_file(load_file(str(old / name)), str(old / name))  # the library's layout
        size = (old / name).stat().st_size
        meta["files"][name] = {"sha256": sha256_file(old / name), "bytes": size}
    (old / "metadata.json").write_text(json.dumps(meta))
    assert (old / "rank00000.safetensors").read_bytes() != (
        root / step_dirname(SAVE_AT) / "rank00000.safetensors"
    ).read_bytes()
    resumed = _train(None, config(None, resume=str(old)))
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    _assert_same_weights(resumed["final"], full["final"])


def _init_body(ctx: WorkerContext, weights: str) -> Any:
    cfg = config(None, init_from=weights, steps=1, zero=3)
    tr = Trainer(cfg, ctx.mesh(dp=ctx.world_size), False)
    pieces = {(p.name, p.start, p.end) for p in tr.optimizer.local_pieces()}
    return {
        "read": tr.checkpoints.load_report["bytes_read"],
        "expected": sum((b - a) * 4 for _, a, b in pieces),  # fp32 values only
        "loaded": full_weights(tr),
    }


def test_init_from_a_consolidated_file_reads_only_own_pieces(
    pools: Callable[[int], WorkerPool], zero3_dp4: Any, tmp_path: Path
) -> None:
    from plait.checkpoint import consolidate

    folder, src = zero3_dp4
    out = tmp_path / "model.safetensors"
    summary = consolidate(folder, out)
    got = pools(2).run(f"{M}:_init_body", str(out))
    for r in got:
        assert r["read"] == r["expected"] < summary["bytes"]  # its shard's weights only
    union: dict[str, Any] = {}
    for r in got:
        union.update(r["loaded"])
    _assert_same_weights(union, src["snap"])
