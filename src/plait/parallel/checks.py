"""Checks of a run that the parallel layer owns, before any process starts.

:meth:`plait.config.Config.validate` checks what needs no torch (the layout against the
world size, batch arithmetic, ZeRO options, the pipeline's block count). What depends on
the parallel implementation lives with it and runs here, after those: the model (a
factory that imports, transformers for a Hugging Face model, and the parallelisms such a
model cannot take), the tensor-parallel divisibility of heads, key/value heads, the MLP
width and (sequence parallelism) the sequence length; the pipeline schedule (built and
validated as data); and whether the device computes in the requested dtype. Every
failure is one :class:`~plait.errors.ConfigError` paragraph naming the numbers and what
would work.
"""

from __future__ import annotations

from plait.config import Config
from plait.errors import ConfigError
from plait.model.factory import check_model
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.precision import check_device_supports
from plait.parallel.tensor.plan import check_tensor_parallel


def validate_run(cfg: Config, world_size: int) -> None:
    """Every check of ``cfg`` for a world of ``world_size`` ranks (the config's own, then
    the parallel layer's); raises :class:`~plait.errors.ConfigError`."""
    cfg.validate(world_size)
    p, t = cfg.parallel, cfg.train
    check_model(cfg.model)  # the factory imports; transformers is there for hf-llama
    if cfg.model.factory is None and cfg.model.family == "hf-llama":
        check_hf_llama(cfg)
    if p.tp > 1 and cfg.model.factory is None:  # a factory model's plan checks itself
        # heads, KV heads, MLP width (and seq_len with SP) divisible by tp
        check_tensor_parallel(cfg.model, p.tp, p.sequence_parallel, t.seq_len)
    if p.pp > 1:
        m = cfg.pipeline_microbatches(world_size)
        build_schedule(p.pipeline_schedule, p.pp, m, p.chunks)  # its own checks, with numbers
    check_device_supports(cfg.precision.dtype, cfg.launch.device)


def check_hf_llama(cfg: Config) -> None:
    """What a Hugging Face Llama cannot do here: pipeline and context parallelism (their
    split and attention replacement need plait's Transformer) and sequence parallelism
    (its forward sizes positions and mask by the sharded hidden states)."""
    p = cfg.parallel
    refused = [
        (p.pp > 1, f"pipeline parallelism (pp = {p.pp})", "pp = 1"),
        (p.cp > 1, f"context parallelism (cp = {p.cp})", "cp = 1"),
        (
            p.sequence_parallel and p.tp > 1,
            "sequence parallelism",
            "parallel.sequence_parallel = false",
        ),
    ]
    for bad, what, instead in refused:
        if bad:
            raise ConfigError(
                f"{what} is not supported for model.family 'hf-llama' (transformers' "
                f"LlamaForCausalLM): plait splits and rewires only its own Transformer "
                f"that way. Use {instead} (dp, ZeRO 1-3 and tp work), or model.family "
                "'plait'."
            )
