"""``plait eval``: the mean next-token loss and perplexity of a model on a token file.

``plait eval --init-from DIR_OR_CKPT --data FILE --seq-len S [--batches N]`` cuts the
data's tokens (in file order) into the windows ``tokens[i·S : i·S + S + 1]``, i = 0, 1,
…; each window's first S tokens are the inputs and its last S the targets. The last
``(T - 1) mod S`` tokens, a partial window, are not evaluated (the console says how
many). Without ``--batches`` every window is evaluated; with it, the first N global
batches of ``train.global_batch`` windows. The source is streamed where it can be: a
prepared folder (``plait data prepare``; its documents in order, nothing held out, chat
masks applied) and a ``.npy``/``.bin`` file are memory-mapped and each rank reads only
the windows it evaluates (with a pipeline: only the halves its stages need); a text
source is tokenized whole (``data.max_bytes`` defaults to 0 here, unlike ``plait
train``). A mixture is refused.

The layout is the training run's: the same flags and TOML (``--nproc --dp --tp --pp
--cp --zero`` ..., :mod:`plait.cli.train`), the same launcher, and the same loading path
as the trainer (build the model, :class:`~plait.checkpoint.Checkpointing` checks the
``train.init_from`` tensors, ``parallelize``, then each rank reads its own pieces), so
whatever ``--init-from`` accepts for ``plait train`` it accepts here; a plait
checkpoint's model and tokenizer are its run's (:mod:`plait.cli.model_source`). Each global batch
goes through :meth:`~plait.parallel.model.ParallelModel.evaluate` (each dp rank its
contiguous slice; the loss averaged over dp). Windows that do not fill a whole batch
are evaluated too, weighted exactly: groups of dp windows (each dp rank one window,
repeated to fill its slice), then single windows (every rank the same one), so the
result is the mean over all windows on any layout.

``plait eval --tasks TASK_OR_YAML`` runs lm-evaluation-harness tasks instead
(:mod:`plait.cli.eval_tasks`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.config import Config
    from plait.data import WindowSet
    from plait.launch.local import RankEnv
    from plait.mesh import Mesh
    from plait.parallel.model import ParallelModel


@dataclass(frozen=True)
class EvalResult:
    """What ``plait eval`` measured."""

    loss: float
    """Mean next-token cross-entropy over every evaluated token (nats)."""
    windows: int
    """Windows of ``seq_len + 1`` tokens evaluated."""
    seq_len: int

    @property
    def tokens(self) -> int:
        """Predicted tokens (``windows x seq_len``)."""
        return self.windows * self.seq_len

    @property
    def perplexity(self) -> float:
        """``exp(loss)`` (inf when it overflows)."""
        return math.exp(self.loss) if self.loss < 700 else math.inf


def window_batches(
    windows: int, batch: int, dp: int, batches: int | None = None
) -> list[tuple[list[int], int]]:
    """The global batches that evaluate windows ``0 .. windows-1``, each as (its ``batch``
    window indices, dp rank r taking the r-th contiguous slice; how many distinct windows
    its loss stands for). ``batches`` given: exactly that many whole batches. Else every
    window: whole batches, then groups of ``dp`` windows (one per dp rank, repeated to
    fill its slice; the dp mean is their mean), then single windows (on every rank)."""
    full = windows // batch if batches is None else batches
    plan = [(list(range(b * batch, (b + 1) * batch)), batch) for b in range(full)]
    if batches is not None:
        return plan
    per = batch // dp
    rest = list(range(full * batch, windows))
    while len(rest) >= dp > 1:
        group, rest = rest[:dp], rest[dp:]
        plan.append(([w for w in group for _ in range(per)], dp))
    plan += [([w] * batch, 1) for w in rest]
    return plan


def load_model(cfg: Config, mesh: Mesh) -> ParallelModel:
    """The model of ``cfg`` on ``mesh`` with ``train.init_from``'s weights, loaded the
    way the trainer loads them: build, check the tensors, ``parallelize``, then every
    rank reads its own pieces (into the optimizer's masters where it keeps them)."""
    from plait.checkpoint import Checkpointing, TrainState
    from plait.data import BatchSampler
    from plait.train.start import one_device_model, start_parallel

    base = one_device_model(cfg, mesh.device)  # on the meta device: parallelize allocates
    checkpoints = Checkpointing(cfg, mesh)
    try:
        model, optimizer = start_parallel(base, cfg, mesh, checkpoints)
        dp = mesh.size("dp")
        sampler = BatchSampler(cfg.train.global_batch, cfg.train.global_batch, 0, dp, 0)
        checkpoints.restore(TrainState(model, optimizer, sampler, mesh, cfg))
    finally:
        checkpoints.close()
    model.eval()
    return model


def evaluate_windows(
    model: ParallelModel, data: WindowSet, cfg: Config, batches: int | None = None
) -> EvalResult:
    """Mean loss of ``model`` over the windows of ``data`` (:func:`plait.data.eval_windows`;
    see the module docstring), in global batches of ``train.global_batch``; the same on
    every rank."""
    import torch

    from plait.train.data_reads import stage_parts, to_device

    mesh = model.mesh
    seq_len, batch = cfg.train.seq_len, cfg.train.global_batch
    parts = stage_parts(model)  # a pipeline stage reads only the halves it needs
    dp, r = mesh.size("dp"), mesh.index("dp")
    per = batch // dp
    total, count = 0.0, 0
    with torch.no_grad():
        for indices, weight in window_batches(len(data), batch, dp, batches):
            x, y = data.batch(indices[r * per : (r + 1) * per], parts)
            loss = model.evaluate(to_device(x, mesh.device), to_device(y, mesh.device))
            total += float(loss) * weight
            count += weight
    return EvalResult(total / max(1, count), count, seq_len)


def check_eval_data(data: WindowSet, cfg: Config, batches: int | None) -> int:
    """Refuse data without one window (or without ``batches`` global batches) of
    ``train.seq_len + 1`` tokens (token ids outside the vocabulary are refused by
    :func:`plait.data.eval_windows`); returns the number of windows."""
    seq_len, batch = cfg.train.seq_len, cfg.train.global_batch
    windows = len(data)
    if windows == 0:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than the data: {cfg.data.source} gives "
            f"{data.num_tokens} tokens and one window needs {seq_len} + 1; use a shorter "
            "--seq-len or more data."
        )
    if batches is not None and batches * batch > windows:
        raise ConfigError(
            f"--batches {batches} needs {batches} x {batch} (train.global_batch) windows of "
            f"{seq_len} + 1 tokens but {cfg.data.source} has {windows}; use --batches "
            f"{windows // batch} or fewer, or leave it out to evaluate every window."
        )
    return windows


