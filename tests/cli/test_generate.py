"""`plait generate`: greedy text from a checkpoint equals a plain loop over the growing
sequence with the checkpoint's weights; the same tokens with and without the KV cache,
on every layout (tp2, dp2 with ZeRO-3, cp2) as on one process, sampled ones too; tp2
moves exactly the bytes of its formula; the trainer's ``log.sample_every`` line is the
same text; bad input exits 2 with one line.

Tolerance: none on tokens (identical), after checking that the reference's greedy
margin (top-1 minus top-2 logit) exceeds 1e-4 at every step, so a float32 rounding
difference between layouts cannot flip a token.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from plait import init_mesh
from plait.checkpoint import CheckpointReader, read_latest
from plait.cli import main
from plait.cli.eval import load_model
from plait.cli.generate import _config, encode_prompt, generate_on
from plait.config import Config, LogConfig
from plait.data import ByteTokenizer
from plait.model.factory import build_model
from plait.testing import WorkerContext, WorkerPool
from plait.train.sample import sample_tokens
from plait.train.trainer import Trainer
from tests.tiny import run_plait, tiny_config

M = "tests.cli.test_generate"
PROMPT = "def "
N = 12


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these tiny models run ~30x slower with two on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@dataclasses.dataclass(frozen=True)
class Run:
    root: Path
    cfg: Config
    sample_line: str


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Two steps of the tiny model, checkpointed, with a sample printed at step 2."""
    root = tmp_path_factory.mktemp("gen")
    base = tiny_config(steps=2)
    cfg = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, checkpoint_dir=str(root / "ck")),
        log=LogConfig(
            dir=str(root / "run"),
            progress="lines",
            peak_tflops=1.0,
            sample_every=2,
            sample_prompt=PROMPT,
            sample_tokens=N,
        ),
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer(cfg, init_mesh()).run()
    lines = [s for s in out.getvalue().splitlines() if s.startswith("plait: sample at step")]
    assert len(lines) == 1 and lines[0].startswith("plait: sample at step 2: ")
    return Run(root, cfg, lines[0])


def _args(run: Run, *more: str) -> list[str]:
    return [
        "--init-from",
        str(run.root / "ck"),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(N),
        *["--nproc", "1", "--launch.threads", "1"],
        *more,
    ]


def _plain(run: Run) -> list[int]:
    """The reference: the checkpoint's weights in a fresh one-device model, called on
    the whole growing sequence; arg-max of the last position."""
    folder = read_latest(run.root / "ck")
    assert folder is not None
    model = build_model(run.cfg.model, seed=99).eval()  # seed 99: only loading gives them
    missing, unexpected = model.load_state_dict(
        CheckpointReader(folder).model_state(), strict=False
    )
    assert not unexpected and set(missing) <= {"output.weight"}  # tied to the embedding
    seq = [int(i) for i in ByteTokenizer().encode(PROMPT)]
    with torch.no_grad():
        for _ in range(N):
            last = model(torch.tensor([seq]))[0, -1]  # (vocab,)
            top = torch.topk(last, 2).values
            assert float(top[0] - top[1]) > 1e-4  # no near-tie
            seq.append(int(torch.argmax(last)))
    return seq[len(PROMPT) :]


