"""Every rule of a run's configuration, once, as small functions on plain values.

Each function takes ints, strings and tuples (never a config object: this module
imports nothing of :mod:`plait.config`, which calls it) and raises one
:class:`ConfigError` paragraph naming the numbers and what would work, in one wording
wherever the rule applies: the config's sections and :meth:`plait.config.Config.validate`
call these, and so do the constructors that need the same rule (the mesh, the planner's
layout, ``parallelize``, the ZeRO wrapper, context parallelism). None needs torch. The
checks owned by the layers above (tensor-parallel divisibility, the pipeline schedule,
the device's dtypes) are in :func:`plait.parallel.checks.validate_run`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike

from plait.errors import ConfigError


def _listed(values: Sequence[object]) -> str:
    """``a, b or c``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def choice_error(
    name: str, value: object, allowed: Sequence[object], meaning: str = ""
) -> ConfigError:
    """The refusal of ``value`` for ``name``, which takes one of ``allowed``."""
    tail = f": {meaning}." if meaning else "."
    return ConfigError(f"{name} must be {_listed(allowed)}, got {value!r}{tail}")


def check_choice(name: str, value: object, allowed: Sequence[object], meaning: str = "") -> None:
    """The rule of a field with a fixed set of values (declared once, in
    :mod:`plait.config`): ``value`` must be one of ``allowed``, with its own type (True
    is not 1). ``meaning`` says what the values mean, for the message."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise choice_error(name, value, allowed, meaning)


def check_positive(prefix: str, **values: float | int | None) -> None:
    """Each of ``values`` (None: unset) must be positive; ``prefix`` names their owner
    (``"train."``, ``"layout "``)."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{prefix}{name} must be positive, got {value}.")


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


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """Training sequences fit the model's rotary tables."""
    if seq_len > max_seq_len:
        raise ConfigError(
            f"train.seq_len ({seq_len}) exceeds model.max_seq_len ({max_seq_len}); raise "
            "model.max_seq_len or shorten train.seq_len."
        )


def check_tokenizer_vocab(tokenizer: str, vocab_size: int) -> None:
    """The byte tokenizer's 256 symbols fit the vocabulary."""
    if tokenizer == "byte" and vocab_size < 256:
        raise ConfigError(f"the byte tokenizer needs model.vocab_size >= 256, got {vocab_size}.")


