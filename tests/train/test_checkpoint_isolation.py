"""Checkpoint code names no parallelism: it imports nothing from ``plait.parallel``.

Checkpointing sees the model and optimizer only through the local-pieces protocol
(:mod:`plait.pieces`, :mod:`plait.train.state`). This test imports the checkpoint
modules in a fresh interpreter whose import system refuses every ``plait.parallel``
module (and ``plait.optim``, which builds on it): an import of one, direct or through
another module, fails the test. A control run checks that the blocker does block.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECKPOINT_MODULES = (
    "plait.train.checkpoint",
    "plait.train.checkpoint_meta",
    "plait.train.checkpoint_io",
    "plait.train.checkpoint_load",
    "plait.train.checkpoint_save",
    "plait.train.checkpoint_async",
    "plait.train.reshard",
    "plait.train.state",
    "plait.pieces",
)

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "plait.optim" or name.startswith("plait.parallel"):
                raise ImportError(f"checkpoint code imported {name}")
            return None

    sys.meta_path.insert(0, Block())
    import importlib
    for module in sys.argv[1:]:
        importlib.import_module(module)
    loaded = sorted(m for m in sys.modules if m.startswith("plait.parallel"))
    assert not loaded, loaded
    print("ok")
    """
)


def _run(*modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_checkpoint_modules_import_no_parallel_module() -> None:
    r = _run(*CHECKPOINT_MODULES)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_blocker_blocks() -> None:
    r = _run("plait.parallel.data")
    assert r.returncode != 0 and "checkpoint code imported plait.parallel" in r.stderr
