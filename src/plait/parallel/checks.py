"""Checks of a run that the parallel layer owns, before any process starts.

:meth:`plait.config.Config.validate` checks what needs no torch (the layout against the
world size, batch arithmetic, ZeRO options, the pipeline's block count). What depends on
the parallel implementation lives with it and runs here, after those: the tensor-parallel
divisibility of heads, key/value heads, the MLP width and (sequence parallelism) the
sequence length; the pipeline schedule (built and validated as data); and whether the
device computes in the requested dtype. Every failure is one
:class:`~plait.errors.ConfigError` paragraph naming the numbers and what would work.
"""

from __future__ import annotations

from plait.config import Config
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.precision import check_device_supports
from plait.parallel.tensor.plan import check_tensor_parallel


def validate_run(cfg: Config, world_size: int) -> None:
    """Every check of ``cfg`` for a world of ``world_size`` ranks (the config's own, then
    the parallel layer's); raises :class:`~plait.errors.ConfigError`."""
    cfg.validate(world_size)
    p, t = cfg.parallel, cfg.train
    if p.tp > 1:  # heads, KV heads, MLP width (and seq_len with SP) divisible by tp
        check_tensor_parallel(cfg.model, p.tp, p.sequence_parallel, t.seq_len)
    if p.pp > 1:
        m = cfg.pipeline_microbatches(world_size)
        build_schedule(p.pipeline_schedule, p.pp, m, p.chunks)  # its own checks, with numbers
    check_device_supports(cfg.precision.dtype, cfg.launch.device)
