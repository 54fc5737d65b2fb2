"""A zygote for tests: interpreters forked from one that has already imported torch and
plait, in place of fresh ``python`` processes (a few milliseconds instead of seconds).

Every fresh interpreter of a test run (``plait train`` in a subprocess, each rank the
launcher starts, a docs page's python block) spends 2-4 s of CPU importing torch and plait
before it does anything; on a 2-core machine that is most of a CLI test's time. A
:class:`Zygote` is one server process that imports them once (:data:`PRELOAD`, before
any torch operation, so forking is safe), and a *shim*: an executable that behaves as
``python`` (``-m MODULE``, ``-c CODE`` or a script, with ``-u``/``-B``) by asking the server
to fork, see :mod:`plait.testing.zygote_client`. Point ``sys.executable`` (or a command)
at :attr:`Zygote.shim` and every ``[sys.executable, "-m", "plait", ...]``, each rank of
``plait train --nproc N`` and of ``torchrun`` goes through it: the forked interpreter
gets the client's stdin/stdout/stderr, environment, working folder, ``sys.argv`` and
``sys.path``, runs the target as ``__main__`` and reports its exit status (or the signal
that killed it), and its own ``sys.executable`` is the shim, so the processes it starts
come from the zygote too.

What it does not reproduce, so tests of these keep real processes: a fresh interpreter's
``sys.modules`` (import-isolation tests), its memory footprint (memory tests), a rank's
death with its launcher by the kernel's parent-death signal (the client's death kills
the forked interpreter instead), the process tree (ranks are not the launcher's
children), environment variables that the preloaded modules read when imported (such
as ``CXX`` for inductor; ``OMP_NUM_THREADS`` is re-applied), Ray's workers.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

PRELOAD = (
    "torch",
    "numpy",
    "plait",
    "plait.comm",
    "plait.mesh",
    "plait.cli",
    "plait.cli.train",
    "plait.train.trainer",
    "plait.launch.local",
    "plait.launch.worker",
    "torch.distributed.run",
    "torch.distributed.launcher.api",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "plait.plan",
    "plait.checkpoint",
    "plait.parallel.parallelize",
    "safetensors.torch",
    "tokenizers",
    "jinja2",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.tokenization_utils_tokenizers",
    "transformers.utils.chat_template_utils",
)
"""Modules the server imports once: what a ``plait train`` rank and its launcher import,
and the Hugging Face modules that importing or exporting a folder, a tokenizer and a chat
template use (a name that does not import is skipped). The Hugging Face libraries read
environment variables when imported (:data:`IMPORT_ENV`): a client whose values of those
differ from the server's runs the real interpreter instead. Not matplotlib: it reads
``MPLBACKEND``, which the docs tests set."""

SETUP = ("plait.launch.rendezvous_events:speed_up_event_names",)
"""``module:function`` entries the server calls once after its imports, so that every
interpreter it forks has them done: torch's elastic agent (``torchrun`` in a test) names
its rendezvous events without ``inspect.stack`` (the same names, seconds faster)."""

IMPORT_ENV = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_ENDPOINT",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_VERBOSITY",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS",
    "USE_TORCH",
    "USE_TF",
    "USE_FLAX",
    "USE_JAX",
    "XDG_CACHE_HOME",
)
"""The environment variables that the preloaded Hugging Face modules read once, when
imported, and that change what a test's process does: where the hub cache is, whether it
is offline, the log verbosity, which frameworks transformers uses. The server writes its
values to ``import-env.json`` beside its socket; a client compares its own
(:func:`plait.testing.zygote_client.same_import_env`). Variables read when used
(``TOKENIZERS_PARALLELISM``, which plait's prepare sets) or that only tune downloads
(``HF_XET_HIGH_PERFORMANCE``, which importing lm_eval sets) are not listed: a forked
interpreter sees the client's values of those, and listing them sent every later test
to a fresh interpreter."""

CLIENT = Path(__file__).with_name("zygote_client.py")


class Zygote:
    """The server process and its ``python`` shim; :meth:`start` then use :attr:`shim`."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, start_timeout_s: float = 300.0):
        self.preload = preload
        self.start_timeout_s = start_timeout_s
        self.real = sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: str | None = None
        self._ready: int | None = None

    @property
    def shim(self) -> str:
        """The path of the executable that stands in for ``python``."""
        if self._tmp is None:
            raise RuntimeError("the zygote is not started")
        return os.path.join(self._tmp, "python")

    def start(self, wait: bool = True) -> str:
        """Start the server (once) and return :attr:`shim`. With ``wait`` False this does
        not wait for the server's imports: until its socket exists the shim runs the real
        interpreter (the socket appears once the server is ready)."""
        if self._proc is not None and self._proc.poll() is None:
            if wait:
                self._wait()
            return self.shim
        self._tmp = tempfile.mkdtemp(prefix="plait-zygote-")
        sock = os.path.join(self._tmp, "sock")
        with open(self.shim, "w") as f:
            f.write(f'#!/bin/sh\nexec "{self.real}" -S "{CLIENT}" "{sock}" "{self.real}" "$@"\n')
        os.chmod(self.shim, 0o755)
        self._ready, ready_w = os.pipe()
        self._proc = subprocess.Popen(
            [self.real, "-m", "plait.testing.zygote", sock, self.shim, str(ready_w), *self.preload],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(ready_w,),
        )
        os.close(ready_w)
        if wait:
            self._wait()
        return self.shim

    def _wait(self) -> None:
        if self._ready is None:
            return
        ready, _, _ = select.select([self._ready], [], [], self.start_timeout_s)
        ok = bool(ready) and os.read(self._ready, 16) == b"ready"
        os.close(self._ready)
        self._ready = None
        if not ok:
            self.close()
            raise RuntimeError("the zygote did not start")

    def close(self) -> None:
        """Stop the server and remove its folder (interpreters it forked live on)."""
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


# ------------------------------------------------------------------------- the server


def serve(sock: str, shim: str, ready_fd: int, preload: list[str]) -> None:
    """The server's loop: import ``preload``, listen on ``sock``, fork a runner per
    connection; ends when its parent (the test session) does."""
    _die_with_parent(signal.SIGTERM)
    for name in preload:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for entry in SETUP:
        module, _, function = entry.partition(":")
        with contextlib.suppress(ImportError):
            getattr(importlib.import_module(module), function)()
    env = {k: os.environ[k] for k in IMPORT_ENV if k in os.environ}
    with open(os.path.join(os.path.dirname(sock), "import-env.json"), "w") as f:
        json.dump({"names": list(IMPORT_ENV), "values": env}, f)
    own = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p and os.path.abspath(p) not in own]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    listener.listen(128)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with contextlib.suppress(OSError):
        os.write(ready_fd, b"ready")
        os.close(ready_fd)
    listener.settimeout(1.0)
    while True:
        _reap()  # runners are waited for, so their CPU time counts as the session's
        try:
            conn, _ = listener.accept()
        except (InterruptedError, TimeoutError):
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            try:
                _runner(conn, shim, base)
            finally:
                os._exit(0)
        conn.close()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def _die_with_parent(sig: int) -> None:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the client went away")
        data += chunk
    return data


