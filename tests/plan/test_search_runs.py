"""Every layout ``plait plan --search`` returns is one the runtime runs: turned back into a
config by the settings ``--layout auto`` writes (:func:`plait.plan.auto.layout_overrides`,
the one mapping of :mod:`plait.plan.layout` read backwards), it passes the runtime's own
:func:`plait.parallel.checks.validate_run` and gives the same layout back. Checked over
a search's whole result list: a small dense model on 8 devices (with ZeRO-Offload in the
space) and a mixture-of-experts model, whose search also walks the expert-parallel
degree ep."""

from __future__ import annotations

import pytest

from plait.config import OFFLOADS, Config
from plait.config.toml_io import load_config
from plait.parallel.checks import validate_run
from plait.plan.auto import auto_query, layout_overrides
from plait.plan.hardware import hardware_preset
from plait.plan.layout import Layout
from plait.plan.search import search
from plait.plan.space import Space

WORLD = 8
ALL = 100_000
"""A ``top`` larger than any of these spaces: the search keeps every layout that fits."""

BASE = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.max_seq_len=64", "train.seq_len=64", "train.global_batch=8",
    "launch.device=cpu", "precision.dtype=fp32",
]  # fmt: skip
MOE = ["model.n_layers=4", "model.moe_experts=8", "model.moe_top_k=2", "model.moe_every=2"]
ONE_RC = Space(recompute=("none",))
NARROW = Space(micro_batch=(1,), recompute=("none",))


def _runs(base: list[str], space: Space | None) -> tuple[int, set[int]]:
    cfg = load_config(None, base)
    q = auto_query(cfg, WORLD, hardware_preset("a100-80gb"))
    result = search(q, space, top=ALL)
    assert len(result.ranked) < ALL
    eps = set()
    for e in result.ranked:
        run: Config = load_config(None, [*base, *layout_overrides(e.layout)])
        validate_run(run, WORLD)  # raises ConfigError naming the rule it breaks
        assert Layout.from_config(run, WORLD).describe() == e.layout.describe()
        eps.add(e.layout.ep)
    return len(result.ranked), eps


@pytest.mark.parametrize(
    ("extra", "space", "least"),
    [
        ([], ONE_RC, 200),
        ([], Space(micro_batch=(1,), recompute=("none",), offload=OFFLOADS), 200),
        (MOE, NARROW, 200),
    ],
    ids=["dense", "dense-offload", "moe"],
)
def test_every_searched_layout_passes_validate_run(
    extra: list[str], space: Space | None, least: int
) -> None:
    count, eps = _runs([*BASE, *extra], space)
    assert count >= least, count  # a real space, not a handful
    if extra:
        assert eps == {1, 2, 4, 8}, eps  # the search walked ep
