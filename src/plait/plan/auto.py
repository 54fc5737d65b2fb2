"""``plait train --layout auto``: the planner's search picks the run's layout.

:func:`auto_query` turns a training config, a world size and a device into the same
:class:`~plait.plan.query.Query` that ``plait plan --search`` builds from its flags
(model shape, global batch, sequence, precision, runtime, headroom), so the choice is the
search's top row for the same inputs. :func:`choose_layout` runs the search and returns
that row (the first the runtime accepts, when a ``runnable`` check is given), the config
overrides that make a run use it, and three lines saying what was chosen and why; when
no layout fits it raises a :class:`~plait.errors.ConfigError` (exit code 2) naming the
closest option, the layout that needs the least memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.config import Config, ParallelConfig
from plait.errors import ConfigError
from plait.plan.estimate import Estimate
from plait.plan.evaluate import layout_memory
from plait.plan.explain import COMPONENTS, _differences
from plait.plan.fit import precision_runtime
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout
from plait.plan.modelspec import ModelSpec
from plait.plan.moe import MoESpec
from plait.plan.optimizer import OptimizerSpec
from plait.plan.query import Query
from plait.plan.search import SearchResult, search
from plait.plan.space import Rejections, Space, candidates
from plait.plan.text import gib, seconds

AUTO_TOP = 20
"""Ranked layouts kept by the search: the choice walks them until the runtime accepts
one (the first, unless the runtime refuses it)."""


@dataclass(frozen=True)
class AutoChoice:
    """The layout ``--layout auto`` chose."""

    estimate: Estimate
    """The planner's prediction for it."""
    rank: int
    """Its place in the search's ranking (0: the top row)."""
    overrides: tuple[str, ...]
    """``section.field=value`` settings that make a run use it."""
    lines: tuple[str, str, str]
    """What was chosen, its prediction, and why."""


def auto_query(cfg: Config, world_size: int, hardware: Hardware, headroom: float = 0.05) -> Query:
    """The search query for ``cfg`` on ``world_size`` devices of ``hardware``: the
    precision and runtime as :func:`plait.plan.fit.plan_inputs` maps them."""
    if cfg.model.factory is not None:
        raise ConfigError(
            "--layout auto needs the built-in transformer's shapes; model.factory models "
            "are not planned: give the layout (--dp --tp --pp --cp ...) yourself."
        )
    precision, runtime = precision_runtime(cfg)
    return Query(
        ModelSpec.from_config(cfg.model, "model"),
        hardware,
        world_size,
        cfg.train.global_batch,
        cfg.train.seq_len,
        precision,
        runtime,
        headroom,
        MoESpec.from_config(cfg.model),
        optimizer=OptimizerSpec(cfg.train.optimizer, cfg.optim.muon_ns_steps),
    )


STATED = ("dp", "tp", "pp", "cp", "zero", "sequence_parallel")
"""The ``[parallel]`` settings ``--layout auto`` always writes; the others only where the
layout differs from the default (a dense layout writes no ``ep``)."""


def layout_overrides(layout: Layout) -> tuple[str, ...]:
    """Config settings (``section.field=value``) for a run of ``layout``: its
    :meth:`~plait.plan.layout.Layout.parallel_settings` (the one mapping, read
    backwards; :data:`STATED` and what differs from the default) and its micro-batch,
    recomputation and activation offloading."""
    default = ParallelConfig()
    sets = {
        f"parallel.{k}": v
        for k, v in layout.parallel_settings().items()
        if v is not None and (k in STATED or v != getattr(default, k))
    }
    sets |= {"train.micro_batch": layout.micro_batch, "train.recompute": layout.recompute}
    if layout.activation_offload:
        sets["train.activation_offload"] = True
        sets["train.activation_offload_blocks"] = layout.activation_offload_blocks
    return tuple(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sets.items())


def closest(q: Query, space: Space | None = None) -> tuple[Layout, float] | None:
    """The valid layout that needs the least memory per rank, and that memory."""
    best: tuple[Layout, float] | None = None
    for group in candidates(q, space or Space(), Rejections()):
        for layout in group:
            mem = layout_memory(q, layout).total
            if best is None or mem < best[1]:
                best = (layout, mem)
    return best


def _lines(result: SearchResult, rank: int, skipped: list[str]) -> tuple[str, str, str]:
    e = result.ranked[rank]
    q, t = result.query, e.time
    first = (
        f"--layout auto chose {e.layout.describe()}: the fastest of the layouts that fit "
        f"{q.devices} x {q.hardware.name} (search rank {rank + 1}, {result.evaluated} "
        "evaluated)"
    )
    if skipped:
        first += f"; the runtime refused {'; '.join(skipped)}"
    second = (
        f"predicted {seconds(t.total)} per step, {e.tokens_per_s:,.0f} tokens/s, MFU "
        f"{100 * e.mfu:.1f}%, {gib(e.memory.total)} of {gib(e.usable_bytes)} usable per rank"
    )
    parts = {k: getattr(t, k) for k in COMPONENTS}
    over = sorted(((v, k) for k, v in parts.items() if k != "compute" and v > 0), reverse=True)
    why = f"compute is {100 * t.compute / t.total:.0f}% of the step"
    if over:
        why += f", the largest overhead {COMPONENTS[over[0][1]]} ({seconds(over[0][0])})"
    nxt = result.ranked[rank + 1] if rank + 1 < len(result.ranked) else None
    if nxt is not None:
        diffs = ", ".join(_differences(e, nxt)) or "an equivalent layout"
        why += f"; the runner-up ({diffs}) is {100 * (nxt.time.total / t.total - 1):.1f}% slower"
    else:
        why += "; no other layout fits"
    return first, second, "why: " + why


def choose_layout(
    q: Query,
    runnable: Callable[[Layout], str | None] | None = None,
    space: Space | None = None,
) -> AutoChoice:
    """The search's fastest layout for ``q`` that ``runnable`` accepts (it returns the
    reason it refuses a layout, or None); refuses with the closest option when nothing
    fits."""
    result = search(q, space, top=AUTO_TOP)
    if not result.ranked:
        near = closest(q, space)
        usable = q.hardware.memory_bytes * (1 - q.headroom)
        if near is None:
            raise ConfigError(
                f"--layout auto: no valid layout of the model on {q.devices} x "
                f"{q.hardware.name} ({result.explanation})"
            )
        raise ConfigError(
            f"--layout auto: no layout of the model fits {q.devices} x {q.hardware.name} "
            f"({gib(usable)} usable per rank); the closest option is "
            f"{near[0].describe()} at {gib(near[1])} per rank. Use more ranks, a smaller "
            "model, micro-batch or sequence, or a device with more memory."
        )
    skipped: list[str] = []
    for rank, e in enumerate(result.ranked):
        why = runnable(e.layout) if runnable is not None else None
        if why is None:
            return AutoChoice(e, rank, layout_overrides(e.layout), _lines(result, rank, skipped))
        skipped.append(f"{e.layout.describe()} ({why.rstrip('.')})")
    raise ConfigError(
        f"--layout auto: the runtime runs none of the {len(result.ranked)} fastest layouts "
        f"that fit: {'; '.join(skipped[:3])}. Give the layout yourself."
    )
