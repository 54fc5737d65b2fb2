"""Text from a :class:`~plait.parallel.model.ParallelModel`: what ``plait generate`` and
the trainer's ``log.sample_every`` run.

The model is the trained (or loaded) one, on its own layout. Every rank decodes the same
prompt (:mod:`plait.model.generate`) on the one-device model inside the data wrapper:

* tensor parallelism — each tp rank holds whole heads and a vocabulary shard of the
  head; the projections communicate as in training (the output projection's and MLP's
  partial sums all-reduced) and the last position's logits are all-gathered over tp
  (``B x V`` values per token, counted by :mod:`plait.comm`) before choosing; tp rank 0's
  token is then broadcast over tp, so every tp rank feeds the same token even where
  the gathered logits could differ in the last bit (NCCL);
* data parallelism and ZeRO — every dp rank decodes the same tokens; stages 0-2 hold the
  whole model and do not communicate across dp; stage 3 never holds it: each unit is
  gathered, used and freed in turn for every fed token (the prefill, then each new
  token), without prefetch (:class:`~plait.parallel.zero.unit_by_unit.UnitByUnit`), so a
  rank holds its shards plus one unit (and the decode's key/value cache);
* context parallelism — the cached decode of plait's Transformer uses neither the
  sequence-sharded positions nor the ring attention (:mod:`plait.model.kv_cache`), so
  each cp rank decodes alone; other models under cp are refused;
* pipeline parallelism and sequence parallelism are refused (no stage holds the whole
  model; sequence parallelism shards the one-token decode's sequence).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait import comm
from plait.comm.regions import gather_along
from plait.errors import ConfigError
from plait.model.generate import SampleSettings, generate, make_decoder
from plait.model.transformer import Transformer
from plait.parallel.model import ParallelModel
from plait.parallel.tensor.sharding_plan import vocab_size_of
from plait.parallel.zero.unit_by_unit import UnitByUnit

if TYPE_CHECKING:
    from plait.config import Config


@dataclass(frozen=True)
class Sample:
    """What :func:`sample_tokens` produced."""

    tokens: list[int]
    """The new token ids (the prompt not included)."""
    seconds: float
    """Wall time of the decode (prefill included)."""

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second."""
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def inner_model(model: ParallelModel) -> nn.Module:
    """The (tensor-parallel) one-device model inside the data wrapper."""
    if model.pipeline is not None:
        raise ConfigError("generation needs the whole model on each rank: pp must be 1.")
    inner = model.data_wrapper.module
    return getattr(inner, "_orig_mod", inner)  # a torch.compile'd model: the original


def _vocab_of(model: nn.Module) -> int:
    """The vocabulary of the (tensor-parallel) model's head: plait's ``output``, a
    Hugging Face model's output embeddings, else the plan's ``vocab_head``."""
    if isinstance(model, Transformer):
        head: object = model.output
    elif callable(getattr(model, "get_output_embeddings", None)):
        head = model.get_output_embeddings()  # type: ignore[operator]
    else:
        return vocab_size_of(model)
    out = getattr(head, "out_features", None)
    if not isinstance(out, int):
        raise ConfigError(f"the head of {type(model).__name__} has no integer out_features")
    return out


def _tp_logits(model: nn.Module, tp: comm.AxisGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """Vocabulary-shard logits ``(batch, V/tp)`` -> the whole vocabulary ``(batch, V)``."""
    vocab = _vocab_of(model)

    def full(logits: torch.Tensor) -> torch.Tensor:
        out = gather_along(logits.contiguous(), tp, -1)  # (batch, padded V)
        return out.narrow(-1, 0, vocab)

    return full


def _agree(group: comm.AxisGroup, device: torch.device) -> Callable[[int], int]:
    """Every rank of ``group`` takes the token of its rank 0."""

    def agree(token: int) -> int:
        t = torch.tensor([token], dtype=torch.long, device=device)
        comm.broadcast(t, group, src=0)
        return int(t.item())

    return agree


def sample_tokens(
    model: ParallelModel,
    prompt: Sequence[int],
    settings: SampleSettings,
    kv_cache: bool = True,
    stop: Callable[[list[int]], bool] | None = None,
) -> Sample:
    """``settings.max_new_tokens`` tokens continuing ``prompt`` on every rank of the
    model's mesh (the same tokens on each; see the module docstring), or fewer when
    ``stop`` (:func:`~plait.model.generate.generate`) ends the decode. Collective: every
    rank calls it with the same arguments."""
    mesh = model.mesh
    inner = inner_model(model)
    if mesh.size("cp") > 1 and not (kv_cache and isinstance(inner, Transformer)):
        raise ConfigError("generation under cp > 1 needs plait's transformer with the KV cache.")
    max_len = len(prompt) + settings.max_new_tokens
    logits_fn = agree = None
    if mesh.size("tp") > 1:
        tp = mesh.axis("tp")
        logits_fn, agree = _tp_logits(inner, tp), _agree(tp, mesh.device)
    zero = model.zero
    if zero is not None:
        zero.wait_params()  # stages 1/2: the last step's all-gathers
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        one = None  # stage 3: one unit at a time
        if zero is not None and zero.gatherer is not None:
            one = UnitByUnit(zero.units, zero.gatherer, zero.driver)
        with one if one is not None else contextlib.nullcontext():
            decoder = make_decoder(inner, max_len, kv_cache, one.scope if one else None)
            tokens = generate(decoder, prompt, settings, mesh.device, logits_fn, agree, stop)
    finally:
        model.train(was_training)
    return Sample(tokens, time.perf_counter() - t0)


class TrainingSamples:
    """``log.sample_every``: a short greedy continuation of ``log.sample_prompt`` by the
    model being trained, as one console line (every rank decodes; rank 0 prints it)."""

    def __init__(self, cfg: Config) -> None:
        from plait.data import check_vocab, make_tokenizer
        from plait.data.sources import data_tokenizer

        log = cfg.log
        self.every = log.sample_every
        self.tokenizer = make_tokenizer(data_tokenizer(cfg.data))
        ids = self.tokenizer.encode(log.sample_prompt)
        check_vocab(ids, cfg.model.vocab_size, "log.sample_prompt")
        self.prompt = [int(i) for i in ids]
        self.settings = SampleSettings(max_new_tokens=log.sample_tokens)

    def due(self, step: int) -> bool:
        """Whether a sample is printed after step ``step`` (1-based)."""
        return self.every > 0 and step % self.every == 0

    def line(self, model: ParallelModel, step: int) -> str:
        """Decode (collective over the mesh) and return the console line."""
        sample = sample_tokens(model, self.prompt, self.settings)
        text = self.tokenizer.decode(self.prompt + sample.tokens)
        return f"plait: sample at step {step}: {text!r}"
