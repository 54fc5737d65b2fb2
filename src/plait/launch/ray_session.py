"""Connecting to Ray: import it or say how to install it, join or start an instance.

``launch.ray_address`` unset starts a private local Ray instance for the run; its
temporary files (sockets, logs, the object store's spill folder) go under
``/tmp/plait-ray-<8 hex>`` — short on purpose: Ray puts Unix sockets in that folder and a
socket path may not exceed ~107 bytes, which a folder inside a deep run directory
would. The folder is removed after a successful run and kept (and named) after a failed
one, for its logs. ``auto`` joins the Ray cluster running on this machine, ``HOST:PORT``
a cluster's head; a head that does not answer within :data:`CONNECT_TIMEOUT_S` is
reported in one line instead of a long hang. When Ray is already initialised in this
process (a notebook, a test, a Ray job), that session is used and left running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from plait.errors import ConfigError

INSTALL_HINT = "pip install 'plait[ray]'"
"""How to install the optional Ray extra."""
CONNECT_TIMEOUT_S = 5.0
"""Seconds a ``HOST:PORT`` head has to accept a connection."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"launch.backend = 'ray' needs Ray, which is not installed: {INSTALL_HINT}"
        ) from None
    return ray


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"launch.ray_address must be 'auto' or HOST:PORT (a Ray head), got {address!r}."
        )
    return host.strip("[]"), int(port)


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse a ``HOST:PORT`` Ray head that does not accept a TCP connection in time."""
    if address == "auto":
        return
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(
            f"launch.ray_address {address}: no Ray head answers there ({e.strerror or e}); "
            "start one with `ray start --head` or give its HOST:PORT."
        ) from None


def short_temp_dir() -> Path:
    """A new folder name ``/tmp/plait-ray-<8 hex>`` (short: Ray's socket paths live in it)."""
    base = Path("/tmp") if Path("/tmp").is_dir() else Path(os.path.expanduser("~"))
    return base / f"plait-ray-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def ray_session(address: str | None, cpus: int) -> Iterator[ModuleType]:
    """Ray, initialised for the block: the session already open in this process, the
    cluster at ``address``, or a private local instance with at least ``cpus`` CPUs.
    Shuts down what it started."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    temp: Path | None = None
    kwargs: dict[str, object] = {
        "log_to_driver": True,
        "logging_level": logging.WARNING,
        # a job logging config makes the driver print the ranks' lines without Ray's
        # "(actor pid=...)" prefix, so they look as under --nproc
        "logging_config": ray.LoggingConfig(encoding="TEXT", log_level="WARNING"),
    }
    if address is None:
        temp = short_temp_dir()
        kwargs.update(
            num_cpus=max(cpus, os.cpu_count() or 1),
            _temp_dir=str(temp),
            include_dashboard=False,
        )
    else:
        check_address(address)
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"launch.ray_address {address}: cannot join Ray: {first}") from None
    ok = False
    try:
        yield ray
        ok = True
    finally:
        ray.shutdown()
        if temp is not None:
            if ok:
                shutil.rmtree(temp, ignore_errors=True)
            else:
                logging.getLogger("plait").warning("plait: Ray's logs are in %s", temp)
