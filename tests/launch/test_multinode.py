"""Multi-node for real: two torchrun agents on this machine acting as two nodes.

Each agent is started as on its own node (``torchrun --nnodes 2 --nproc-per-node 1``)
and runs ``plait train``; they meet through a rendezvous on a free localhost port:

* ``c10d``: docs/multinode.md's own block, run as written (``--rdzv-backend c10d
  --rdzv-endpoint localhost:$PORT``; the rendezvous assigns the node ranks), with the
  docs' ``torchrun`` shim appending tests/test_docs.py's tiny run;
* ``static``: ``--node-rank 0/1 --master-addr localhost --master-port PORT``.

The world of 2 ranks must train exactly as ``plait train --nproc 2`` on one node: the
same loss at every step, bit for bit (same layout, one thread per rank), and the
checkpoint written into the folder both "nodes" share.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs import TINY, _shims, parse_blocks
from tests.tiny import run_plait

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "multinode.md"
RUN = shlex.split(TINY)  # a tiny model, 2 steps, one thread per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _check_run(folder: Path, metrics: Path, one_node: list[float], stdout: str) -> None:
    assert "mesh pp1 x dp2 x cp1 x tp1 (2 ranks)" in stdout, stdout  # one world of 2
    assert _losses(metrics) == one_node  # bit for bit
    ck = folder / "shared" / "ckpt"
    assert (ck / "latest").read_text().strip() == "step_00000002"
    meta = json.loads((ck / "step_00000002" / "metadata.json").read_text())
    assert meta["layout"]["world_size"] == 2 and len(meta["files"]) == 2


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    folder = tmp_path_factory.mktemp("one")
    r = run_plait(["train", *RUN, "--nproc", "2", "--log.dir", "out"], folder)
    assert r.returncode == 0, r.stderr[-3000:]
    return _losses(folder / "out" / "metrics.jsonl")


def test_docs_two_agents_c10d_train_as_one_node(one_node: list[float], tmp_path: Path) -> None:
    mark = ("run-by", "tests/launch/test_multinode.py")
    blocks = [b for b in parse_blocks(PAGE) if b.marker == mark]
    assert len(blocks) == 1 and "--rdzv-backend c10d" in blocks[0].code
    bindir = tmp_path / ".bin"
    bindir.mkdir()
    _shims(bindir)  # `torchrun ... -m plait train` gets TINY appended, as in test_docs
    env = _env()
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    r = subprocess.run(
        ["bash", "-e", "-c", blocks[0].code], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _check_run(tmp_path, tmp_path / "runs" / "last" / "metrics.jsonl", one_node, r.stdout)


def test_two_agents_static_rendezvous_train_as_one_node(
    one_node: list[float], tmp_path: Path
) -> None:
    port = _free_port()
    agents = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "localhost",
            "--master-port", str(port), "-m", "plait", "train", *RUN,
            "--log.dir", "out", "--train.checkpoint_dir", "shared/ckpt",
        ]
        agents.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, env=_env(), text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        )
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    stdout = "".join(out for out, _ in outputs)
    _check_run(tmp_path, tmp_path / "out" / "metrics.jsonl", one_node, stdout)
