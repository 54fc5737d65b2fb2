"""Checks of a run's configuration that belong to the parallel layer (placeholder until
the config-layer split lands: it runs :meth:`plait.config.Config.validate`)."""

from __future__ import annotations

from plait.config import Config


def validate_run(cfg: Config, world_size: int) -> None:
    """Every check of ``cfg`` for a world of ``world_size`` ranks, before any work."""
    cfg.validate(world_size)
