"""The client half of :mod:`plait.testing.zygote`: a stand-in ``python`` that asks the
zygote to fork a preloaded interpreter instead of starting a fresh one.

Run as ``python -S zygote_client.py SOCKET [python arguments...]`` (the shim that
:func:`plait.testing.zygote.Zygote.start` writes does that). Standard library only and no
``site``: this file must start in milliseconds and import nothing of plait's.

It understands ``[-u] [-B] (-m MODULE | -c CODE | SCRIPT) ARGS...``; anything else, or a
zygote that does not answer, falls back to exec'ing the real interpreter with the same
arguments, so it is always at least as correct as ``python``; so does a client whose
environment differs from the zygote's in a variable its preloaded modules read when
imported (:func:`same_import_env`). It hands its stdin, stdout
and stderr, its environment and working folder to the zygote, forwards the signals it
gets to the forked interpreter, and exits as that interpreter did (the same exit code, or
killed by the same signal). A client that dies takes its interpreter with it (the zygote
kills the interpreter's process group when the connection closes); a client started by
torch's elastic agent (a rank) also dies with its parent, as a rank does
(``plait.launch.parent``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""Signals the client passes on to its interpreter."""


def parse(args: list[str]) -> dict[str, object] | None:
    """The request for ``python ARGS`` (what to run, ``sys.argv``, ``sys.path[0]``,
    unbuffered output), or None when the zygote cannot stand in for it."""
    unbuffered = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-u":
            unbuffered = True
        elif a == "-B":
            pass
        elif a == "-m" and i + 1 < len(args):
            return {
                "kind": "module",
                "target": args[i + 1],
                "argv": args[i + 1 :],
                "path0": os.getcwd(),
                "unbuffered": unbuffered,
            }
        elif a == "-c" and i + 1 < len(args):
            return {
                "kind": "code",
                "target": args[i + 1],
                "argv": ["-c", *args[i + 2 :]],
                "path0": "",
                "unbuffered": unbuffered,
            }
        elif not a.startswith("-"):
            script = os.path.abspath(a)
            return {
                "kind": "path",
                "target": script,
                "argv": args[i:],
                "path0": os.path.dirname(os.path.realpath(script)),
                "unbuffered": unbuffered,
            }
        else:
            return None
        i += 1
    return None


def _die_with_parent() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getppid()
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def same_import_env(sock_path: str, env: dict[str, str]) -> bool:
    """Whether ``env`` agrees with the server's on every variable its preloaded modules
    read when imported (``import-env.json`` beside the socket; see
    :data:`plait.testing.zygote.IMPORT_ENV`). No such file: nothing to compare."""
    try:
        with open(os.path.join(os.path.dirname(sock_path), "import-env.json")) as f:
            server = json.load(f)
    except (OSError, ValueError):
        return True
    return {k: env[k] for k in server["names"] if k in env} == server["values"]


def _fallback(real: str, args: list[str]) -> None:
    os.execv(real, [real, *args])


def main(argv: list[str]) -> None:
    sock_path, real, args = argv[1], argv[2], argv[3:]
    request = parse(args)
    if (
        request is None
        or not os.path.exists(sock_path)
        or not same_import_env(sock_path, dict(os.environ))
    ):
        _fallback(real, args)
        return
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        _die_with_parent()  # a rank: its launcher's death ends it, as plait's ranks do
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
    except OSError:
        s.close()
        _fallback(real, args)
        return
    request["env"] = dict(os.environ)
    request["cwd"] = os.getcwd()
    request["group"] = os.getpgid(0) == os.getpid()
    payload = json.dumps(request).encode()
    socket.send_fds(s, [b"F"], [0, 1, 2])
    s.sendall(struct.pack("!I", len(payload)) + payload)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            s.sendall(bytes([signum]))

    for sig in FORWARDED:
        signal.signal(sig, forward)
    result = b""
    while len(result) < 2:
        try:
            chunk = s.recv(2 - len(result))
        except InterruptedError:
            continue
        if not chunk:
            os._exit(1)  # the zygote died under us
        result += chunk
    kind, code = result[:1], result[1]
    if kind == b"s":
        if code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(code, signal.SIG_DFL)
        os.kill(os.getpid(), code)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
