"""Rules on the parallel layout: the world, the batch, context and sequence parallelism,
ZeRO's sharding, the pipeline, expert parallelism.

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

from plait.errors import ConfigError


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


def check_batch(global_batch: int, dp: int, micro_batch: int) -> None:
    """The global batch splits into dp replicas of whole micro-batches."""
    if global_batch % (dp * micro_batch):
        good = dp * micro_batch * max(1, global_batch // (dp * micro_batch))
        raise ConfigError(
            f"train.global_batch ({global_batch}) must be divisible by dp x micro_batch "
            f"= {dp} x {micro_batch} = {dp * micro_batch}; for example use global_batch {good}."
        )


def check_cp_sequence(seq_len: int, cp: int, attention: str) -> None:
    """A sequence splits into the cp attention's shards: two per cp rank for ring
    attention (the zigzag load balance), one for Ulysses."""
    if attention == "ring" and seq_len % (2 * cp):
        raise ConfigError(
            f"ring attention holds two chunks of the sequence per cp rank (the zigzag "
            f"load balance): train.seq_len ({seq_len}) must be divisible by 2 x cp = "
            f"{2 * cp}; use e.g. seq_len {2 * cp * max(1, seq_len // (2 * cp))}."
        )
    if attention == "ulysses" and seq_len % cp:
        raise ConfigError(
            f"Ulysses attention splits the sequence into cp = {cp} shards: train.seq_len "
            f"({seq_len}) must be divisible by {cp}; use e.g. seq_len {cp * max(1, seq_len // cp)}."
        )


def check_ulysses_heads(n_heads: int, tp: int, cp: int) -> None:
    """Ulysses attention splits each tp rank's query heads into cp head shards."""
    heads = n_heads // tp if n_heads % tp == 0 else n_heads
    if heads % cp:
        raise ConfigError(
            f"Ulysses attention splits the heads into cp = {cp} shards: {heads} query "
            f"heads{' per tp rank' if tp > 1 else ''} (model.n_heads {n_heads}"
            f"{f' / tp {tp}' if tp > 1 else ''}) are not divisible by {cp}; use "
            "parallel.cp_attention = 'ring' or a cp that divides the heads."
        )


