"""Generation with a KV cache (plait.model.kv_cache, plait.model.generate): the cached
decode gives the tokens of a plain loop that calls the model on the growing sequence,
its logits equal the full forward's at every position, and sampling is reproducible.

Tolerance: the cached and the full forward differ only in the attention's summation
order (float32): logits within 1e-5 absolute; tokens identical (the tests check that
the greedy margin, top-1 minus top-2 logit, exceeds 1e-3 at every step, so a rounding
difference cannot flip a token).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model.factory import build_model
from plait.model.generate import (
    CachedDecoder,
    HFCachedDecoder,
    RecomputeDecoder,
    SampleSettings,
    choose_token,
    generate,
    make_decoder,
)
from plait.model.kv_cache import KVCache, forward_cached
from plait.model.transformer import Transformer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, init_std=0.2)
PROMPT = [104, 101, 108, 108, 111, 32]  # "hello "


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these tiny models run ~30x slower with two on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _model(cfg: ModelConfig = CFG, seed: int = 3) -> torch.nn.Module:
    return build_model(cfg, seed=seed).eval()


def _plain_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], float]:
    """The reference: the model on the whole growing sequence, arg-max of the last
    position; returns the tokens and the smallest top-1 minus top-2 margin."""
    seq, margin = list(prompt), float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]))
            last = getattr(logits, "logits", logits)[0, -1]  # (vocab,)
            top = torch.topk(last.float(), 2).values
            margin = min(margin, float(top[0] - top[1]))
            seq.append(int(torch.argmax(last)))
    return seq[len(prompt) :], margin


def test_greedy_with_the_cache_equals_a_plain_loop() -> None:
    model = _model()
    want, margin = _plain_greedy(model, PROMPT, 30)
    assert margin > 1e-3  # no near-tie: the comparison below is meaningful
    s = SampleSettings(max_new_tokens=30)
    decoder = make_decoder(model, 48)
    assert isinstance(decoder, CachedDecoder)
    assert generate(decoder, PROMPT, s) == want
    no_cache = make_decoder(model, 48, kv_cache=False)
    assert isinstance(no_cache, RecomputeDecoder)
    assert generate(no_cache, PROMPT, s) == want
    assert len(set(want)) > 3  # not a constant sequence


@pytest.mark.parametrize("window", [None, 4])
def test_cached_logits_equal_the_full_forward_at_every_position(window: int | None) -> None:
    """Prefill in two chunks (the second attends to the cache with a causal mask), then
    one token at a time: each call's last logits equal the full forward's row (with a
    sliding window of 4 on the first layer too: the cache applies the same band)."""
    types = ("sliding_attention", "full_attention")
    cfg = ModelConfig(**{**CFG.__dict__, "sliding_window": window, "layer_types": types})
    model = _model(cfg)
    assert isinstance(model, Transformer)
    seq = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(seq)  # (2, 20, vocab)
        cache = KVCache(CFG.n_layers, 48)
        for start, end in [(0, 5), (5, 12), *((t, t + 1) for t in range(12, 20))]:
            last = forward_cached(model, seq[:, start:end], cache)  # (2, vocab)
            assert cache.length == end
            torch.testing.assert_close(last, full[:, end - 1], atol=1e-5, rtol=0)
    # batch 2 x 2 layers x (k, v) x 1 kv-head pair: (2, 2 kv heads, 48, 8) float32
    assert cache.nbytes() == 2 * 2 * (2 * 2 * 48 * 8 * 4)


def test_the_cache_and_the_rotary_tables_end_at_max_seq_len() -> None:
    model = _model()
    assert isinstance(model, Transformer)
    cache = KVCache(CFG.n_layers, 64)
    with torch.no_grad(), pytest.raises(ConfigError, match=r"model.max_seq_len = 48"):
        forward_cached(model, torch.zeros(1, 49, dtype=torch.long), cache)
    small = KVCache(CFG.n_layers, 4)
    with torch.no_grad(), pytest.raises(ConfigError, match="holds 4 positions; 5 were"):
        forward_cached(model, torch.zeros(1, 5, dtype=torch.long), small)


def test_sampling_is_reproducible_and_the_same_with_and_without_the_cache() -> None:
    model = _model()
    s = SampleSettings(max_new_tokens=25, temperature=0.9, top_p=0.95, top_k=40, seed=11)
    a = generate(make_decoder(model, 48), PROMPT, s)
    assert a == generate(make_decoder(model, 48), PROMPT, s)
    assert a == generate(make_decoder(model, 48, kv_cache=False), PROMPT, s)
    other = SampleSettings(max_new_tokens=25, temperature=0.9, top_p=0.95, top_k=40, seed=12)
    assert a != generate(make_decoder(model, 48), PROMPT, other)
    greedy = generate(make_decoder(model, 48), PROMPT, SampleSettings(max_new_tokens=25))
    assert a != greedy  # sampling at T = 0.9 is not the arg-max


def test_choose_token_keeps_only_the_top_k_and_the_nucleus() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0, 2.0])  # order: 1, 3, 5, 2, 0, 4
    gen = torch.Generator().manual_seed(0)
    greedy = SampleSettings(max_new_tokens=1)
    assert choose_token(logits, greedy, gen) == 1
    top2 = SampleSettings(max_new_tokens=1, temperature=1.0, top_k=2)
    seen = {choose_token(logits, top2, gen) for _ in range(300)}
    assert seen == {1, 3}
    probs = torch.softmax(logits, -1)
    p = float(probs[1] + probs[3]) + 1e-4  # the nucleus is tokens 1, 3 and then 5
    nucleus = SampleSettings(max_new_tokens=1, temperature=1.0, top_p=p)
    seen = {choose_token(logits, nucleus, gen) for _ in range(500)}
    assert seen == {1, 3, 5}
    tiny = SampleSettings(max_new_tokens=1, temperature=1.0, top_p=1e-6)
    assert {choose_token(logits, tiny, gen) for _ in range(50)} == {1}


def test_sampled_frequencies_follow_the_softmax_at_the_temperature() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    s = SampleSettings(max_new_tokens=1, temperature=2.0)
    gen = torch.Generator().manual_seed(1)
    n = 4000
    counts = torch.bincount(
        torch.tensor([choose_token(logits, s, gen) for _ in range(n)]), minlength=3
    )
    want = torch.softmax(logits / 2.0, -1)
    # binomial standard deviation <= sqrt(0.25 / n) ~ 0.008; allow 4 of them
    torch.testing.assert_close(counts.float() / n, want, atol=0.032, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "--max-new-tokens must be positive"),
        ({"temperature": -1.0}, "--temperature must be 0"),
        ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
        ({"top_k": -2}, "--top-k must be 0"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SampleSettings(**kwargs)  # type: ignore[arg-type]


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ConfigError, match="the prompt is empty"):
        generate(make_decoder(_model(), 48), [], SampleSettings(max_new_tokens=2))


def test_hf_llama_with_transformers_cache_equals_a_plain_loop() -> None:
    pytest.importorskip("transformers")
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=48,
        family="hf-llama",
        init_std=0.2,
    )
    torch.manual_seed(5)
    model = _model(cfg)
    want, margin = _plain_greedy(model, PROMPT, 20)
    assert margin > 1e-3
    decoder = make_decoder(model, 48)
    assert isinstance(decoder, HFCachedDecoder)
    assert generate(decoder, PROMPT, SampleSettings(max_new_tokens=20)) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_in_bf16_matches_its_own_plain_loop_and_cpu_sampling_is_device_free() -> None:
    """On a GPU: the cached decode in bf16 gives the plain loop's greedy tokens where the
    loop's margins are clear of bf16 rounding, and a fp32 sampled run gives the CPU's
    tokens (the draws come from the CPU generator)."""
    model = _model().cuda()
    s = SampleSettings(max_new_tokens=20, temperature=0.7, top_k=30, seed=2)
    cpu = generate(make_decoder(_model(), 48), PROMPT, s)
    assert generate(make_decoder(model, 48), PROMPT, s, device="cuda") == cpu
    half = _model().to("cuda", torch.bfloat16)
    ref = _model().to(torch.bfloat16).float()  # the same bf16 weights, computed in fp32
    want, margin = _plain_greedy(ref, PROMPT, 20)
    got = generate(make_decoder(half, 48), PROMPT, SampleSettings(max_new_tokens=20), "cuda")
    if margin > 0.1:  # bf16 logits are exact to ~1e-2 here
        assert got == want
    assert len(got) == 20