def test_greedy_from_a_checkpoint_equals_a_plain_loop(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    want = ByteTokenizer().decode([*ByteTokenizer().encode(PROMPT), *_plain(run)])
    # no model flags: the shape and tokenizer come from the checkpoint's metadata
    assert main(["generate", *_args(run)]) == 0
    out = capsys.readouterr()
    assert out.out == want + "\n"
    assert f"plait: generated {N} tokens in " in out.err and "KV cache" in out.err
    assert main(["generate", *_args(run, "--no-kv-cache")]) == 0
    assert capsys.readouterr().out == want + "\n"
    # the trainer's sample at step 2 (the checkpoint's step) is the same text
    assert ast.literal_eval(run.sample_line.split(": ", 2)[2]) == want


def _tokens(args: list[str], mesh_of: Callable[[Config], object] | None = None) -> list[int]:
    cfg, gen = _config(args)
    mesh = init_mesh() if mesh_of is None else mesh_of(cfg)
    return generate_on(mesh, cfg, gen, encode_prompt(cfg, gen)).tokens  # type: ignore[arg-type]


SAMPLED = ["--temperature", "1.0", "--top-k", "20", "--top-p", "0.95", "--seed", "5"]


def _body_layout(ctx: WorkerContext, args: list[str]) -> list[int]:
    def mesh_of(cfg: Config) -> object:
        p = cfg.parallel
        return ctx.mesh(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp)

    return _tokens(args, mesh_of)


@pytest.mark.parametrize(
    "layout",
    [["--tp", "2", "--dp", "1"], ["--dp", "2", "--zero", "3"], ["--cp", "2", "--dp", "1"]],
    ids=["tp2", "zero3-dp2", "cp2"],
)
def test_layouts_equal_one_process(
    run: Run, pools: Callable[[int], WorkerPool], layout: list[str]
) -> None:
    for extra in ([], SAMPLED):
        want = _tokens(_args(run, *extra))
        got = pools(2).run(f"{M}:_body_layout", _args(run, *extra, *layout))
        assert got == [want, want]
    assert _tokens(_args(run, *SAMPLED)) != _tokens(_args(run))  # sampling is not greedy


def _body_tp_traffic(ctx: WorkerContext, args: list[str]) -> dict[str, dict[str, float]]:
    cfg, gen = _config(args)
    mesh = ctx.mesh(dp=1, tp=2)
    model = load_model(cfg, mesh)
    mesh.stats.reset()
    sample_tokens(model, encode_prompt(cfg, gen), gen.settings)
    return mesh.stats.snapshot()


def test_tp2_traffic_matches_the_formula(run: Run, pools: Callable[[int], WorkerPool]) -> None:
    """Per rank, for P prompt tokens and N new ones (P + N - 1 tokens fed, float32):
    all-reduce over tp of each fed token's (dim,) activations after the embedding and
    after each layer's attention and MLP ((1 + 2L) calls per feed, bus 2(N-1)/N = 1 x
    the bytes); one all-gather of the last logits per new token (vocabulary 256, bus
    1/2 x 256 x 4 bytes); one broadcast of the chosen token (8 bytes)."""
    snap = pools(2).run(f"{M}:_body_tp_traffic", _args(run, "--tp", "2", "--dp", "1"))[0]
    m = run.cfg.model
    fed = len(PROMPT) + N - 1
    feeds = 1 + N - 1  # the prompt at once, then each new token but the last
    assert snap["tp/all_reduce"]["calls"] == (1 + 2 * m.n_layers) * feeds
    assert snap["tp/all_reduce"]["bytes"] == (1 + 2 * m.n_layers) * fed * m.dim * 4
    assert snap["tp/all_gather"]["calls"] == N
    assert snap["tp/all_gather"]["bytes"] == N * 256 * 4 / 2
    assert snap["tp/broadcast"]["calls"] == N and snap["tp/broadcast"]["bytes"] == N * 8
    others = set(snap) - {"tp/all_reduce", "tp/all_gather", "tp/broadcast"}
    assert all(snap[k]["bytes"] == 0 for k in others), snap


def test_launched_tp2_prints_the_one_process_text(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *_args(run)]) == 0
    one = capsys.readouterr().out
    two = run_plait(["generate", *_args(run, "--nproc", "2", "--tp", "2")], run.root)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one  # rank 0 alone prints


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--init-from", "nothing"], "no weights file or checkpoint at nothing"),
        (["--prompt", ""], "--prompt is empty"),
        (["--max-new-tokens", "40"], "the prompt's 4 tokens + 40 new ones exceed"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or positive"),
        (["--nproc", "2", "--pp", "2"], "pp = 2 splits it into stages"),
        (
            ["--nproc", "2", "--tp", "2", "--parallel.sequence_parallel", "true"],
            "set parallel.sequence_parallel = false",
        ),
        (["--prompt-text", "x"], "unknown option '--prompt-text'"),
    ],
    ids=[
        "missing-checkpoint",
        "empty-prompt",
        "beyond-context",
        "no-tokens",
        "top-p",
        "temperature",
        "pp2",
        "sequence-parallel",
        "unknown-flag",
    ],
)
def test_bad_input_exits_2_with_one_line(
    run: Run, capsys: pytest.CaptureFixture[str], change: list[str], message: str
) -> None:
    assert main(["generate", *_args(run, *change)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_init_from_and_prompt_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x"]) == 2
    assert "plait generate needs --init-from PATH" in capsys.readouterr().err
    assert main(["generate", "--init-from", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "plait: error: plait generate needs --prompt TEXT: the text to continue."


HF_FLAGS = [
    *["--model.family", "hf-llama", "--model.dim", "32", "--model.n_layers", "2"],
    *["--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.max_seq_len", "32"],
    *["--model.tie_embeddings", "false", "--model.init_std", "0.2"],
]


def _hf_args(root: Path, *more: str) -> list[str]:
    """A consolidated weights file of a seed-4 hf-llama model (names as transformers')."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from plait.cli.generate import _config as config_of

    weights = root / "hf.safetensors"
    if not weights.exists():
        cfg, _ = config_of([*HF_FLAGS, "--init-from", str(weights), "--prompt", PROMPT])
        torch.manual_seed(4)
        model = build_model(cfg.model, seed=4)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, weights)
    return [
        *HF_FLAGS,
        "--init-from",
        str(weights),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(N),
        *["--nproc", "1", "--launch.threads", "1"],
        *more,
    ]


def test_hf_llama_cache_no_cache_and_tp2_give_the_same_tokens(
    run: Run, pools: Callable[[int], WorkerPool]
) -> None:
    """model.family hf-llama decodes with transformers' DynamicCache: the tokens equal
    the recomputing decode's on one process, and tp2's (sharded through the Hugging Face
    tensor-parallel plan), greedy and sampled."""
    for extra in ([], SAMPLED):
        want = _tokens(_hf_args(run.root, *extra))
        assert _tokens(_hf_args(run.root, *extra, "--no-kv-cache")) == want
        tp2 = _hf_args(run.root, *extra, "--tp", "2", "--dp", "1")
        got = pools(2).run(f"{M}:_body_layout", tp2)
        assert got == [want, want]


def test_a_step_folder_with_a_newer_writers_model_fields_loads(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--init-from`` one step folder (not the run's folder); model fields this version
    does not know (a newer writer's) are not taken from its metadata."""
    import json
    import shutil

    folder = read_latest(run.root / "ck")
    assert folder is not None
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    meta = json.loads((copy / "metadata.json").read_text())
    meta["config"]["model"]["a_future_field"] = 3
    (copy / "metadata.json").write_text(json.dumps(meta))
    assert main(["generate", *_args(run)]) == 0
    want = capsys.readouterr().out
    assert main(["generate", *_args(run, "--init-from", str(copy))]) == 0
    assert capsys.readouterr().out == want
