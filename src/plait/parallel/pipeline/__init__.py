"""Pipeline parallelism: schedules as data, a validator and simulator, a runtime."""

from plait.parallel.pipeline.actions import Action, Op, Schedule

__all__ = ["Action", "Op", "Schedule"]
