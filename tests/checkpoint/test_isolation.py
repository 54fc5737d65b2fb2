"""Checkpoint code names no parallelism: it imports nothing from ``plait.parallel``.

Checkpointing sees the model and optimizer only through the local-pieces protocol
(:mod:`plait.pieces`, :mod:`plait.checkpoint.state`). This test imports every module of
the checkpoint package in a fresh interpreter whose import system refuses every
``plait.parallel`` module (and ``plait.optim``, which builds on it) and every
``plait.train`` module (the loop sits above the package): an import of one, direct or
through another module, fails the test. Control runs check that the blocker does block.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import plait.checkpoint

CHECKPOINT_MODULES = (
    "plait.checkpoint",
    *(f"plait.checkpoint.{m.name}" for m in pkgutil.iter_modules(plait.checkpoint.__path__)),
    "plait.pieces",
)

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "plait.optim" or name.startswith(("plait.parallel", "plait.train")):
                raise ImportError(f"checkpoint code imported {name}")
            return None

    sys.meta_path.insert(0, Block())
    import importlib
    for module in sys.argv[1:]:
        importlib.import_module(module)
    loaded = sorted(m for m in sys.modules if m.startswith(("plait.parallel", "plait.train")))
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


def test_checkpoint_modules_import_no_parallel_or_train_module() -> None:
    assert len(CHECKPOINT_MODULES) > 10, CHECKPOINT_MODULES  # the package's modules were found
    r = _run(*CHECKPOINT_MODULES)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_blocker_blocks() -> None:
    r = _run("plait.parallel.data_parallel")
    assert r.returncode != 0 and "checkpoint code imported plait.parallel" in r.stderr
    r = _run("plait.train.report")
    assert r.returncode != 0 and "checkpoint code imported plait.train" in r.stderr
