"""`plait eval`: the mean loss over the file's windows, equal on every layout to a plain
one-process loop over the same windows with the same weights, and bad input refused
with exit code 2 and one line before any work.

Tolerance: float32, relative 1e-6 for the same layout, 1e-5 across layouts (they differ
only in summation order — tensor parallelism adds row-parallel partial sums, the ring
merges attention blocks, and MKL's float32 kernels may round by buffer alignment — which
moves each window's loss by a few ulps; a full run saw 1.7e-6 at tp2; the mean is
accumulated in float64; a wrong window or shard moves it by 1e-3 or more).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from plait import init_mesh
from plait.cli import main
from plait.cli.eval import EvalResult, _config, evaluate_windows, load_model, window_batches
from plait.config import ModelConfig
from plait.data import TokenDataset, eval_windows
from plait.mesh import Mesh
from plait.model.factory import build_model
from plait.testing import WorkerContext, WorkerPool
from tests.tiny import run_plait

M = "tests.cli.test_eval"
MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
FLAGS = [
    *["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4"],
    *["--model.n_kv_heads", "2", "--model.max_seq_len", "32", "--global-batch", "8"],
    *["--nproc", "1"],
]
SEQ = 16
WINDOWS = 8 * 3 + 3  # three whole batches, then a group of two windows and a single one
TOKENS = WINDOWS * SEQ + 1 + 5  # and a partial window of 5 tokens, not evaluated


def _files(root: Path) -> tuple[Path, Path]:
    """Weights of a seed-7 model (the run's own seed is 0: only loading gives them) and
    a text file of ``TOKENS`` byte tokens."""
    weights, data = root / "w.safetensors", root / "d.txt"
    if not weights.exists():
        model = build_model(MODEL, seed=7)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, weights)
        rng = np.random.default_rng(0)
        data.write_bytes(bytes(rng.integers(97, 123, TOKENS, dtype=np.uint8)))
    return weights, data


def _args(root: Path, *more: str) -> list[str]:
    weights, data = _files(root)
    return [*FLAGS, "--init-from", str(weights), "--data", str(data), "--seq-len", str(SEQ), *more]


def _plain_loss(data: Path) -> float:
    """The reference: the seed-7 model, one window at a time, mean of the window means."""
    model = build_model(MODEL, seed=7).eval()
    windows = TokenDataset(np.frombuffer(data.read_bytes(), dtype=np.uint8), SEQ)
    losses = []
    with torch.no_grad():
        for i in range(len(windows)):
            x, y = windows[i]
            logits = model(x[None])
            losses.append(float(F.cross_entropy(logits[0].float(), y)))
    assert len(losses) == WINDOWS
    return float(np.mean(np.asarray(losses, dtype=np.float64)))


def _evaluate(args: list[str], mesh: Mesh | None = None) -> EvalResult:
    """``plait eval ARGS`` through the Python API on ``mesh`` (default: one process)."""
    cfg, batches = _config(args)
    model = load_model(cfg, mesh or init_mesh())
    data = eval_windows(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    return evaluate_windows(model, data, cfg, batches)


def test_window_batches_cover_every_window_once() -> None:
    plan = window_batches(27, 8, 2)
    assert [w for _, w in plan] == [8, 8, 8, 2, 1]
    assert plan[3][0] == [24] * 4 + [25] * 4  # dp rank 0: window 24, rank 1: window 25
    assert plan[4][0] == [26] * 8
    assert window_batches(27, 8, 1) == [
        *window_batches(27, 8, 1, 3),
        *[([w] * 8, 1) for w in (24, 25, 26)],
    ]
    assert window_batches(27, 8, 4, batches=2) == [(list(range(8)), 8), (list(range(8, 16)), 8)]
    assert window_batches(3, 8, 2) == [([0] * 4 + [1] * 4, 2), ([2] * 8, 1)]


def test_one_process_equals_a_plain_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    want = _plain_loss(_files(tmp_path)[1])
    got = _evaluate(_args(tmp_path))
    assert got.windows == WINDOWS and got.tokens == WINDOWS * SEQ
    assert got.loss == pytest.approx(want, rel=1e-6)
    assert main(["eval", *_args(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"plait: eval loss {got.loss:.6f}, perplexity {got.perplexity:.4f} ")
    assert line.endswith(
        f"over {WINDOWS} windows of {SEQ} + 1 tokens ({WINDOWS * SEQ} predicted) of "
        f"{tmp_path / 'd.txt'}; the last 5 token(s), a partial window, not evaluated"
    )
    two = _evaluate(_args(tmp_path, "--batches", "2"))  # the first 16 windows only
    assert two.windows == 16 and two.loss != pytest.approx(got.loss, rel=1e-6)


def test_a_prepared_folder_is_streamed_window_by_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same tokens as a prepared folder (two shards, windows spanning them): the plain
    loop's loss (to the 6 printed decimals) and the text file's line, each window read from
    the memory maps as needed (the bytes counted are the evaluated windows', not the
    folder's); a mixture is refused before any work."""
    from plait.data.read_count import READ
    from tests.data.folders import write_prepared

    text = _files(tmp_path)[1]
    tokens = np.frombuffer(text.read_bytes(), dtype=np.uint8).astype(np.uint16)
    folder = write_prepared(tmp_path / "prepared", [tokens[:200], tokens[200:]], [len(tokens)])
    want = _plain_loss(text)
    before = READ.total
    one = _evaluate([*_args(tmp_path), "--data", str(folder), "--batches", "1"])
    assert READ.total - before == 8 * (SEQ + 1) * 2  # one batch of windows, uint16
    assert one.windows == 8
    assert main(["eval", *_args(tmp_path), "--data", str(folder)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(line.split("eval loss ")[1].split(",")[0]) == pytest.approx(want, abs=2e-6)
    assert line.endswith(
        f"over {WINDOWS} windows of {SEQ} + 1 tokens ({WINDOWS * SEQ} predicted) of {folder}; "
        "the last 5 token(s), a partial window, not evaluated"
    )
    mix = f"{folder}:0.5,{folder}:0.5"
    assert main(["eval", *_args(tmp_path), "--data", mix]) == 2
    assert "plait eval reads one source, not the mixture" in capsys.readouterr().err


def _body_layout(ctx: WorkerContext, root: str, layout: list[str]) -> float:
    args = _args(Path(root), *layout)
    cfg, _ = _config(args)
    p = cfg.parallel
    return _evaluate(args, ctx.mesh(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp)).loss


@pytest.mark.parametrize(
    "layout",
    [
        ["--dp", "2"],
        ["--dp", "2", "--zero", "3"],
        ["--tp", "2", "--dp", "1"],
        ["--pp", "2", "--dp", "1"],
        ["--cp", "2", "--dp", "1"],
    ],
    ids=["dp2", "zero3-dp2", "tp2", "pp2", "cp2"],
)
def test_layouts_equal_one_process(
    tmp_path: Path, pools: Callable[[int], WorkerPool], layout: list[str]
) -> None:
    want = _evaluate(_args(tmp_path)).loss
    for got in pools(2).run(f"{M}:_body_layout", str(tmp_path), layout):
        assert got == pytest.approx(want, rel=1e-5)


def test_launched_tp2_prints_the_one_process_line(tmp_path: Path) -> None:
    """`plait eval --nproc 2 --tp 2` through the launcher: rank 0 prints the line of one
    process (to its 6 printed decimals)."""
    one = run_plait(["eval", *_args(tmp_path)], tmp_path)
    two = run_plait(["eval", *_args(tmp_path, "--nproc", "2", "--tp", "2")], tmp_path)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("plait: eval loss") == 1
    a, b = (r.stdout.split("plait: eval loss ")[1].split(",")[0] for r in (one, two))
    assert float(a) == pytest.approx(float(b), abs=2e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--data", "missing.txt"], "data.source 'missing.txt' does not exist"),
        (["--seq-len", "1000", "--model.max_seq_len", "1024"], "--seq-len 1000 is longer than"),
        (["--batches", "4"], "--batches 4 needs 4 x 8 (train.global_batch) windows"),
        (["--init-from", "nothing"], "no weights file or checkpoint at nothing"),
    ],
    ids=["missing-data", "seq-len-too-long", "too-many-batches", "missing-weights"],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: list[str], message: str
) -> None:
    assert main(["eval", *_args(tmp_path, *change)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_init_from_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--data", "x.txt"]) == 2
    assert "plait eval needs --init-from PATH" in capsys.readouterr().err
