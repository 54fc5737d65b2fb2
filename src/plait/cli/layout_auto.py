"""``plait train --layout auto [--hardware PROFILE]``: the layout from the planner's search.

:func:`resolve_auto_layout` is the hook ``plait train`` calls: it searches with
:func:`plait.plan.auto.choose_layout` for the run's world size, device (a calibrated
profile from ``plait bench calibrate`` when ``--hardware`` names one, else the device
the run will use, as the memory check sees it) and model, keeps the fastest layout the
runtime accepts (:func:`plait.parallel.checks.validate_run`), prints the choice in three
lines and returns the config overrides and the argument list the local ranks are started
with (``--layout auto`` replaced by the chosen settings, so that they do not search
again). Nothing fits: a :class:`~plait.errors.ConfigError` naming the closest option.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from plait.errors import ConfigError

LAYOUT_KEYS = (
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.zero",
    "parallel.zero_shard_size", "parallel.sequence_parallel", "parallel.pipeline_schedule",
    "parallel.chunks", "parallel.microbatches", "train.micro_batch", "train.recompute",
    "parallel.ep",
)  # fmt: skip
"""Settings ``--layout auto`` chooses (and so refuses to be given as well)."""


def _drop_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` without ``--flag value`` / ``--flag=value`` for each of ``flags``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def resolve_auto_layout(
    build: Callable[[list[str]], Any],
    cfg: Any,
    world: int,
    hardware: str | None,
    overrides: Sequence[str],
    argv: Sequence[str],
    ranks_per_host: int,
    cuda: tuple[str, float] | None,
    say: bool = True,
) -> tuple[list[str], list[str]]:
    """(the chosen ``section.field=value`` settings, the ranks' argument list);
    ``build(settings)`` is the run's config with ``settings`` added to its overrides."""
    from plait.parallel.checks import validate_run
    from plait.plan.auto import auto_query, choose_layout, layout_overrides
    from plait.plan.fit import device_hardware
    from plait.plan.layout import Layout
    from plait.plan.profile_toml import load_hardware

    given = [o.split("=", 1)[0] for o in overrides]
    clash = [k for k in given if k in LAYOUT_KEYS]
    if clash:
        raise ConfigError(
            f"--layout auto chooses {', '.join(sorted(set(clash)))} itself; drop "
            f"{'it' if len(set(clash)) == 1 else 'them'} or drop --layout auto."
        )
    if hardware is not None:
        hw = load_hardware(hardware)
    else:
        hw = device_hardware(cfg.launch.device, ranks_per_host, cuda)
    q = auto_query(cfg, world, hw)

    def runnable(layout: Layout) -> str | None:
        try:
            c = build(list(layout_overrides(layout)))
            validate_run(c, world)
            got = Layout.from_config(c, world)
        except ConfigError as e:
            return str(e).split(". ")[0]
        if got.describe() != layout.describe():  # the settings must give exactly it
            return f"its settings give {got.describe()}"
        return None

    choice = choose_layout(q, runnable)
    if say:
        for line in choice.lines:
            print(f"plait: {line}", flush=True)
    sets = list(choice.overrides)
    rest = _drop_flags(argv, ("--layout", "--hardware"))
    return sets, [*rest, *(f"--{s}" for s in sets)]
