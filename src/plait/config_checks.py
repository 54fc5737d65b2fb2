"""Checks that need several config sections at once (``Config.validate`` runs them).

Each section validates its own fields in ``__post_init__`` (:mod:`plait.config`); what
is here compares sections with each other and with the world size: the layout's product,
ZeRO/offload, the pipeline's blocks and micro-batches, and the global batch. Every
failure is one :class:`ConfigError` paragraph naming the numbers and what would work; all
of it runs before any process starts and needs no torch. The checks owned by the layers
above (tensor-parallel divisibility, the pipeline schedule, the device's dtypes) are in
:func:`plait.parallel.checks.validate_run`, which runs these first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.config import Config


def check_world(
    dp: int | None, tp: int, pp: int, cp: int, world_size: int, *, devices: bool = False
) -> int:
    """The one check that a layout's degrees multiply to the world size; returns dp.

    ``dp=None`` means "the rest": ``world_size / (tp·pp·cp)``, which must then be whole.
    The config (:meth:`plait.config.Config.validate`), :func:`plait.mesh.init_mesh` and
    the planner all use it; ``devices=True`` words the messages for the planner, which
    counts the devices asked for rather than processes started. Raises
    :class:`ConfigError` naming the numbers.
    """
    world = f"the {world_size} devices" if devices else f"the world size {world_size}"
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if degree is not None and degree < 1:
            raise ConfigError(f"the {name} degree must be >= 1, got {name}={degree}.")
    other = tp * pp * cp
    if dp is None:
        if world_size % other:
            raise ConfigError(
                f"tp={tp} x pp={pp} x cp={cp} = {other} does not divide {world}; choose "
                f"degrees whose product divides {world_size}."
            )
        dp = world_size // other
    product = dp * other
    if product != world_size:
        instead = f"ask for {product} devices" if devices else f"start {product} processes"
        raise ConfigError(
            f"the layout dp={dp} x tp={tp} x pp={pp} x cp={cp} = {product} ranks "
            f"does not match {world}; choose degrees whose product is {world_size} "
            f"(or {instead})."
        )
    return dp


def check_run(cfg: Config, world_size: int) -> None:
    """Check ``cfg``'s sections against each other for a world of ``world_size`` ranks.

    Raises :class:`ConfigError` with one paragraph saying what is wrong and what
    would work. Runs before any process starts.
    """
    p, t = cfg.parallel, cfg.train
    dp = p.resolved_dp(world_size)
    check_world(dp, p.tp, p.pp, p.cp, world_size)
    if p.cp > 1:
        check_context(cfg)
    if p.pp > 1:
        check_pipeline(cfg, dp)
    check_zero(cfg, dp * p.cp)  # ZeRO shards over dp x cp (replicas of the parameters)
    check_compression(cfg)
    micro = cfg.micro_batch(world_size)
    if t.global_batch % (dp * micro):
        raise ConfigError(
            f"train.global_batch ({t.global_batch}) must be divisible by dp x micro_batch "
            f"= {dp} x {micro} = {dp * micro}; for example use global_batch "
            f"{dp * micro * max(1, t.global_batch // (dp * micro))}."
        )
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len "
            f"({cfg.model.max_seq_len}); raise model.max_seq_len or shorten train.seq_len."
        )
    if cfg.data.tokenizer == "byte" and cfg.model.vocab_size < 256:
        raise ConfigError(
            f"the byte tokenizer needs model.vocab_size >= 256, got {cfg.model.vocab_size}."
        )


def check_context(cfg: Config) -> None:
    """cp > 1: the sequence splits into the cp attention's shards, and (Ulysses) the
    heads into cp head shards."""
    p, m, seq = cfg.parallel, cfg.model, cfg.train.seq_len
    cp, tp = p.cp, p.tp
    if p.cp_attention == "ring" and seq % (2 * cp):
        raise ConfigError(
            f"ring attention holds two chunks of the sequence per cp rank (the zigzag "
            f"load balance): train.seq_len ({seq}) must be divisible by 2 x cp = {2 * cp}; "
            f"use e.g. seq_len {2 * cp * max(1, seq // (2 * cp))}."
        )
    if p.cp_attention == "ulysses":
        if seq % cp:
            raise ConfigError(
                f"Ulysses attention splits the sequence into cp = {cp} shards: "
                f"train.seq_len ({seq}) must be divisible by {cp}; use e.g. seq_len "
                f"{cp * max(1, seq // cp)}."
            )
        heads = m.n_heads // tp if m.n_heads % tp == 0 else m.n_heads
        if heads % cp:
            raise ConfigError(
                f"Ulysses attention splits the heads into cp = {cp} shards: {heads} query "
                f"heads{' per tp rank' if tp > 1 else ''} (model.n_heads {m.n_heads}"
                f"{f' / tp {tp}' if tp > 1 else ''}) are not divisible by {cp}; use "
                "parallel.cp_attention = 'ring' or a cp that divides the heads."
            )
    if p.sequence_parallel and tp > 1 and (seq // cp) % tp:
        raise ConfigError(
            f"sequence parallelism splits each cp shard of seq_len / cp = {seq // cp} "
            f"tokens over tp = {tp} ranks; train.seq_len must be divisible by cp x tp = "
            f"{cp * tp}{' x 2 (ring)' if p.cp_attention == 'ring' else ''}."
        )


def check_compression(cfg: Config) -> None:
    """Gradient compression needs plain data parallelism: the ZeRO wrapper (stages 1-3,
    and stage 0 under mixed precision) reduce-scatters flat shards to their owners, which
    a top-k or low-rank message cannot feed."""
    p = cfg.parallel
    if p.compression == "none":
        return
    if p.zero > 0:
        raise ConfigError(
            f"parallel.compression = {p.compression!r} works with plain data parallelism "
            f"only, not with parallel.zero = {p.zero}: ZeRO reduce-scatters each gradient "
            "shard to its owner, which a compressed all-reduce cannot feed. Use "
            "parallel.zero = 0, or parallel.compression = 'none'."
        )
    if cfg.precision.dtype != "fp32" or cfg.precision.reduce_dtype not in ("auto", "fp32"):
        raise ConfigError(
            f"parallel.compression = {p.compression!r} needs fp32 parameters and reduction "
            f"(precision.dtype = {cfg.precision.dtype!r}, reduce_dtype = "
            f"{cfg.precision.reduce_dtype!r}): mixed precision reduces through the ZeRO "
            "wrapper. For half-precision gradients on the wire use parallel.compression = "
            "'bf16' with precision.dtype = 'fp32'."
        )


def check_zero(cfg: Config, dp: int) -> None:
    """ZeRO and offload checks (whether the device computes in the dtype is checked by
    :func:`plait.parallel.checks.validate_run`, which needs torch)."""
    p = cfg.parallel
    f = p.zero_shard_size
    if f is not None:
        if p.zero == 0 and f != 1:
            raise ConfigError(
                f"parallel.zero_shard_size = {f} needs parallel.zero >= 1 (it is the "
                "hybrid sharding factor of ZeRO); leave it unset for plain data parallelism."
            )
        if dp % f:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ConfigError(
                f"parallel.zero_shard_size (F = {f}) must divide the data-parallel degree "
                f"dp = {dp}; choose one of {divisors} (1 = plain DP, {dp} = full sharding)."
            )
    if p.offload != "none" and p.zero == 0:
        raise ConfigError(
            f"parallel.offload = {p.offload!r} needs ZeRO (parallel.zero >= 1): the "
            "offloaded optimizer steps on the shards the ZeRO wrapper owns. Set "
            "parallel.zero = 1, 2 or 3, or parallel.offload = 'none'."
        )
    if p.offload == "params" and p.zero != 3:
        raise ConfigError(
            f"parallel.offload = 'params' needs parallel.zero = 3 (got {p.zero}): only "
            "ZeRO-3 shards the parameters; use parallel.offload = 'optimizer' with "
            "stages 1 and 2."
        )


def check_pipeline(cfg: Config, dp: int) -> None:
    """pp > 1: blocks per piece, micro-batches, schedule and ZeRO stage."""
    p, t = cfg.parallel, cfg.train
    pieces = p.pp * p.chunks
    if cfg.model.n_layers < pieces:
        raise ConfigError(
            f"the model has {cfg.model.n_layers} transformer blocks (model.n_layers) but "
            f"pp {p.pp} x chunks {p.chunks} = {pieces} pipeline pieces need at least one "
            f"block each; use model.n_layers >= {pieces} or fewer stages/chunks."
        )
    m = cfg.pipeline_microbatches(dp * p.tp * p.pp * p.cp)
    if p.pipeline_schedule == "interleaved" and m < p.pp:
        raise ConfigError(
            f"the interleaved schedule needs at least as many micro-batches as pipeline "
            f"stages: {m} micro-batches (parallel.microbatches) < pp {p.pp}; use a multiple "
            f"of {p.pp} such as {p.pp} or {2 * p.pp}."
        )
    per_rank = t.global_batch // dp
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    if t.global_batch % dp or per_rank % m:
        raise ConfigError(
            f"train.global_batch ({t.global_batch}) must split into dp {dp} x {m} pipeline "
            f"micro-batches (parallel.microbatches) of equal size: {t.global_batch} / {dp} "
            f"= {t.global_batch / dp:g} sequences per rank is not divisible by {m}; use a "
            f"global_batch multiple of {dp * m} (e.g. {dp * m * max(1, per_rank // m)}) "
            f"or parallel.microbatches among {divisors}."
        )
    if t.micro_batch is not None and t.micro_batch * m != per_rank:
        raise ConfigError(
            f"train.micro_batch ({t.micro_batch}) x parallel.microbatches ({m}) must equal "
            f"the per-rank batch global_batch / dp = {per_rank}; leave one of them unset."
        )
