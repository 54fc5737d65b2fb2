"""Multi-node for real: two torchrun agents on this machine acting as two nodes.

Each agent is started as on its own node (``torchrun --nnodes 2 --nproc-per-node 1``)
and runs ``plait train``; they meet through a rendezvous on a free localhost port:

* ``c10d``: ``--rdzv-backend c10d --rdzv-endpoint localhost:PORT`` (the rendezvous
  assigns the node ranks; what docs/multinode.md's SLURM script uses);
* ``static``: ``--node-rank 0/1 --master-addr localhost --master-port PORT``.

The world of 2 ranks must train exactly as ``plait train --nproc 2`` on one node: the
same loss at every step, bit for bit (same layout, one thread per rank), and the
checkpoint written into the folder both "nodes" share.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import run_plait, tiny_args

ROOT = Path(__file__).resolve().parents[2]
RUN = [*tiny_args(), "--steps", "3", "--launch.threads", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    folder = tmp_path_factory.mktemp("one")
    r = run_plait(["train", *RUN, "--nproc", "2", "--log.dir", "out"], folder)
    assert r.returncode == 0, r.stderr[-3000:]
    return _losses(folder / "out" / "metrics.jsonl")


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_agents_train_as_one_node(
    one_node: list[float], tmp_path: Path, rendezvous: str
) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    agents = []
    for node in (0, 1):
        how = (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "t"]
            if rendezvous == "c10d"
            else [
                *["--node-rank", str(node), "--master-addr", "localhost"],
                *["--master-port", str(port)],
            ]
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", *how, "-m", "plait", "train", *RUN,
            "--log.dir", "out", "--train.checkpoint_dir", "shared/ck",
        ]
        agents.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, env=env, text=True,
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
    assert "mesh pp1 x dp2 x cp1 x tp1 (2 ranks)" in stdout, stdout  # one world of 2
    assert _losses(tmp_path / "out" / "metrics.jsonl") == one_node  # bit for bit
    ck = tmp_path / "shared" / "ck"
    assert (ck / "latest").read_text().strip() == "step_00000003"
    meta = json.loads((ck / "step_00000003" / "metadata.json").read_text())
    assert meta["layout"]["world_size"] == 2 and len(meta["files"]) == 2
