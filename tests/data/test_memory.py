"""Training on shards larger than the memory the rank may use.

The test writes a prepared folder of 200 MB of random tokens (4 shards, 100,000
documents) and trains the tiny model on it for a few steps in a fresh process whose
``RLIMIT_DATA`` (private writable memory: heap and anonymous maps, what a loaded copy of
the tokens would need; read-only file maps do not count) is set to what the process uses
after its imports plus 120 MB, less than the shards. The same limit refuses reading the
tokens into memory (the control), so the run can only pass by mapping them. Resident
file-backed memory (``RssFile``) grows by less than a tenth of the shards' bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from plait.data.index import DOCUMENTS_NAME, ShardIndex, sha256_file, shard_name

SHARDS, SHARD_TOKENS, DOCS = 4, 25_000_000, 100_000  # 200 MB of uint16
LIMIT_EXTRA = 120 << 20


def random_folder(root: Path) -> int:
    """A prepared folder of random byte tokens; returns its shards' total bytes."""
    root.mkdir()
    rng = np.random.default_rng(0)
    total = SHARDS * SHARD_TOKENS
    ends = np.unique(rng.integers(1, total, DOCS - 1)).astype(np.uint64)
    ends = np.append(ends, np.uint64(total))
    shards = []
    for i in range(SHARDS):
        toks = rng.integers(1, 256, SHARD_TOKENS, dtype=np.uint16)
        lo = i * SHARD_TOKENS
        inside = ends[(ends > lo) & (ends <= lo + SHARD_TOKENS)].astype(np.int64) - 1 - lo
        toks[inside] = 0  # eos closes every document
        toks.tofile(root / shard_name(i))
        shards.append(
            {
                "file": shard_name(i),
                "tokens": SHARD_TOKENS,
                "sha256": sha256_file(root / shard_name(i)),
            }
        )
    ends.tofile(root / DOCUMENTS_NAME)
    ShardIndex(
        root,
        "byte",
        256,
        0,
        "uint16",
        SHARD_TOKENS,
        len(ends),
        total,
        shards,
        {"file": DOCUMENTS_NAME, "sha256": sha256_file(root / DOCUMENTS_NAME)},
        {"path": "random", "field": "text"},
    ).write()
    return total * 2


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    from plait import init_mesh
    from plait.config import Config, DataConfig, LogConfig, ModelConfig, TrainConfig
    from plait.train.trainer import Trainer

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    folder, extra = sys.argv[1], int(sys.argv[2])
    cfg = Config(
        model=ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32),
        train=TrainConfig(steps=4, global_batch=8, seq_len=32, warmup_steps=1,
                          eval_every=2, eval_batches=1),
        data=DataConfig(source=folder, val_fraction=0.01),
        log=LogConfig(progress="none", peak_tflops=1.0),
    )
    Trainer(Config(model=cfg.model, train=cfg.train, log=cfg.log,
                   data=DataConfig(max_bytes=50_000)), init_mesh(), show_progress=False).run()
    limit = status("VmData") + extra
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    file0 = status("RssFile")
    s = Trainer(cfg, init_mesh(), show_progress=False).run()
    out = {"losses": s.losses, "file_growth": status("RssFile") - file0}
    try:  # the control: a copy of the tokens in memory does not fit the limit
        held = [np.fromfile(f"{folder}/shard_0000{i}.bin", dtype=np.uint16) for i in range(4)]
        out["loaded"] = True
    except MemoryError:
        out["loaded"] = False
    print(json.dumps(out))
    """
)


def test_training_on_shards_larger_than_the_memory_limit(tmp_path: Path) -> None:
    total = random_folder(tmp_path / "big")
    assert total > 1.5 * LIMIT_EXTRA
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "big"), str(LIMIT_EXTRA)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["loaded"] is False  # the limit bites a loaded copy
    assert len(out["losses"]) == 4 and all(np.isfinite(out["losses"]))
    assert out["file_growth"] < total / 10
