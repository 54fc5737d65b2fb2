"""Per-token log-probabilities and greedy decisions of a :class:`ParallelModel`, on its layout.

What an evaluation harness asks of a language model (:mod:`plait.train.lm_eval_adapter`):
for token sequences ``t_0 .. t_{L-1}``, ``log p(t_{i+1} | t_0..t_i)`` and whether
``t_{i+1}`` is the arg-max of the next-token distribution, for every ``i``.
:func:`score_sequences` returns both, the same on every rank of one replica:

* every rank of a replica (its tp, pp and cp ranks) feeds the same sequences: batches of
  up to ``batch`` rows, longest first, right-padded (a causal model's outputs at a
  position do not depend on what follows), their length rounded up to a multiple of
  ``2 · cp · tp`` (ring attention's zigzag halves; sequence parallelism's shards), their
  row count to a multiple of the pipeline's micro-batches;
* without a pipeline, the one-device model inside the data wrapper runs the batch (under
  ZeRO-3 with each unit gathered in turn by the forward, never the whole model); with
  one, the schedule's forward actions do, and the last stage scores each micro-batch in
  place of the loss (forward-only schedules reach the last stage's micro-batches in
  order) and broadcasts the scores over pp;
* the scores come from this rank's logits: under tp the vocabulary shard's maximum, sum of
  exponentials and target logit are all-reduced over tp (Megatron's vocabulary-parallel
  cross-entropy, per token) and the arg-max is the lowest vocabulary index reaching the
  maximum (``torch.argmax``'s tie rule), so the full logits are never gathered; under cp
  each rank scores its own positions, then the scores are all-gathered over cp and put
  back in sequence order;
* the data-parallel ranks score different sequences (the harness splits its requests by
  dp rank), so they may need different numbers of batches: the count is all-reduced
  (max) over dp and a rank with fewer runs one-row dummy batches, so that every
  collective a batch makes (ZeRO-3 gathers under a pipeline) is matched on every rank.

Every collective goes through :mod:`plait.comm`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from plait import comm
from plait.comm import AxisGroup
from plait.errors import ConfigError
from plait.model.factory import logits_of
from plait.parallel.model import ParallelModel


def pad_multiple(model: ParallelModel) -> int:
    """Sequence lengths are padded to a multiple of this: ``2 · cp · tp``."""
    mesh = model.mesh
    return 2 * mesh.size("cp") * mesh.size("tp") if mesh.size("cp") > 1 else mesh.size("tp")


def max_sequence(model: ParallelModel, max_seq_len: int) -> int:
    """The longest sequence a request may hold: ``max_seq_len`` rounded down to
    :func:`pad_multiple`."""
    m = pad_multiple(model)
    if max_seq_len < m:
        raise ConfigError(f"model.max_seq_len {max_seq_len} is shorter than {m} (2 x cp x tp).")
    return max_seq_len - max_seq_len % m


def vocab_scores(
    logits: torch.Tensor, targets: torch.Tensor, vocab: int, tp: AxisGroup | None
) -> torch.Tensor:
    """``(b, s, 2)`` float64: ``log softmax(logits)[target]`` and ``argmax == target`` (1/0)
    per position. ``logits`` ``(b, s, Vp/tp)`` hold this tp rank's columns of the padded
    vocabulary (``tp`` None: all of it); columns at or past ``vocab`` are padding.
    Targets outside ``[0, vocab)`` (padding) score 0."""
    x = logits.double()  # (b, s, shard)
    valid = (targets >= 0) & (targets < vocab)
    y = torch.where(valid, targets, 0)  # (b, s)
    if tp is None or tp.size == 1:
        x = x[..., :vocab]
        logp = torch.log_softmax(x, dim=-1).gather(-1, y[..., None])[..., 0]  # (b, s)
        greedy = (x.argmax(-1) == y).double()
    else:
        shard = x.shape[-1]
        start = tp.index * shard
        cols = torch.arange(start, start + shard, device=x.device)
        x = x.masked_fill(cols >= vocab, float("-inf"))
        local_max, local_arg = x.max(-1)  # (b, s): the first maximum of this shard
        top = local_max.clone()
        comm.all_reduce(top, tp, op="max")
        sums = torch.exp(x - top[..., None]).sum(-1)  # (b, s)
        comm.all_reduce(sums, tp)
        mine = (y >= start) & (y < start + shard)
        target = torch.where(
            mine, x.gather(-1, (y - start).clamp(0, shard - 1)[..., None])[..., 0], 0.0
        )
        comm.all_reduce(target, tp)
        logp = target - top - torch.log(sums)
        big = torch.iinfo(torch.long).max
        arg = torch.where(local_max == top, local_arg + start, big)
        comm.all_reduce(arg, tp, op="min")
        greedy = (arg == y).double()
    out = torch.stack([logp, greedy], dim=-1)  # (b, s, 2)
    return out.masked_fill(~valid[..., None], 0.0)


def _unshard_cp(model: ParallelModel, scores: torch.Tensor, seq: int) -> torch.Tensor:
    """This cp rank's ``(b, seq/cp, 2)`` scores -> the whole sequence's ``(b, seq, 2)``."""
    layout = model.context
    if layout is None or layout.cp == 1:
        return scores
    cp = model.mesh.axis("cp")
    positions = layout.shard(torch.arange(seq, device=scores.device)[None])[0]  # (seq/cp,)
    all_pos = comm.all_gather(positions, cp)  # (seq,)
    all_scores = comm.all_gather(scores.transpose(0, 1).contiguous(), cp)  # (seq, b, 2)
    assert isinstance(all_pos, torch.Tensor) and isinstance(all_scores, torch.Tensor)
    out = torch.empty_like(all_scores)
    out[all_pos] = all_scores
    return out.transpose(0, 1)


class _Scorer:
    """Runs one padded batch through the model and returns its ``(b, s, 2)`` scores."""

    def __init__(self, model: ParallelModel, vocab: int) -> None:
        self.model = model
        self.vocab = vocab
        mesh = model.mesh
        self.tp = mesh.axis("tp") if mesh.size("tp") > 1 else None
        self.rows = model.pipeline.schedule.microbatches if model.pipeline is not None else 1

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Scores of inputs ``x`` and targets ``y`` ``(b, s)`` (every rank of the replica)."""
        model, seq = self.model, x.shape[1]
        xs, ys = x, y
        if model.context is not None:
            xs, ys = model.context.shard(x), model.context.shard(y)
        if model.pipeline is None:
            logits = logits_of(model.data_wrapper.module(xs))  # (b, s/cp, V/tp)
            return _unshard_cp(model, vocab_scores(logits, ys, self.vocab, self.tp), seq)
        return self._pipeline(xs, ys, x.shape[0], seq)

    def _pipeline(self, xs: torch.Tensor, ys: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
        pipeline, model = self.model.pipeline, self.model
        assert pipeline is not None
        runtime = pipeline.runtime
        parts: list[torch.Tensor] = []

        def capture(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            parts.append(vocab_scores(logits, targets, self.vocab, self.tp))
            return logits.new_zeros((), dtype=torch.float32)

        saved = runtime.loss_fn
        runtime.loss_fn = capture
        try:
            pipeline.evaluate(xs, ys)
        finally:
            runtime.loss_fn = saved
        pp = model.mesh.axis("pp")
        out = torch.zeros((rows, seq, 2), dtype=torch.float64, device=model.mesh.device)
        if parts:  # the last stage
            out.copy_(_unshard_cp(model, torch.cat(parts), seq))
        comm.broadcast(out, pp, src=pp.size - 1)
        return out


def _batches(lengths: Sequence[int], batch: int) -> list[list[int]]:
    """Indices of the sequences, longest first, in groups of at most ``batch``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch] for i in range(0, len(order), batch)]


@torch.no_grad()
def score_sequences(
    model: ParallelModel, seqs: Sequence[Sequence[int]], vocab: int, batch: int = 8
) -> list[np.ndarray]:
    """For each sequence of ``L >= 2`` tokens, ``(L-1, 2)`` float64: the log-probability of
    token ``i+1`` after tokens ``0..i`` and whether it is the arg-max there (1/0); see the
    module docstring. Collective over the whole mesh; every rank of a replica passes the
    same ``seqs`` (the dp ranks may differ)."""
    if any(len(s) < 2 for s in seqs):
        raise ValueError("every scored sequence needs at least two tokens")
    if batch < 1:
        raise ConfigError(f"--batch-size must be positive, got {batch}.")
    mesh, scorer = model.mesh, _Scorer(model, vocab)
    groups = _batches([len(s) for s in seqs], batch)
    count = torch.tensor([len(groups)], dtype=torch.long, device=mesh.device)
    comm.all_reduce(count, mesh.axis("dp"), op="max")
    groups += [[]] * (int(count.item()) - len(groups))  # dummy batches: see the docstring
    mult, out = pad_multiple(model), [np.zeros((0, 2))] * len(seqs)
    was_training = model.training
    model.eval()
    try:
        # ZeRO-3: the forward gathers each unit in turn (as evaluate() does), never the
        # whole model at once
        for group in groups:
            rows = [list(seqs[i]) for i in group] or [[0, 0]]
            longest = max(len(r) for r in rows) - 1
            width = -(-longest // mult) * mult
            n = -(-len(rows) // scorer.rows) * scorer.rows
            x = torch.zeros((n, width), dtype=torch.long)
            y = torch.full((n, width), -100, dtype=torch.long)
            for k, r in enumerate(rows):
                x[k, : len(r) - 1] = torch.tensor(r[:-1])
                y[k, : len(r) - 1] = torch.tensor(r[1:])
            scores = scorer(x.to(mesh.device), y.to(mesh.device)).cpu().numpy()
            for k, i in enumerate(group):
                out[i] = scores[k, : len(seqs[i]) - 1]
    finally:
        model.train(was_training)
    return out
