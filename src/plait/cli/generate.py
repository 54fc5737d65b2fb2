"""``plait generate``: text from a checkpoint, one token at a time with a KV cache.

``plait generate --init-from CKPT_OR_DIR --prompt TEXT [--max-new-tokens N --temperature
T --top-p P --top-k K --seed S --no-kv-cache]`` loads the model the way ``plait eval``
does (any checkpoint layout, a consolidated weights file or a Hugging Face folder, into
this run's layout), encodes the prompt with ``data.tokenizer``, generates N tokens and
prints the prompt and its continuation on stdout (rank 0); a line on stderr says how
many tokens were generated and how fast. ``--temperature 0`` (the default) is greedy;
above 0 it samples, seeded by ``--seed`` (``train.seed``), the same text on any layout
and device (:mod:`plait.model.generate`).

``--init-from`` may also name a run's checkpoint folder (the one holding ``latest``):
its latest checkpoint is used. A plait checkpoint carries its run's config, so the
model and the tokenizer come from it (:mod:`plait.cli.model_source`: a flag that
contradicts the model's shape is refused, other flags override it).

The layout flags are the training run's (``--nproc --tp``, torchrun): tp shards a model
too large for one device; dp and ZeRO replicate the decode; pp and sequence parallelism
are refused (:mod:`plait.train.sample`). The built-in transformer decodes with plait's
KV cache (:mod:`plait.model.kv_cache`); ``model.family = "hf-llama"`` with transformers'
``DynamicCache``; a ``model.factory`` model, or ``--no-kv-cache``, recomputes the whole
sequence for every token.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.config import Config
    from plait.launch.local import RankEnv
    from plait.mesh import Mesh
    from plait.model.generate import SampleSettings
    from plait.train.sample import Sample


@dataclass(frozen=True)
class GenerateArgs:
    """What to generate, besides the run's config."""

    prompt: str
    settings: SampleSettings
    kv_cache: bool = True


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait generate",
        description=(
            "Continue --prompt with the model in --init-from (a checkpoint, a run's "
            "checkpoint folder, a consolidated weights file or a Hugging Face folder); "
            "greedy at --temperature 0, else sampled (seed: --seed). Layout flags and "
            "--config as for plait train (--nproc --tp ...)."
        ),
    )
    p.add_argument("--config", metavar="PATH", help="TOML file with the run's configuration")
    p.add_argument("--prompt", help="the text to continue (required)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default 64")
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy"
    )
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus (1: off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="top-k (0: off)")
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole sequence for each token (slower; for checking)",
    )
    return p


def _config(rest: Sequence[str]) -> tuple[Config, GenerateArgs]:
    """The run's config (the train command's flags and TOML) and what to generate."""
    from plait.cli.common import parse_run_flags
    from plait.cli.model_source import checkpoint_defaults
    from plait.cli.train import pretrained_defaults
    from plait.config import ModelConfig
    from plait.config.coerce import config_from_dict
    from plait.config.toml_io import load_config_data
    from plait.model.generate import SampleSettings

    overrides, ns = parse_run_flags(_parser(), rest)
    if ns.prompt is None:
        raise ConfigError("plait generate needs --prompt TEXT: the text to continue.")
    if not ns.prompt:
        raise ConfigError("--prompt is empty: give the text to continue.")
    data = load_config_data(ns.config, overrides)
    if not data.get("train", {}).get("init_from"):
        raise ConfigError(
            "plait generate needs --init-from PATH: a checkpoint folder, a run's checkpoint "
            "folder, a consolidated weights file or a Hugging Face model folder."
        )
    checkpoint_defaults(data, adapters=True)  # a plait checkpoint: its model, adapters, tokenizer
    pretrained_defaults(data)  # a Hugging Face folder: the sizes from its config.json
    limit = data.get("model", {}).get("max_seq_len", ModelConfig.max_seq_len)
    data["train"].setdefault("seq_len", limit)  # training's default may exceed the model's
    cfg = config_from_dict(data)
    settings = SampleSettings(
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=cfg.train.seed,
    )
    return cfg, GenerateArgs(ns.prompt, settings, not ns.no_kv_cache)


def encode_prompt(cfg: Config, args: GenerateArgs) -> list[int]:
    """The prompt's token ids, refused when empty, outside the vocabulary, or too long
    for ``model.max_seq_len`` with ``--max-new-tokens`` more."""
    from plait.data import check_vocab, make_tokenizer

    ids = make_tokenizer(cfg.data.tokenizer).encode(args.prompt)
    if len(ids) == 0:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens.")
    check_vocab(ids, cfg.model.vocab_size, "--prompt")
    n, limit = args.settings.max_new_tokens, cfg.model.max_seq_len
    if len(ids) + n > limit:
        raise ConfigError(
            f"--max-new-tokens {n}: the prompt's {len(ids)} tokens + {n} new ones exceed the "
            f"model's context, model.max_seq_len = {limit}; ask for at most "
            f"{max(0, limit - len(ids))} new tokens or shorten the prompt."
        )
    return [int(i) for i in ids]


def generate_on(mesh: Mesh, cfg: Config, args: GenerateArgs, prompt: list[int]) -> Sample:
    """Load ``cfg``'s model on ``mesh`` and generate (collective over the mesh)."""
    from plait.cli.eval import load_model
    from plait.train.sample import sample_tokens

    model = load_model(cfg, mesh)
    return sample_tokens(model, prompt, args.settings, args.kv_cache)


def _generate(rest: Sequence[str]) -> int:
    """Validate, then generate here (one process, or a rank) or start the ranks."""
    from plait.cli.common import leave_torchrun_child, start_checks
    from plait.config.rules.features import check_generation_layout
    from plait.data import make_tokenizer
    from plait.launch.local import launch_local

    cfg, args = _config(rest)
    env, world = start_checks(cfg)
    p, m = cfg.parallel, cfg.model
    check_generation_layout(p.pp, p.cp, p.tp, p.sequence_parallel, m.family, m.factory)
    prompt = encode_prompt(cfg, args)
    if env is None and world > 1:
        return launch_local(world, ["generate", *rest])
    sample = _run(cfg, env, args, prompt)
    if env is None or env.rank == 0:
        text = make_tokenizer(cfg.data.tokenizer).decode(prompt + sample.tokens)
        print(text, flush=True)
        how = "KV cache" if args.kv_cache else "no cache"
        sys.stderr.write(
            f"plait: generated {len(sample.tokens)} tokens in {sample.seconds:.2f} s "
            f"({sample.tokens_per_s:.1f} tokens/s, {how})\n"
        )
    leave_torchrun_child(env)
    return 0


def _run(cfg: Config, env: RankEnv | None, args: GenerateArgs, prompt: list[int]) -> Sample:
    """Join the world (a rank), build the mesh, load and generate."""
    from plait.launch.worker import on_rank

    return on_rank(cfg, env, lambda mesh: generate_on(mesh, cfg, args, prompt))


def generate_main(rest: Sequence[str]) -> int:
    """``plait generate``."""
    from plait.cli.common import run_as_rank

    return run_as_rank(_generate, rest)
