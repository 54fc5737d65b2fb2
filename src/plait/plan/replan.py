"""Replanning an elastic run for the ranks that are left (no torch).

When ranks are lost for good the job goes on with fewer, and stays the same run: the
global batch, the data order (a function of seed and step, not of the data-parallel
degree) and the optimizer's hyper-parameters do not change; only the layout does. The
new world is the largest number of ranks, at most the survivors and at least
``launch.min_ranks``, for which an allowed layout's data-parallel degree divides the
global batch; the per-rank micro-batch stays the same where it divides the new per-rank
batch (else the largest one below it that does) and gradient accumulation makes up the
rest. One rank of dp4 lost: global batch 12 (micro 3) goes on as dp3 (4 sequences per
rank: micro 2, accumulation 2); global batch 16 (micro 4) as dp2 (16 is not divisible by
3; 8 per rank: micro 4, accumulation 2).

The allowed layouts are ``launch.layouts`` (a list of names such as ``tp2xdp2``), or
without one the starting layout's tp, pp and cp with any dp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.config.rules.elastic import layout_name, parse_layout_name
from plait.errors import ConfigError


@dataclass(frozen=True)
class Replan:
    """The layout an elastic run takes on ``world`` ranks."""

    world: int
    degrees: dict[str, int]
    """dp, tp, pp, cp."""
    micro_batch: int
    """Sequences per rank per micro-step."""
    accumulation: int
    """Micro-steps per optimizer step (global batch = dp · micro_batch · accumulation)."""

    @property
    def name(self) -> str:
        """``tp2xdp2``."""
        return layout_name(self.degrees)

    def overrides(self) -> list[str]:
        """The ``section.field=value`` settings of this layout."""
        d = self.degrees
        return [
            f"launch.nproc={self.world}",
            *(f"parallel.{a}={d[a]}" for a in ("dp", "tp", "pp", "cp")),
            f"train.micro_batch={self.micro_batch}",
        ]


def allowed_layouts(
    policy: Sequence[str], start: dict[str, int], world: int
) -> list[dict[str, int]]:
    """The allowed layouts of ``world`` ranks: those of ``policy`` (layout names) of that
    size, or with no policy the ``start`` layout's tp, pp and cp with dp = the rest."""
    if policy:
        out = [parse_layout_name(n) for n in policy]
        return [d for d in out if d["dp"] * d["tp"] * d["pp"] * d["cp"] == world]
    model = start.get("tp", 1) * start.get("pp", 1) * start.get("cp", 1)
    if world % model:
        return []
    return [{"dp": world // model, **{a: start.get(a, 1) for a in ("tp", "pp", "cp")}}]


def micro_for(per_rank: int, micro: int) -> int:
    """The largest micro-batch <= ``micro`` that divides ``per_rank`` sequences."""
    return max(m for m in range(1, min(micro, per_rank) + 1) if per_rank % m == 0)


def fit(global_batch: int, world: int, layouts: list[dict[str, int]], micro: int) -> Replan | None:
    """The first of ``layouts`` whose dp divides ``global_batch``, as a :class:`Replan`."""
    for d in layouts:
        if global_batch % d["dp"] == 0:
            per_rank = global_batch // d["dp"]
            m = micro_for(per_rank, micro)
            return Replan(world, dict(d), m, per_rank // m)
    return None


def replan(
    global_batch: int,
    survivors: int,
    min_ranks: int,
    start: dict[str, int],
    micro_batch: int,
    policy: Sequence[str] = (),
) -> Replan:
    """The largest world in ``[min_ranks, survivors]`` with an allowed layout that divides
    ``global_batch``; ``micro_batch`` is the per-rank micro-batch before the loss. A
    :class:`ConfigError` names what would work when none does."""
    if survivors < min_ranks:
        raise ConfigError(
            f"only {survivors} rank(s) survive, fewer than launch.min_ranks = {min_ranks}."
        )
    for world in range(survivors, min_ranks - 1, -1):
        got = fit(global_batch, world, allowed_layouts(policy, start, world), micro_batch)
        if got is not None:
            return got
    raise ConfigError(no_layout_message(global_batch, survivors, min_ranks, start, policy))


def no_layout_message(
    global_batch: int, survivors: int, min_ranks: int, start: dict[str, int], policy: Sequence[str]
) -> str:
    """Why no world in ``[min_ranks, survivors]`` works, and which worlds would."""
    top = max(survivors, min_ranks)
    would = [
        f"{w} ranks ({fitted.name})"
        for w in range(1, top + 8)
        if (fitted := fit(global_batch, w, allowed_layouts(policy, start, w), 1)) is not None
    ]
    allowed = ", ".join(policy) if policy else f"{layout_name({**start, 'dp': 1})} with any dp"
    span = f"{survivors}" if survivors == min_ranks else f"{min_ranks}..{survivors}"
    hint = f"would work: {', '.join(would[:4])}" if would else "no world up to that works"
    return (
        f"no allowed layout ({allowed}) for {span} ranks divides train.global_batch "
        f"{global_batch}; {hint} (lower launch.min_ranks, add layouts to launch.layouts "
        "or change the global batch)."
    )


def check_elastic(
    global_batch: int,
    min_ranks: int,
    start: dict[str, int],
    micro_batch: int,
    policy: Sequence[str],
) -> None:
    """Before any rank starts: the job can run on ``min_ranks`` (an allowed layout of
    that size divides the global batch)."""
    if fit(global_batch, min_ranks, allowed_layouts(policy, start, min_ranks), micro_batch) is None:
        raise ConfigError(
            "launch.min_ranks: "
            + no_layout_message(global_batch, min_ranks, min_ranks, start, policy)
        )
