"""Checkpoints written by an older plait still load, value for value.

``fixtures/old_format/step_00000002`` was written by ``plait train --nproc 2 --tp 2``
at the commit ``expected.json`` names, and ``expected.json`` holds what that commit's
loader read from it: the sha256 of every stored tensor (parameters, AdamW moments and
step counts, every rank's RNG states), the counters and the sampler position, and what a
one-process (tp 1: resharded) Trainer resumed from it held. The generator
(``fixtures/make_old_format.py``) is never rerun: the files are the old format.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.checkpoint import CheckpointReader, CorruptCheckpointError, find_checkpoint
from plait.config.coerce import config_from_dict
from plait.mesh import init_mesh
from plait.train.trainer import Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "old_format"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text("utf-8"))
FOLDER = FIXTURE / EXPECTED["folder"]


def sha(t: torch.Tensor) -> str:
    """As the generator spells it: dtype, shape and the sha256 of the bytes."""
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()}"


def test_every_stored_value_reads_as_the_old_loader_read_it() -> None:
    want = EXPECTED["stored"]
    reader = find_checkpoint(str(FOLDER), None)  # every file's sha256 verified
    assert reader is not None
    try:
        m = reader.meta
        assert reader.step == want["step"] == 2
        assert m["sched_step"] == want["sched_step"]
        assert m["optimizer"] == want["optimizer"]
        assert m["sampler"] == want["sampler"]
        assert m["layout"] == want["layout"] and m["layout"]["tp"] == 2
        assert [r["rng"] for r in m["ranks"]] == want["rng_scalars"]
        got: dict[str, str] = {}
        for name in reader.params:
            for kind in reader.kinds(name):
                got[f"{name}/{kind}"] = sha(reader.read_global(name, kind))
            for s in reader.scalar_names(name):
                v = reader.scalar(name, s)
                assert v is not None
                got[f"{name}/{s}"] = sha(v)
        assert got == want["tensors"]
        assert any(k.endswith("/exp_avg_sq") for k in got) and any(k.endswith("/step") for k in got)
        rng = {
            f"{r['file']}/{key}": sha(reader.tensor(r["file"], key))
            for r in m["ranks"]
            for key in r["keys"]
            if key.startswith("rng/")
        }
        assert rng == want["rng"] and len(rng) == 6  # torch, python, numpy on each rank
    finally:
        reader.close()


def test_the_old_tp2_checkpoint_resumes_on_one_process_bit_exactly(tmp_path: Path) -> None:
    want = EXPECTED["resumed_tp1"]
    meta = CheckpointReader(FOLDER, verify=False).meta
    cfg = config_from_dict(meta["config"])
    cfg.parallel.tp = 1  # another layout: each tp-2 piece is cut out of both shard files
    cfg.train.checkpoint_dir, cfg.train.resume, cfg.log.metrics = None, str(FOLDER), None
    cfg.log.dir = str(tmp_path)
    tr = Trainer(cfg, init_mesh(), show_progress=False)
    try:
        assert tr.start_step == want["start_step"] == 2
        assert tr.state.sched_step == want["sched_step"]
        counters = (tr.optimizer.steps, tr.optimizer.skipped)
        assert counters == (want["opt_steps"], want["opt_skipped"])
        # its loader state names no order: it keeps the order it was started with (issue 44)
        assert tr.state.sampler.state_dict() == {**want["sampler"], "order": "randperm"}
        assert {n: sha(p) for n, p in tr.base.named_parameters()} == want["params"]
        names = {id(p): n for n, p in tr.base.named_parameters()}
        state = {
            f"{names.get(id(p), '?')}/{k}": sha(v)
            for p, st in tr.optimizer.inner.state.items()
            for k, v in st.items()
        }
        assert state == want["optimizer_state"]
    finally:
        tr.checkpoints.close()


def test_a_changed_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The fixture's checksums are live: the test above cannot pass on altered files."""
    copy = tmp_path / FOLDER.name
    shutil.copytree(FOLDER, copy)
    shard = copy / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"rank00001\.safetensors fails its checksum"):
        find_checkpoint(str(copy), None)
