"""plait.testing.zygote: its shim behaves as ``python`` for what the suite runs with it.

With the session's zygote: ``-c``, ``-m`` and a script get
their arguments, stdio, environment, working folder and ``sys.path[0]`` as a fresh
interpreter would; exit codes and deaths by signal come back to the caller; a signal to
the client reaches the interpreter; a killed client takes its interpreter with it;
unknown interpreter flags, and a client whose environment differs in a variable the
preloaded modules read when imported, fall back to the real interpreter.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
from pathlib import Path

import pytest

from plait.testing.zygote import Zygote


@pytest.fixture(scope="module")
def shim(zygote: Zygote) -> str:
    """The session's zygote (tests/conftest.py), waited for."""
    return zygote.start()


def _run(shim: str, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([shim, *args], capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]


def test_code_gets_argv_env_cwd_and_stdio_and_its_exit_code(shim: str, tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "print(sys.argv, os.getcwd(), os.environ['ZYG_TEST'], 'torch' in sys.modules)\n"
        "print(sys.stdin.read().upper(), file=sys.stderr)\n"
        "print(sys.executable == os.environ['ZYG_SHIM'])\n"
        "sys.exit(3)\n"
    )
    env = dict(os.environ, ZYG_TEST="seen", ZYG_SHIM=shim)
    r = _run(shim, "-c", code, "a", "b", cwd=tmp_path, env=env, input="from stdin")
    assert r.returncode == 3, r.stderr
    lines = r.stdout.splitlines()
    # forked from the preloaded interpreter: torch is there already
    assert lines[0] == f"['-c', 'a', 'b'] {tmp_path} seen True"
    assert lines[1] == "True"  # what it starts goes through the zygote too
    assert r.stderr.strip() == "FROM STDIN"


def test_module_and_script_see_their_own_folder_first(shim: str, tmp_path: Path) -> None:
    (tmp_path / "pkg_here").mkdir()
    (tmp_path / "pkg_here" / "__init__.py").write_text("")
    (tmp_path / "pkg_here" / "__main__.py").write_text(
        "import sys\nprint('module', sys.argv[1:])\n"
    )
    r = _run(shim, "-u", "-m", "pkg_here", "x", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (0, "module ['x']\n"), r.stderr
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "helper.py").write_text("VALUE = 7\n")
    (sub / "main.py").write_text(
        "import sys\nimport helper\nprint(__name__, helper.VALUE, sys.argv)\n"
        "raise ValueError('boom')\n"
    )
    r = _run(shim, str(sub / "main.py"), "y", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stdout == f"__main__ 7 ['{sub / 'main.py'}', 'y']\n"
    assert r.stderr.rstrip().endswith("ValueError: boom")


def test_deaths_by_signal_and_forwarded_signals(shim: str) -> None:
    r = _run(shim, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert r.returncode == -signal.SIGTERM
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([shim, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 7  # the interpreter's handler ran


def test_a_killed_client_takes_its_interpreter_along(shim: str) -> None:
    code = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n"
    p = subprocess.Popen([shim, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    assert pid != p.pid
    fd = os.pidfd_open(pid)
    try:
        p.kill()
        p.wait(timeout=30)
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, f"interpreter {pid} outlived its killed client"
    finally:
        os.close(fd)


def test_unknown_flags_run_the_real_interpreter(shim: str) -> None:
    r = _run(shim, "-X", "utf8", "-c", "import sys; print('torch' in sys.modules)")
    assert (r.returncode, r.stdout) == (0, "False\n"), r.stderr


def test_a_client_whose_import_time_environment_differs_runs_the_real_interpreter(
    shim: str,
) -> None:
    code = "import sys; print('transformers' in sys.modules)"
    same = _run(shim, "-c", code)
    assert (same.returncode, same.stdout) == (0, "True\n"), same.stderr  # preloaded
    env = dict(os.environ, HF_HUB_OFFLINE="1" if os.environ.get("HF_HUB_OFFLINE") != "1" else "0")
    other = _run(shim, "-c", code, env=env)  # read by huggingface_hub when imported
    assert (other.returncode, other.stdout) == (0, "False\n"), other.stderr
