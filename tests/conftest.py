"""Shared fixtures: session-scoped pools of gloo ranks (world sizes 2, 4 and 8).

A pool starts on first use and lives for the whole session, so a multi-process test
costs milliseconds of set-up. Bodies are module-level functions named
``"tests.<package>.<module>:<function>"`` and run on every rank.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# inductor compiles in the process that compiles: its default pool of compile workers
# starts fresh interpreters in every rank that compiles, which on 2 cores costs more than
# it saves (cold cache: the compile tests took 272 s with the pool, 199 s without, at the
# same load). Set before torch._inductor.config is imported, here and by the zygote.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from plait.testing import WorkerPool
from plait.testing.zygote import Zygote

REAL_PYTHON = (
    "tests/launch/test_local.py::test_sigterm",
    "tests/launch/test_local.py::test_ranks_die",
    "tests/launch/test_oom.py",
    "tests/launch/test_ray",
    "tests/testing/",
    "tests/test_init.py",
    "tests/cli/test_main.py",
    "tests/cli/test_tune.py",
    "tests/plan/test_isolation.py",
    "tests/checkpoint/test_isolation.py",
    "tests/data/test_memory.py",
    "tests/ps/test_ray_server.py",
    "tests/parallel/test_compile.py::test_compile_on_a_cpu_without_a_compiler",
)
"""Tests (node id prefixes) whose subprocesses are fresh interpreters: they check what a
fresh one imports or how much memory it takes, how signals and kills reach the ranks of
a launcher (which they find as its child processes), start Ray, or set an environment
variable that torch reads when imported (``CXX``: inductor's compiler).
Every other test runs with ``sys.executable`` pointing at the session's zygote (see
:func:`_forked_python`); ``PLAIT_TEST_FRESH_PYTHON=1`` turns that off everywhere."""


RAY_FILES = (
    "tests/launch/test_ray",
    "tests/ps/test_ray",
    "tests/cli/test_tune.py",
)
"""Test files that start a local Ray instance: under pytest-xdist they share one worker."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``python -m pytest -n N --dist loadgroup``, for machines with
    more cores; the default run is serial) the tests of one file run on one worker, in
    order, so a module's fixtures are built once, and every Ray test runs on the same
    worker (one local Ray instance at a time)."""
    for item in items:
        path = item.nodeid.split("::")[0]
        group = "ray" if path.startswith(RAY_FILES) else path
        item.add_marker(pytest.mark.xdist_group(group))


class Pools:
    """Lazily started pools, one per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = WorkerPool(world_size, comm_timeout_s=60.0)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], WorkerPool]]:
    """``pools(n)`` returns the session's pool of ``n`` ranks."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """The session's zygote (:mod:`plait.testing.zygote`), started without waiting."""
    z = Zygote()
    z.start(wait=False)
    yield z
    z.close()


@pytest.fixture(autouse=True)
def _forked_python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sys.executable`` is the zygote's shim during the test (outside
    :data:`REAL_PYTHON`): ``python -m plait ...``, the ranks of ``plait train --nproc N``
    and of torchrun, a docs page's python blocks start as forks of an interpreter that
    has imported torch and plait already, in milliseconds instead of seconds each; they
    run the same code on the same arguments, environment and files."""
    if os.environ.get("PLAIT_TEST_FRESH_PYTHON"):
        return
    if request.node.nodeid.startswith(REAL_PYTHON):
        return
    z: Zygote = request.getfixturevalue("zygote")
    monkeypatch.setattr(sys, "executable", z.start(wait=False))


@pytest.fixture(scope="session")
def ray_instance(tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Iterator[Path]:
    """One local Ray instance (4 CPUs) for the Ray tests, shut down at the end; temporary
    files under /tmp/plait-ray-<id> (short: Ray's Unix sockets live there), removed.
    Its workers run ``tests/launch/ray_faults.py``'s setup hook; yields the control file
    with which a test kills a rank (see there). Skipped without Ray."""
    ray = pytest.importorskip("ray")
    from plait.launch.ray_session import short_temp_dir

    control = tmp_path_factory.mktemp("ray") / "kill.json"
    root = str(Path(__file__).resolve().parents[1])  # the workers import tests.launch
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    temp = short_temp_dir()
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # no token file in the home folder
    real = sys.executable
    if not os.environ.get("PLAIT_TEST_FRESH_PYTHON"):
        sys.executable = zygote.start(wait=True)  # Ray's workers: forks of the zygote
    try:
        ray.init(
            num_cpus=4,
            _temp_dir=str(temp),
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={
                "worker_process_setup_hook": "tests.launch.ray_faults.install",
                "env_vars": {"PLAIT_TEST_KILL": str(control), "PYTHONPATH": path},
            },
        )
    finally:
        sys.executable = real
    try:
        yield control
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old