def check_sp_under_cp(seq_len: int, cp: int, tp: int, attention: str) -> None:
    """Sequence parallelism splits each cp shard of the sequence over the tp ranks."""
    if tp > 1 and (seq_len // cp) % tp:
        raise ConfigError(
            f"sequence parallelism splits each cp shard of seq_len / cp = {seq_len // cp} "
            f"tokens over tp = {tp} ranks; train.seq_len must be divisible by cp x tp = "
            f"{cp * tp}{' x 2 (ring)' if attention == 'ring' else ''}."
        )


def check_sequence_parallel(sequence_parallel: bool, tp: int) -> None:
    """A layout that asks for sequence parallelism has a tensor-parallel axis to split
    the sequence over (the planner's layouts; a run's config treats it as no effect at
    tp = 1, see ``parallel.sequence_parallel``)."""
    if sequence_parallel and tp == 1:
        raise ConfigError("sequence parallelism needs tp > 1.")


def check_shard_size(factor: int | None, zero: int, dp: int) -> None:
    """The hybrid sharding factor F (None: dp) of ZeRO divides the data-parallel degree
    ``dp``; stage 0 replicates everything (F = 1)."""
    if factor is None:
        return
    if zero == 0 and factor != 1:
        raise ConfigError(
            f"parallel.zero_shard_size = {factor} needs parallel.zero >= 1 (it is the "
            "hybrid sharding factor of ZeRO); leave it unset for plain data parallelism."
        )
    if factor <= 0 or dp % factor:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ConfigError(
            f"parallel.zero_shard_size (F = {factor}) must divide the data-parallel degree "
            f"dp = {dp}; choose one of {divisors} (1 = plain DP, {dp} = full sharding)."
        )


def check_pp_reshard(pp_reshard: bool, zero: int, pp: int) -> None:
    """Re-gathering per micro-batch is a ZeRO-3 choice under pipeline parallelism."""
    if pp_reshard and (zero != 3 or pp == 1):
        raise ConfigError(
            "parallel.pp_reshard re-gathers ZeRO-3 parameters per micro-batch under "
            "pipeline parallelism; it needs parallel.zero = 3 and parallel.pp > 1 (got "
            f"zero {zero}, pp {pp})."
        )


def check_chunks(schedule: str, chunks: int) -> None:
    """Several model chunks per pipeline rank only with the interleaved schedule."""
    if schedule != "interleaved" and chunks != 1:
        raise ConfigError(
            f"schedule {schedule!r} runs one model chunk per rank, got chunks={chunks}; "
            "use chunks=1, or the 'interleaved' schedule for chunks > 1"
        )


def check_interleaved(stages: int, microbatches: int, chunks: int) -> None:
    """The interleaved schedule: several chunks need two pipeline ranks, and the
    micro-batches per step are a multiple of the stages (as in Megatron-LM)."""
    p, m, v = stages, microbatches, chunks
    if v > 1 and p < 2:
        raise ConfigError(
            f"interleaved schedule with {v} chunks needs at least 2 pipeline ranks, "
            f"got {p}; use chunks=1 with one rank"
        )
    if m % p != 0:
        lo, hi = (m // p) * p, (m // p + 1) * p
        near = f"{lo} or {hi}" if lo > 0 else f"{hi}"
        raise ConfigError(
            f"the interleaved schedule needs the micro-batches per step to be a "
            f"multiple of the pipeline stages (as in Megatron-LM), got {m} "
            f"micro-batches for {p} stages; use {near} micro-batches, or the '1f1b' "
            "schedule"
        )


def check_pipeline(
    n_layers: int,
    pp: int,
    chunks: int,
    schedule: str,
    microbatches: int,
    global_batch: int,
    dp: int,
    micro_batch: int | None,
) -> None:
    """pp > 1: a block per pipeline piece, and the batch split into ``microbatches``
    equal pipeline micro-batches per dp rank (``micro_batch``: the one set, if any)."""
    pieces, m = pp * chunks, microbatches
    if n_layers < pieces:
        raise ConfigError(
            f"the model has {n_layers} transformer blocks (model.n_layers) but pp {pp} x "
            f"chunks {chunks} = {pieces} pipeline pieces need at least one block each; use "
            f"model.n_layers >= {pieces} or fewer stages/chunks."
        )
    if schedule == "interleaved":
        check_interleaved(pp, m, chunks)
    per_rank = global_batch // dp
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    if global_batch % dp or per_rank % m:
        raise ConfigError(
            f"train.global_batch ({global_batch}) must split into dp {dp} x {m} pipeline "
            f"micro-batches (parallel.microbatches) of equal size: {global_batch} / {dp} "
            f"= {global_batch / dp:g} sequences per rank is not divisible by {m}; use a "
            f"global_batch multiple of {dp * m} (e.g. {dp * m * max(1, per_rank // m)}) "
            f"or parallel.microbatches among {divisors}."
        )
    if micro_batch is not None and micro_batch * m != per_rank:
        raise ConfigError(
            f"train.micro_batch ({micro_batch}) x parallel.microbatches ({m}) must equal "
            f"the per-rank batch global_batch / dp = {per_rank}; leave one of them unset."
        )


def check_ep_axis(ep: int, dp: int, cp: int) -> None:
    """The expert-parallel axis: ``ep`` positive and a sub-axis of the dp x cp ranks
    (ep divides dp * cp); the part of :func:`check_expert_parallel` that needs no model."""
    if ep < 1:
        raise ConfigError(f"parallel.ep must be positive, got {ep}.")
    if (dp * cp) % ep:
        ok = [d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]
        raise ConfigError(
            f"parallel.ep ({ep}) must divide the data-parallel ranks dp x cp = {dp * cp} "
            f"(expert parallelism is a sub-axis of them); choose ep among {ok}."
        )


def check_expert_parallel(
    ep: int, dp: int, cp: int, experts: int, compression: str = "none"
) -> None:
    """Expert parallelism over ``ep`` ranks: a sub-axis of the dp x cp ranks (ep divides
    dp * cp), an MoE model whose ``experts`` (routed experts per MoE layer) divide by
    ep, and no gradient compression. ZeRO stages 0-3 (the expert weights in ZeRO units
    of their own over their replica group), 16-bit precision (their fp32 masters there),
    pp and tp compose with it and need no rule."""
    check_ep_axis(ep, dp, cp)
    if ep == 1:
        return
    if experts == 0:
        raise ConfigError(
            f"parallel.ep={ep} needs a mixture-of-experts model: set model.moe_experts "
            "(or, for a model of your own, use plait.model.moe.MoE layers)."
        )
    if experts % ep:
        ok = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(
            f"model.moe_experts ({experts}) is not divisible by parallel.ep ({ep}); "
            f"choose ep among {ok}."
        )
    if compression != "none":
        raise ConfigError(
            f"parallel.compression={compression} is refused with parallel.ep={ep}: expert "
            "gradients are reduced over their own replica groups, which the compressors' "
            "per-bucket state (error feedback, PowerSGD's Q) does not cover."
        )
