"""In-memory checkpoint copies (``train.memory_checkpoint_every``) and their recovery.

On 4 pool ranks (dp4 with ZeRO-1, so every rank holds its own optimizer shards) the
trainer copies every step; then each rank checks that the copy its buddy holds of it is
bit-equal to its own state (every piece's parameter and optimizer state, decoded from
the buddy's bytes, ``torch.equal`` to the live tensors), that plait.comm counted exactly
the bytes of the formula (an 8-byte size, an 8-byte length, the index and the
safetensors file: :func:`~plait.checkpoint.memory_copy.copy_bytes`) and that the
parameter and Adam bytes sent over all ranks are 3 x 4 bytes per model parameter
(float32 weight, exp_avg, exp_avg_sq; each element held by one rank). Then, in this
process, :func:`~plait.checkpoint.memory_store.recover` assembles a checkpoint a reader
opens (its checksums verified) after one rank is lost, and gives up, naming the ranks,
when a rank and its buddy are both lost.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from plait.checkpoint import CheckpointReader
from plait.checkpoint.format import rank_filename, step_dirname
from plait.checkpoint.memory_copy import copy_bytes, serialise
from plait.checkpoint.memory_store import STORE_ENV, MemoryStore, buddy_of, recover, ward_of
from plait.testing import WorkerContext, WorkerPool
from plait.train.trainer import Trainer
from tests.tiny import tiny_config

M = "tests.checkpoint.test_memory_copy"
STEPS = 2


def _body(ctx: WorkerContext, root: str) -> dict[str, Any]:
    os.environ[STORE_ENV] = root
    try:
        cfg = tiny_config(steps=STEPS, parallel={"zero": 1})
        cfg.train.memory_checkpoint_every, cfg.train.eval_every = 1, 0
        mesh = ctx.mesh(dp=ctx.world_size)
        tr = Trainer(cfg, mesh, show_progress=False)
        tr.run()
        assert [c.step for c in tr.checkpoints.copies] == list(range(1, STEPS))
        g = mesh.world()
        sent0 = mesh.stats.get(g.name, "send").bytes
        rep = tr.checkpoints.copy_to_memory(tr.state, STEPS)  # one more, measured
        sent = mesh.stats.get(g.name, "send").bytes - sent0
        index, file = serialise(tr.state, STEPS)  # the state the copy was taken of
    finally:
        del os.environ[STORE_ENV]
    store = MemoryStore(Path(root))
    rank, world = mesh.rank, mesh.world_size
    buddy = buddy_of(rank, world, world)
    held = (store.holder(buddy) / step_dirname(STEPS) / rank_filename(rank)).read_bytes()
    decoded = load_safetensors(held)
    state = tr.optimizer.inner.state
    same, adam_bytes = True, 0
    for lp in tr.optimizer.local_pieces():
        if not lp.write:
            continue
        tag = f"{lp.name}/{lp.start}"
        same &= torch.equal(decoded[f"param/{tag}"], lp.value.detach().cpu())
        adam_bytes += decoded[f"param/{tag}"].numel() * 4
        for k, v in state.get(lp.key, {}).items():
            if v.dim() > 0:
                same &= torch.equal(decoded[f"{k}/{tag}"], v.detach().cpu().reshape(-1))
                adam_bytes += v.numel() * v.element_size()
    return {
        "same": same,
        "bytes_equal": held == file,
        "sent": sent,
        "reported": rep.sent_bytes,
        "formula": copy_bytes(index, file),
        "adam_bytes": adam_bytes,
        "params": tr.params,
        "held": rep.held_bytes,
    }


def test_copies_are_bit_equal_counted_and_recoverable(
    pools: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    world = 4
    results = pools(world).run(f"{M}:_body", str(tmp_path))
    for r in results:
        assert r["same"] and r["bytes_equal"]
        assert r["sent"] == r["reported"] == r["formula"]
        assert r["held"] > r["formula"] - 16  # its own copy and its ward's
    assert sum(r["adam_bytes"] for r in results) == 3 * 4 * results[0]["params"]

    copy = tmp_path.parent / f"{tmp_path.name}-copy"  # recover() drops the old world's copies
    shutil.copytree(tmp_path, copy)
    lost = {1}
    rec = recover(MemoryStore(tmp_path), world, lost)
    assert rec.step == STEPS and rec.folder is not None, rec.why
    assert rec.why == f"from the memory copies of step {STEPS}"
    reader = CheckpointReader(rec.folder)  # every file's sha256 checked
    assert reader.step == STEPS and sorted(reader.meta["files"]) == [
        rank_filename(r) for r in range(world)
    ]
    reader.close()
    both = {2, buddy_of(2, world, world)}  # rank 2 and the rank that holds its copy
    assert ward_of(buddy_of(2, world, world), world, world) == 2
    gone = recover(MemoryStore(copy), world, both)
    assert gone.folder is None
    assert "rank(s) 2 and their buddies were lost" in gone.why
    assert not list(copy.glob("holder*"))  # the old world's copies are dropped


def test_buddies_are_on_another_node() -> None:
    # 2 nodes of 4: rank r's copy is on the other node, same local rank
    assert [buddy_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [buddy_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]  # one machine: the next
    assert all(ward_of(buddy_of(r, 8, 4), 8, 4) == r for r in range(8))


@pytest.mark.parametrize("lost", [set(), {0}])
def test_recover_without_copies_names_it(tmp_path: Path, lost: set[int]) -> None:
    rec = recover(MemoryStore(tmp_path), 2, lost)
    assert (rec.folder, rec.why) == (None, "no memory copy was complete")
