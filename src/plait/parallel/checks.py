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

A run's configuration is validated once per process: :func:`validate_run` marks the
config it passed with the world size and every value, and does nothing for a config so
marked. So the trainer's own call is free after ``plait train`` validated the config in
the same process, and a Ray rank that received the driver's validated config (pickled:
the mark travels with it) checks nothing again; a changed value voids the mark.
:func:`carry_validation` passes the mark on to a copy that differs only in what no check
reads (the paths a Ray driver makes absolute, the resume of a restarted attempt).
"""

from __future__ import annotations

import dataclasses

from plait.arch.families import family_named
from plait.config import Config
from plait.config.choices import HF_FAMILIES
from plait.errors import ConfigError
from plait.model.factory import check_model
from plait.parallel.compile import check_compile
from plait.parallel.float8 import check_float8
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.precision import check_device_supports
from plait.parallel.tensor.sharding_plan import check_tensor_parallel

_MARK = "_plait_validated_for"
"""The attribute of a config :func:`validate_run` passed: (world size, its values)."""


_GEMMA_TP = (
    "its post-attention and pre-/post-feed-forward norms are not in the tensor-parallel "
    "plan of transformers' class (Llama's)"
)


def validate_run(cfg: Config, world_size: int) -> None:
    """Every check of ``cfg`` for a world of ``world_size`` ranks (the config's own, then
    the parallel layer's); raises :class:`~plait.errors.ConfigError`. Nothing is checked
    again for a config already validated for this world and unchanged since
    (:func:`is_validated`)."""
    if is_validated(cfg, world_size):
        return
    cfg.validate(world_size)
    p, t = cfg.parallel, cfg.train
    check_model(cfg.model)  # the factory imports; transformers is there for hf-llama
    if cfg.model.factory is None and cfg.model.family in HF_FAMILIES:
        check_hf_llama(cfg)
    if p.tp > 1 and cfg.model.factory is None:  # a factory model's plan checks itself
        # heads, KV heads, MLP width (and seq_len with SP) divisible by tp
        check_tensor_parallel(cfg.model, p.tp, p.sequence_parallel, t.seq_len)
    if p.pp > 1:
        m = cfg.pipeline_microbatches(world_size)
        build_schedule(p.pipeline_schedule, p.pp, m, p.chunks)  # its own checks, with numbers
    check_device_supports(cfg.precision.dtype, cfg.launch.device)
    check_float8(cfg.precision.float8, cfg.launch.device)
    check_compile(cfg.train.compile, cfg.launch.device)
    setattr(cfg, _MARK, (world_size, dataclasses.astuple(cfg)))


def is_validated(cfg: Config, world_size: int) -> bool:
    """Whether :func:`validate_run` passed ``cfg`` (or the config it was pickled or
    copied from) for ``world_size`` ranks, and no value changed since."""
    return getattr(cfg, _MARK, None) == (world_size, dataclasses.astuple(cfg))


def carry_validation(validated: Config, derived: Config) -> Config:
    """``derived`` (returned), marked as validated when ``validated`` is, for the same
    world: for a copy that differs only in values no check reads (the paths a Ray
    driver makes absolute, ``train.resume`` of a restarted attempt)."""
    mark = getattr(validated, _MARK, None)
    if mark is not None and is_validated(validated, mark[0]):
        setattr(derived, _MARK, (mark[0], dataclasses.astuple(derived)))
    return derived


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
    arch = cfg.model.arch
    cls = family_named(arch).architecture
    tp_refused = {
        "phi3": "its fused qkv_proj and gate_up_proj are split only by the built-in transformer",
        "olmo2": "its q/k norms over the whole projection need the built-in transformer's "
        "all-reduce of the sums of squares",
        "gemma2": _GEMMA_TP,
        "gemma3": _GEMMA_TP,
    }
    if family_named(arch).experts is not None:
        raise ConfigError(
            f"model.family '{cfg.model.family}' with model.arch {arch}: transformers' {cls} "
            "is not wired for plait's mixtures of experts (its fused experts, expert "
            "parallelism). Use model.family 'plait' (every parallelism, --ep)."
        )
    if p.tp > 1 and arch in tp_refused:
        raise ConfigError(
            f"tensor parallelism is not supported for model.family '{cfg.model.family}' with "
            f"model.arch {arch}: {tp_refused[arch]}. Use model.family 'plait' (every "
            "parallelism) or tp = 1."
        )
    for bad, what, instead in refused:
        if bad:
            raise ConfigError(
                f"{what} is not supported for model.family '{cfg.model.family}' "
                f"(transformers' {cls}): plait splits and rewires only its own Transformer "
                f"that way. Use {instead} (dp, ZeRO 1-3 and tp work), or model.family "
                "'plait'."
            )
