"""Sampling text from a language model, one token at a time, with or without a cache.

A *decoder* turns the tokens fed so far into the next-token logits. It is fed the
prompt once (the prefill), then each chosen token in turn:

* :class:`CachedDecoder` — plait's :class:`~plait.model.transformer.Transformer` with a
  :class:`~plait.model.kv_cache.KVCache`: each call runs the blocks on the new tokens
  only (:func:`~plait.model.kv_cache.forward_cached`);
* :class:`HFCachedDecoder` — a Hugging Face causal LM (``model.family = "hf-llama"``)
  with transformers' own ``DynamicCache`` (its ``cache`` / ``past_key_values``
  argument): transformers computes the positions and the causal mask from the cache,
  as its ``generate`` does;
* :class:`RecomputeDecoder` — any model mapping token ids ``(batch, seq)`` to logits (or
  an output with ``.logits``): it calls the model on the whole growing sequence each
  time, the reference the cached decoders are tested against, and the path of a model
  (``model.factory``) that has no cache.

:func:`generate` then chooses each next token from the last logits
(:func:`choose_token`): greedy (``temperature = 0``: the arg-max, the lowest id on a
tie) or sampled at temperature T from the ``top_k`` most likely tokens and / or the
smallest set whose probability reaches ``top_p`` (nucleus sampling), with a
``torch.Generator`` on the CPU seeded by ``seed``, so a seed gives the same text on any
device. ``logits_fn`` maps a decoder's logits to the whole vocabulary (a
tensor-parallel head gives each rank a vocabulary shard; :mod:`plait.train.sample`
gathers them); ``agree`` lets ranks settle on one token (every tp rank must feed the
same one).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from plait.errors import ConfigError
from plait.model.factory import logits_of
from plait.model.kv_cache import BlockScope, KVCache, forward_cached
from plait.model.transformer import Transformer


@dataclass(frozen=True)
class SampleSettings:
    """How :func:`generate` picks tokens."""

    max_new_tokens: int = 64
    """Tokens to generate after the prompt."""
    temperature: float = 0.0
    """0: greedy (arg-max); > 0: sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens whose probability sums to top_p (1: all)."""
    top_k: int = 0
    """Keep only the top_k most likely tokens before sampling (0: all)."""
    seed: int = 0
    """Seed of the CPU generator that draws the samples."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be positive, got {self.max_new_tokens}.")
        if not self.temperature >= 0.0:
            raise ConfigError(
                f"--temperature must be 0 (greedy) or positive, got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (off) or positive, got {self.top_k}.")


class Decoder(Protocol):
    """Next-token logits of the tokens fed so far."""

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` ``(batch, t)``; returns the last position's logits ``(batch, V)``."""
        ...


class CachedDecoder:
    """plait's Transformer with a key/value cache of ``max_len`` positions; ``scope`` is
    entered around each block's work (:func:`~plait.model.kv_cache.forward_cached`)."""

    def __init__(self, model: Transformer, max_len: int, scope: BlockScope | None = None) -> None:
        self.model, self.scope = model, scope
        self.cache = KVCache(len(model.layers), max_len)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the blocks on the new tokens only."""
        return forward_cached(self.model, tokens, self.cache, self.scope)  # (batch, vocab)


class HFCachedDecoder:
    """A Hugging Face causal LM with transformers' ``DynamicCache``."""

    def __init__(self, model: nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=getattr(model, "config", None))
        params = inspect.signature(type(model).forward).parameters
        # transformers >= 5.2x names the argument ``cache`` (``past_key_values`` before)
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``model(input_ids=tokens, cache=cache)``'s last logits."""
        kwargs = {self.cache_arg: self.cache}
        out = self.model(input_ids=tokens, use_cache=True, logits_to_keep=1, **kwargs)
        return logits_of(out)[:, -1]  # (batch, vocab)


class RecomputeDecoder:
    """Any model, called on the whole growing sequence (no cache)."""

    def __init__(self, model: Callable[[torch.Tensor], Any]) -> None:
        self.model = model
        self.tokens: torch.Tensor | None = None  # (batch, seq) fed so far

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The model on every token fed so far; the last position's logits."""
        seq = tokens if self.tokens is None else torch.cat([self.tokens, tokens], dim=1)
        self.tokens = seq
        return logits_of(self.model(seq))[:, -1]  # (batch, vocab)


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model that takes ``past_key_values``."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__) and hasattr(
        model, "config"
    )


def make_decoder(
    model: nn.Module, max_len: int, kv_cache: bool = True, scope: BlockScope | None = None
) -> Decoder:
    """The decoder for ``model``: cached for plait's Transformer (``max_len`` positions;
    ``scope`` around each block's work) and for a Hugging Face model, else (or with
    ``kv_cache=False``) recomputing (those call every module's ``forward``)."""
    if kv_cache and isinstance(model, Transformer):
        return CachedDecoder(model, max_len, scope)
    if kv_cache and is_hf_causal_lm(model):
        return HFCachedDecoder(model)
    return RecomputeDecoder(model)


def choose_token(logits: torch.Tensor, s: SampleSettings, generator: torch.Generator) -> int:
    """The next token from ``logits`` ``(vocab,)`` under ``s`` (see the module docstring)."""
    x = logits.detach().float().cpu()  # (vocab,)
    if s.temperature == 0.0:
        return int(torch.argmax(x))
    x = x / s.temperature
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        order = torch.argsort(x, descending=True)  # (vocab,)
        probs = torch.softmax(x[order], dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        drop = order[before >= s.top_p]  # the first token always stays (before = 0)
        x[drop] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    decoder: Decoder,
    prompt: Sequence[int],
    s: SampleSettings,
    device: torch.device | str = "cpu",
    logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    agree: Callable[[int], int] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """``s.max_new_tokens`` token ids continuing ``prompt`` (the prompt not included), or
    fewer: ``stop`` (given the new tokens so far, after each one) ends the decode early
    when it returns True (every rank that must feed the same tokens decides alike)."""
    if not prompt:
        raise ConfigError("the prompt is empty: give at least one token of text.")
    generator = torch.Generator().manual_seed(s.seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, prompt)
    out: list[int] = []
    for _ in range(s.max_new_tokens):
        logits = decoder.feed(tokens)  # (1, vocab or a shard)
        if logits_fn is not None:
            logits = logits_fn(logits)  # (1, vocab)
        token = choose_token(logits[0], s, generator)
        if agree is not None:
            token = agree(token)
        out.append(token)
        if stop is not None and stop(out):
            break
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)  # (1, 1)
    return out
