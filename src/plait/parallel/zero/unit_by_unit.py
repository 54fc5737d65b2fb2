"""ZeRO-3 without the whole model: each unit gathered, used and freed in turn, no prefetch.

Generation decodes one token at a time; under stage 3 the forward pre-hooks of each
unit's trigger modules gather it and the forward hooks free it again (no gradient flows
in a decode), so a decode through module calls holds one unit at a time. Two things would
break that bound, and :class:`UnitByUnit` removes both for the duration of a block:

* the autograd driver's prefetch starts the *next* unit's gather while one computes
  (two units at once): it is turned off inside the block;
* a decoder that runs a unit's modules through methods of the unit rather than its
  ``forward`` (plait's cached decode calls ``block.attend`` / ``block.feed``, so the
  block's hooks never fire) asks for the unit explicitly: :meth:`UnitByUnit.scope`
  gathers the units a module triggers and frees them when the scope ends.

A unit that stays gathered across its uses (a root unit shared by several modules: tied
embeddings) is freed when the block ends, with every unit that was free when it began;
units already gathered before the block are left as they were. A rank's parameter bytes
inside the block are therefore its shards plus the largest unit (plus a shared root
unit, which is its tied embeddings).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType

from torch import nn

from plait.parallel.zero.driver import AutogradDriver
from plait.parallel.zero.flat import FlatUnit
from plait.parallel.zero.gather import GatherState, ParameterGatherer


class UnitByUnit:
    """Inside ``with UnitByUnit(...)``: stage-3 units are gathered one at a time.

    Args:
        units: the wrapper's flat units.
        gatherer: the wrapper's stage-3 parameter gathers.
        driver: the autograd driver whose prefetch is suspended (None: none installed).
    """

    def __init__(
        self, units: list[FlatUnit], gatherer: ParameterGatherer, driver: AutogradDriver | None
    ) -> None:
        self.gatherer, self.driver = gatherer, driver
        self._by_trigger: dict[int, list[FlatUnit]] = {}
        for u in units:
            for m in u.triggers:
                self._by_trigger.setdefault(id(m), []).append(u)
        self._free_on_entry: list[FlatUnit] = []
        self._prefetch = False

    def __enter__(self) -> UnitByUnit:
        self._free_on_entry = [g.unit for g in self.gatherer.gathers if g.state is GatherState.FREE]
        if self.driver is not None:
            self._prefetch, self.driver.prefetch = self.driver.prefetch, False
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.driver is not None:
            self.driver.prefetch = self._prefetch
        for u in self._free_on_entry:
            self.gatherer.free(u)

    @contextlib.contextmanager
    def scope(self, module: nn.Module) -> Iterator[None]:
        """Hold the units ``module`` triggers (its block's, its experts') inside the
        scope; those it gathered are freed at the end (a module that triggers no unit:
        nothing)."""
        units = self._by_trigger.get(id(module), [])
        fresh = [u for u in units if self.gatherer.gathers[u.index].state is GatherState.FREE]
        for u in units:
            self.gatherer.ensure(u)
        try:
            yield
        finally:
            for u in fresh:
                self.gatherer.free(u)