def _runner(conn: socket.socket, shim: str, base: list[str]) -> None:
    """One connection: fork the interpreter, forward signals to it, report its end."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    (size,) = struct.unpack("!I", _recv_exact(conn, 4))
    req = json.loads(_recv_exact(conn, size))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(req, fds, shim, base)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn.fileno(), pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                out = b"s" + bytes([os.WTERMSIG(status)])
            else:
                out = b"x" + bytes([os.waitstatus_to_exitcode(status) & 0xFF])
            with contextlib.suppress(OSError):
                conn.sendall(out)
            return
        data = conn.recv(64)
        if not data:  # the client died: so does its interpreter, with its children
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        for sig in data:
            with contextlib.suppress(OSError):
                if req["group"]:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(req: dict[str, Any], fds: list[int], shim: str, base: list[str]) -> None:
    """The forked interpreter: become the client's process, run the target, exit."""
    code = 1
    interrupted = False
    try:
        os.setpgid(0, 0)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        given = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        extra = [os.path.abspath(p) for p in given if p]
        sys.path[:] = list(dict.fromkeys([req["path0"], *extra, *base]))
        importlib.invalidate_caches()
        sys.executable = shim
        sys.argv = list(req["argv"])
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        unbuffered = req["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(  # type: ignore[union-attr]
                line_buffering=stream.isatty() or stream is sys.stderr, write_through=unbuffered
            )
        code = 0
        if req["kind"] == "module":
            runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
        elif req["kind"] == "path":
            runpy.run_path(req["target"], run_name="__main__")
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(req["target"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as interpreter exit does
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
