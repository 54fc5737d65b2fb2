"""Hardware profiles as TOML files: what ``plait bench calibrate --out`` writes and
``--hardware PATH`` reads back (:func:`dump_hardware`, :func:`load_hardware`).

A profile has a ``[device]`` table (the :class:`~plait.plan.hardware.Hardware` fields:
rate curves as ``[[size, rate], ...]``, the measured grids as ``[[hidden, tokens,
ratio], ...]``) and an ``[intra]`` and ``[inter]`` table each (a
:class:`~plait.plan.hardware.Link`: ``latency_s``, ``bandwidth``, per-collective fits
``op = [alpha, bandwidth]`` and measurements ``op_measured = [ranks, [[bytes, s], ...]]``).
Unknown keys are refused, so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.plan.hardware import (
    COLLECTIVES,
    GRID_FIELDS,
    MEASURED_OPS,
    PRESETS,
    Curve,
    Hardware,
    Link,
    hardware_preset,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["dump_hardware", "load_hardware", "parse_hardware"]


def _curve_toml(c: Curve) -> str:
    return "[" + ", ".join(f"[{s!r}, {r!r}]" for s, r in c.points) + "]"


def _link_toml(section: str, link: Link) -> list[str]:
    lines = [f"[{section}]", f"latency_s = {link.latency_s!r}", f"bandwidth = {link.bandwidth!r}"]
    for op, a, b in link.collectives:
        lines.append(f"{op} = [{a!r}, {b!r}]")
    for op, n, curve in link.measured:
        lines.append(f"{op}_measured = [{n}, {_curve_toml(curve)}]")
    return lines


def dump_hardware(hw: Hardware, comment: str = "") -> str:
    """A TOML document that :func:`load_hardware` reads back to an equal profile."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += [
        "[device]",
        "name = " + _toml_string(hw.name),
        f"memory_bytes = {hw.memory_bytes!r}",
        f"peak_flops = {hw.peak_flops!r}",
        f"matmul = {_curve_toml(hw.matmul)}",
        f"attention = {_curve_toml(hw.attention)}",
        f"elementwise = {_curve_toml(hw.elementwise)}",
        f"optimizer_bandwidth = {hw.optimizer_bandwidth!r}",
        f"op_overhead_s = {hw.op_overhead_s!r}",
        f"comm_overlap = {hw.comm_overlap!r}",
        f"cpu_adam_params_per_s = {hw.cpu_adam_params_per_s!r}",
        f"host_link_bytes_per_s = {hw.host_link_bytes_per_s!r}",
        f"block_overhead_s = {hw.block_overhead_s!r}",
        f"ring_overhead_s = {hw.ring_overhead_s!r}",
        f"pp_action_overhead_s = {hw.pp_action_overhead_s!r}",
        f"pp_action_per_work = {hw.pp_action_per_work!r}",
        *(f"{key} = {_grid_toml(getattr(hw, key))}" for key in GRID_FIELDS),
        f"devices_per_node = {hw.devices_per_node}",
        "source = " + _toml_string(hw.source),
        "",
        *_link_toml("intra", hw.intra),
        "",
        *_link_toml("inter", hw.inter),
    ]
    return "\n".join(lines) + "\n"


def _toml_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _parse_curve(where: str, value: Any) -> Curve:
    if isinstance(value, (int, float)):
        return Curve.constant(float(value))
    try:
        pts = tuple((float(s), float(r)) for s, r in value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where} must be a number or a list of [size, rate] pairs, got {value!r}."
        ) from None
    return Curve(pts)


def _parse_link(where: str, data: Mapping[str, Any]) -> Link:
    extra = []
    measured = []
    for op in MEASURED_OPS:
        if op in data and op in COLLECTIVES:
            a, b = data[op]
            extra.append((op, float(a), float(b)))
        if f"{op}_measured" in data:
            n, pts = data[f"{op}_measured"]
            measured.append((op, int(n), _parse_curve(f"{where}.{op}_measured", pts)))
    known = {"latency_s", "bandwidth", *COLLECTIVES, *(f"{op}_measured" for op in MEASURED_OPS)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"unknown key(s) in [{where}]: {', '.join(sorted(unknown))}.")
    try:
        return Link(
            float(data["latency_s"]), float(data["bandwidth"]), tuple(extra), tuple(measured)
        )
    except KeyError as e:
        raise ConfigError(f"[{where}] needs {e.args[0]}.") from None


def _grid_toml(grid: tuple[tuple[float, float, float], ...]) -> str:
    return "[" + ", ".join(f"[{d!r}, {t!r}, {r!r}]" for d, t, r in grid) + "]"


def _parse_grid(key: str, value: Any) -> tuple[tuple[float, float, float], ...]:
    try:
        return tuple((float(d), float(t), float(r)) for d, t, r in value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"device.{key} must be a list of [hidden, tokens, ratio], got {value!r}."
        ) from None


def parse_hardware(data: Mapping[str, Any], where: str = "profile") -> Hardware:
    """A :class:`Hardware` from the parsed TOML tables of a profile."""
    for section in ("device", "intra", "inter"):
        if section not in data:
            raise ConfigError(f"hardware {where} has no [{section}] table.")
    d = dict(data["device"])
    known = {f for f in Hardware.__dataclass_fields__ if f not in ("intra", "inter")}
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"unknown key(s) in [device] of {where}: {', '.join(sorted(unknown))}.")
    try:
        return Hardware(
            name=str(d["name"]),
            memory_bytes=float(d["memory_bytes"]),
            peak_flops=float(d["peak_flops"]),
            matmul=_parse_curve("device.matmul", d["matmul"]),
            attention=_parse_curve("device.attention", d["attention"]),
            elementwise=_parse_curve("device.elementwise", d["elementwise"]),
            optimizer_bandwidth=float(d["optimizer_bandwidth"]),
            op_overhead_s=float(d.get("op_overhead_s", 0.0)),
            devices_per_node=int(d["devices_per_node"]),
            intra=_parse_link("intra", data["intra"]),
            inter=_parse_link("inter", data["inter"]),
            source=str(d.get("source", "")),
            comm_overlap=float(d.get("comm_overlap", 1.0)),
            cpu_adam_params_per_s=float(d.get("cpu_adam_params_per_s", 0.0)),
            host_link_bytes_per_s=float(d.get("host_link_bytes_per_s", 0.0)),
            block_overhead_s=float(d.get("block_overhead_s", 0.0)),
            ring_overhead_s=float(d.get("ring_overhead_s", 0.0)),
            pp_action_overhead_s=float(d.get("pp_action_overhead_s", 0.0)),
            pp_action_per_work=float(d.get("pp_action_per_work", 0.0)),
            **{key: _parse_grid(key, d.get(key, [])) for key in GRID_FIELDS},
        )
    except KeyError as e:
        raise ConfigError(f"[device] of hardware {where} needs {e.args[0]}.") from None


def load_hardware(spec: str) -> Hardware:
    """A preset name or the path of a TOML profile (``plait bench calibrate --out``)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if spec.endswith(".toml") or path.exists():
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read hardware profile {spec}: {e.strerror}.") from None
        try:
            data = tomllib.loads(raw)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"hardware profile {spec} is not valid TOML: {e}.") from None
        return parse_hardware(data, spec)
    return hardware_preset(spec)
