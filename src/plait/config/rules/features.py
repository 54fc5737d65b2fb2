"""Rules on features a run turns on: document masking, gradient compression, ZeRO-Offload
and its NVMe folder, text generation, the profiler's window.

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

from os import PathLike

from plait.errors import ConfigError


def check_document_mask(
    pp: int, family: str, factory: str | None, restart_positions: bool = False
) -> None:
    """data.mask_documents: the built-in model computes the document ids from its tokens,
    which later pipeline stages do not see; a Hugging Face class masks packed documents
    from restarted position_ids (data.restart_positions)."""
    hf_packed = family != "plait" and restart_positions
    if (family != "plait" and not hf_packed) or factory is not None:
        raise ConfigError(
            "data.mask_documents works with plait's built-in model (model.family = "
            "plait, no model.factory), or a Hugging Face family with "
            f"data.restart_positions; got family {family!r}"
            + (f", factory {factory!r}" if factory else "")
            + "."
        )
    if pp > 1:
        raise ConfigError(
            f"data.mask_documents is not supported with pipeline parallelism (parallel.pp = "
            f"{pp}): later stages do not see the tokens; use pp = 1 (dp, tp, cp combine)."
        )


def check_compression(
    method: str,
    zero: int,
    dtype: str | None = None,
    reduce_dtype: str | None = None,
    adam: str | None = None,
    nonfinite: str | None = None,
) -> None:
    """Gradient compression needs plain data parallelism: the ZeRO wrapper (stages 1-3,
    and stage 0 under mixed precision) reduce-scatters flat shards to their owners, which
    a top-k or low-rank message cannot feed. ``dtype``/``reduce_dtype`` None: not known
    (the planner's layout has no precision). Top-k with Adam's moments before the
    exchange (``adam`` 'before') cannot skip a non-finite step (``nonfinite`` 'skip'):
    the rank's moments take the bad gradient during backward, before any skip decision,
    and stay non-finite for the rest of the run."""
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
    if method == "topk" and adam == "before" and nonfinite == "skip":
        raise ConfigError(
            "precision.nonfinite = 'skip' cannot be used with parallel.compression = 'topk' "
            "and parallel.compression_adam = 'before': each rank's Adam moments take a "
            "non-finite gradient during backward, before the step could be skipped, and "
            "stay non-finite. Use precision.nonfinite = 'error', or compression_adam = "
            "'after'."
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


def check_optimizer(
    optimizer: str, tp: int, ep: int, offload: str, compression: str, compression_adam: str
) -> None:
    """train.optimizer: Muon and Adafactor need each matrix whole. Muon gets it under
    data parallelism, ZeRO 0-3 (one owner rank per matrix), tensor and expert
    parallelism (the update gathered over tp); Adafactor all-reduces its row and column
    sums over the ranks holding pieces of a matrix (ZeRO shards, tp blocks, ep's experts;
    docs/optimizers.md), but not over tp and ep at once. Neither runs in ZeRO-Offload's
    host step (AdamW's fused kernel) nor replaces top-k compression's Adam in front of
    the exchange."""
    if optimizer == "adamw":
        return
    if optimizer == "adafactor" and tp > 1 and ep > 1:
        raise ConfigError(
            f"train.optimizer = 'adafactor' with parallel.tp = {tp} and parallel.ep = {ep}: "
            "an expert tensor would be cut along two dimensions at once, and Adafactor's "
            "row and column sums are reduced over one split only; use tp = 1 or ep = 1."
        )
    if offload != "none":
        raise ConfigError(
            f"train.optimizer = {optimizer!r} with parallel.offload = {offload!r}: the host "
            "step is AdamW's fused kernel; set parallel.offload = 'none'."
        )
    if compression == "topk" and compression_adam == "before":
        raise ConfigError(
            f"train.optimizer = {optimizer!r} with top-k compression's Adam before the "
            "exchange (parallel.compression_adam = 'before'): the ranks would step Adam; "
            "set parallel.compression_adam = 'after'."
        )