def check_document_mask(pp: int, family: str, factory: str | None) -> None:
    """data.mask_documents: the built-in model computes the document ids from its tokens,
    which later pipeline stages do not see."""
    if family != "plait" or factory is not None:
        raise ConfigError(
            "data.mask_documents works with plait's built-in model only (model.family = "
            f"plait, no model.factory); got family {family!r}"
            + (f", factory {factory!r}" if factory else "") + "."
        )
    if pp > 1:
        raise ConfigError(
            f"data.mask_documents is not supported with pipeline parallelism (parallel.pp = "
            f"{pp}): later stages do not see the tokens; use pp = 1 (dp, tp, cp combine)."
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


def check_compression(
    method: str, zero: int, dtype: str | None = None, reduce_dtype: str | None = None
) -> None:
    """Gradient compression needs plain data parallelism: the ZeRO wrapper (stages 1-3,
    and stage 0 under mixed precision) reduce-scatters flat shards to their owners, which
    a top-k or low-rank message cannot feed. ``dtype``/``reduce_dtype`` None: not known
    (the planner's layout has no precision)."""
    if method == "none":
        return
    if zero > 0:
        raise ConfigError(
            f"parallel.compression = {method!r} works with plain data parallelism (zero 0) "
            f"only, not with parallel.zero = {zero}: ZeRO reduce-scatters each gradient "
            "shard to its owner, which a compressed all-reduce cannot feed. Use "
            "parallel.zero = 0, or parallel.compression = 'none'."
        )
    if dtype not in (None, "fp32") or reduce_dtype not in (None, "auto", "fp32"):
        raise ConfigError(
            f"parallel.compression = {method!r} needs plain data parallelism with fp32 "
            f"parameters and reduction (precision.dtype = {dtype!r}, reduce_dtype = "
            f"{reduce_dtype!r}): mixed precision reduces through the ZeRO wrapper. For "
            "half-precision gradients on the wire use parallel.compression = 'bf16' with "
            "precision.dtype = 'fp32'."
        )


def check_compression_warmup(steps: int, ratio: float) -> None:
    """Top-k's sparsity warm-up (``parallel.compression_warmup_steps``) is a whole number
    of steps, 0 or more; the density it decays to, ``ratio``, is top-k's in (0, 1]."""
    if type(steps) is not int or steps < 0:
        raise ConfigError(
            f"parallel.compression_warmup_steps must be a whole number >= 0, got {steps!r} "
            "(the compressed steps over which top-k's density decays from 25 % to "
            f"parallel.compression_ratio = {ratio}; 0 turns the warm-up off)."
        )


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


def check_offload(offload: str, zero: int) -> None:
    """CPU offload steps on the shards ZeRO owns; parameter offload needs ZeRO-3."""
    if offload != "none" and zero == 0:
        raise ConfigError(
            f"parallel.offload = {offload!r} needs ZeRO (parallel.zero >= 1): the "
            "offloaded optimizer steps on the shards the ZeRO wrapper owns. Set "
            "parallel.zero = 1, 2 or 3, or parallel.offload = 'none'."
        )
    if offload == "params" and zero != 3:
        raise ConfigError(
            f"parallel.offload = 'params' needs parallel.zero = 3 (got {zero}): only "
            "ZeRO-3 shards the parameters; use parallel.offload = 'optimizer' with "
            "stages 1 and 2."
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


def check_rope_scaling(kind: str, low_freq_factor: float, high_freq_factor: float) -> None:
    """'llama3' RoPE scaling smooths between two wavelengths: high_freq_factor must
    exceed low_freq_factor."""
    if kind == "llama3" and high_freq_factor <= low_freq_factor:
        raise ConfigError(
            f"model.rope_high_freq_factor ({high_freq_factor}) must exceed "
            f"model.rope_low_freq_factor ({low_freq_factor}) for rope_scaling 'llama3'."
        )


def check_pretrained_model(
    given: Mapping[str, object], fixed: Mapping[str, object], source: str
) -> None:
    """Model flags ``given`` (``model.<field>`` -> value) must agree with the fields
    ``fixed`` by pretrained weights' ``config.json`` at ``source``; ``max_seq_len`` may be
    shorter (the rotary tables are cut, the weights do not change); ``factory`` is not
    loaded from pretrained weights."""
    if given.get("factory"):
        raise ConfigError(
            f"model.factory and train.init_from {source} (a Hugging Face model) both set: "
            "pretrained weights load into the built-in transformer or model.family hf-llama."
        )
    for key, want in fixed.items():
        have = given.get(key)
        if have is None or have == want:
            continue
        shorter = isinstance(have, int) and isinstance(want, int) and have <= want
        if key == "max_seq_len" and shorter:
            continue
        raise ConfigError(
            f"model.{key} = {have!r} contradicts {source}/config.json, which has {want!r}; "
            f"leave --model.{key} out (the pretrained model's sizes are used)."
        )


def check_moe(
    experts: int,
    top_k: int,
    every: int,
    shared: int,
    hidden: int | None,
    aux_coef: float,
    z_coef: float,
    capacity_factor: float,
) -> None:
    """The mixture-of-experts fields of the model (``experts`` 0: dense, nothing else is
    read): k routed experts out of E, a positive layer period and widths, coefficients
    and capacity factor >= 0."""
    if experts < 0:
        raise ConfigError(f"model.moe_experts must be >= 0 (0: dense), got {experts}.")
    if experts == 0:
        return
    if not 1 <= top_k <= experts:
        raise ConfigError(
            f"model.moe_top_k ({top_k}) must be between 1 and model.moe_experts ({experts})."
        )
    check_positive("model.", moe_every=every, moe_hidden_dim=hidden)
    for name, value in (
        ("moe_shared_experts", shared),
        ("moe_aux_loss_coef", aux_coef),
        ("moe_z_loss_coef", z_coef),
        ("moe_capacity_factor", capacity_factor),
    ):
        if value < 0:
            raise ConfigError(f"model.{name} must be >= 0, got {value}.")


def check_expert_parallel(
    ep: int,
    dp: int,
    cp: int,
    experts: int,
    zero: int = 0,
    compression: str = "none",
    pp: int = 1,
    tp: int = 1,
    dtype: str = "fp32",
    reduce_dtype: str = "auto",
) -> None:
    """Expert parallelism over ``ep`` ranks: a sub-axis of the dp x cp ranks (ep divides
    dp * cp), an MoE model whose experts divide by ep, and the layouts it composes with
    in this version (plain data parallelism: ZeRO stage 0 with fp32 parameters and
    reduction; no gradient compression; ``pp`` and ``tp`` compose and need no rule)."""
    if ep < 1:
        raise ConfigError(f"parallel.ep must be positive, got {ep}.")
    if ep == 1:
        return
    if experts == 0:
        raise ConfigError(
            f"parallel.ep={ep} needs a mixture-of-experts model: set model.moe_experts."
        )
    if (dp * cp) % ep:
        ok = [d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]
        raise ConfigError(
            f"parallel.ep ({ep}) must divide the data-parallel ranks dp x cp = {dp * cp} "
            f"(expert parallelism is a sub-axis of them); choose ep among {ok}."
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
    if dtype != "fp32" or reduce_dtype not in ("auto", "fp32"):
        raise ConfigError(
            f"precision.dtype={dtype} (reduce_dtype={reduce_dtype}) with parallel.ep={ep} "
            "is not supported yet: 16-bit parameters keep their fp32 masters in ZeRO's flat "
            "units, which do not hold the expert weights yet; use fp32 (docs/moe.md)."
        )
    if zero != 0:
        raise ConfigError(
            f"parallel.zero={zero} with parallel.ep={ep} is not supported yet: expert "
            "parameters would need their own ZeRO units over their replica group; use "
            "parallel.zero=0 (docs/moe.md)."
        )


def check_generation_layout(
    pp: int,
    cp: int,
    tp: int,
    sequence_parallel: bool,
    family: str,
    factory: str | None,
    what: str = "generation",
) -> None:
    """Text generation (``plait generate``, ``log.sample_every``) decodes on ranks that
    each hold the whole model or its tp shard: no pipeline stages, no sequence
    parallelism (one new token cannot be split over tp), and under cp only plait's own
    transformer (whose cached decode does not use the context-parallel attention)."""
    if pp > 1:
        raise ConfigError(
            f"{what} needs the whole model on each rank; pp = {pp} splits it into stages. "
            "Use tp (and dp) without pp: any checkpoint loads into that layout."
        )
    if sequence_parallel and tp > 1:
        raise ConfigError(
            f"{what} decodes one token at a time, which sequence parallelism cannot shard "
            "over tp; set parallel.sequence_parallel = false."
        )
    if cp > 1 and (family != "plait" or factory is not None):
        raise ConfigError(
            f"{what} under cp = {cp} needs plait's own transformer (its cached decode does "
            "not use the context-parallel attention); use cp = 1."
        )


def check_sample_length(prompt_bytes: int, new_tokens: int, max_seq_len: int) -> None:
    """``log.sample_prompt`` (at most one token per byte) and ``log.sample_tokens`` fit
    the model's context."""
    if prompt_bytes + new_tokens > max_seq_len:
        raise ConfigError(
            f"log.sample_prompt ({prompt_bytes} bytes, up to as many tokens) + "
            f"log.sample_tokens ({new_tokens}) exceed model.max_seq_len ({max_seq_len}); "
            "shorten the prompt or ask for fewer tokens."
        )


def parse_step_window(text: str) -> tuple[int, int]:
    """``"START-END"`` (1-based steps, inclusive; ``"N"`` is ``"N-N"``) as
    ``(start, end)``; a :class:`ConfigError` for anything else (``log.profile``)."""
    parts = text.split("-")
    try:
        start, end = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        start, end = 0, -1
    if not 1 <= start <= end:
        raise ConfigError(
            f"log.profile must be 'START-END' with 1 <= START <= END (optimizer steps, "
            f"1-based, inclusive), e.g. '3-5'; got {text!r}."
        )
    return start, end


OFFLOAD_RING_BUFFERS = 2
"""ZeRO-Offload's pinned fp32 gradient landing buffers per rank (each the size of the
largest unit's shard), reused unit after unit: one lands while the previous steps on the
host (:mod:`plait.parallel.zero.offload`; the planner counts them,
:mod:`plait.plan.offload`)."""


def check_offload_dir(path: str | PathLike[str], needed_bytes: int) -> None:
    """Raise :class:`ConfigError` unless ``path`` is (or can be made) a writable folder
    with at least ``needed_bytes`` free."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".plait-probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"parallel.offload_dir = {str(path)!r} is not a writable folder ({e.strerror or e}); "
            "give a folder on a local disk this user can write, or unset parallel.offload_dir."
        ) from None
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise ConfigError(
            f"parallel.offload_dir = {str(path)!r} has {free / 2**30:.2f} GiB free but the "
            f"offloaded state needs {needed_bytes / 2**30:.2f} GiB; free space, choose "
            "another folder, or use more ranks (ZeRO shards the state)."
        )