def result_line(res: EvalResult, source: str, dropped: int) -> str:
    """The line ``plait eval`` prints: loss, perplexity, what was evaluated."""
    tail = f"; the last {dropped} token(s), a partial window, not evaluated" if dropped else ""
    return (
        f"plait: eval loss {res.loss:.6f}, perplexity {res.perplexity:.4f} over "
        f"{res.windows:,} windows of {res.seq_len} + 1 tokens ({res.tokens:,} predicted) "
        f"of {source}{tail}"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait eval",
        description=(
            "Mean next-token loss and perplexity of the model in --init-from (a checkpoint "
            "folder or consolidated weights file) over the windows tokens[i*S : i*S+S+1] "
            "of --data in file order, S = --seq-len. Layout flags and --config as for "
            "plait train (--nproc --dp --tp --pp --cp --zero, --model.* ...). With "
            "--tasks TASK_OR_YAML: lm-evaluation-harness tasks instead (plait eval --tasks "
            "x --help)."
        ),
    )
    p.add_argument("--config", metavar="PATH", help="TOML file with the run's configuration")
    p.add_argument(
        "--batches",
        type=int,
        metavar="N",
        help="evaluate only the first N global batches (train.global_batch windows each)",
    )
    return p


def _config(rest: Sequence[str]) -> tuple[Config, int | None]:
    """The run's config (the train command's flags and TOML) and ``--batches``."""
    from plait.cli.common import parse_run_flags
    from plait.config.coerce import config_from_dict
    from plait.config.toml_io import load_config_data

    overrides, ns = parse_run_flags(_parser(), rest)
    if ns.batches is not None and ns.batches <= 0:
        raise ConfigError(f"--batches must be positive, got {ns.batches}.")
    data = load_config_data(ns.config, overrides)
    data.setdefault("data", {}).setdefault("max_bytes", 0)  # the whole file
    from plait.cli.model_source import checkpoint_defaults
    from plait.cli.train import pretrained_defaults

    checkpoint_defaults(data, adapters=True)  # a plait checkpoint: its model, adapters, tokenizer
    pretrained_defaults(data)  # a Hugging Face folder: the sizes from its config.json
    cfg = config_from_dict(data)
    if not cfg.train.init_from:
        raise ConfigError(
            "plait eval needs --init-from PATH: a checkpoint folder, a consolidated "
            "weights file (plait checkpoint consolidate) or a Hugging Face model folder."
        )
    return cfg, ns.batches


def _eval(rest: Sequence[str]) -> int:
    """Validate, then evaluate here (one process, or a rank) or start the ranks."""
    from plait.cli.common import leave_torchrun_child, start_checks
    from plait.data import eval_windows
    from plait.launch.local import launch_local

    cfg, batches = _config(rest)
    env, world = start_checks(cfg)
    data = eval_windows(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    windows = check_eval_data(data, cfg, batches)
    if env is None and world > 1:
        return launch_local(world, ["eval", *rest])
    res = _run(cfg, env, data, batches)
    if env is None or env.rank == 0:
        packed = getattr(data, "efficiency", None) is not None  # whole windows: none cut
        cut = data.num_tokens - 1 - windows * cfg.train.seq_len
        dropped = cut if batches is None and not packed else 0
        print(result_line(res, cfg.data.source, dropped), flush=True)
    leave_torchrun_child(env)
    return 0


def _run(cfg: Config, env: RankEnv | None, data: WindowSet, batches: int | None) -> EvalResult:
    """Join the world (a rank), build the mesh, load and evaluate."""
    from plait.launch.worker import on_rank

    def evaluate(mesh: Mesh) -> EvalResult:
        return evaluate_windows(load_model(cfg, mesh), data, cfg, batches)

    return on_rank(cfg, env, evaluate)


def eval_main(rest: Sequence[str]) -> int:
    """``plait eval``; with ``--tasks``, lm-evaluation-harness tasks
    (:mod:`plait.cli.eval_tasks`)."""
    from plait.cli.common import run_as_rank

    if any(a == "--tasks" or a.startswith("--tasks=") for a in rest):
        from plait.cli.eval_tasks import eval_tasks_main

        return eval_tasks_main(rest)
    return run_as_rank(_eval, rest)
