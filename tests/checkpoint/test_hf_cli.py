"""``plait train / eval --init-from DIR`` with a Hugging Face folder, and the refusals.

One process, in this process: the model's sizes come from config.json (no --model.*
flag), the banner says so and the run trains from the pretrained weights. Bad inputs exit
2 with one line before any work: a folder without config.json, an unsupported
architecture, a shard named by the index but missing, a tensor of the wrong shape, a
flag that contradicts config.json; ``plait checkpoint export`` into a folder that is not
empty. ``plait eval`` of the folder equals transformers' loss over the same windows (one
process through the CLI; dp2×tp2 into both families through its Python API, rel 1e-5).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from plait.cli import main
from plait.cli.eval import _config as eval_config
from plait.cli.eval import evaluate_windows, load_model
from plait.data import eval_windows
from plait.testing import WorkerContext, WorkerPool
from tests.checkpoint.test_hf import make_hf_llama

transformers = pytest.importorskip("transformers")

RUN = [
    *["--seq-len", "16", "--global-batch", "8", "--data.max_bytes", "50000"],
    *["--train.eval_every", "0", "--progress", "lines", "--log.peak_tflops", "1"],
    *["--nproc", "1"],
]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("hf") / "llama", tied=False)


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("plait: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_train_from_hf_folder(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", *RUN, "--steps", "2", "--log.dir", str(tmp_path), "--init-from", str(src)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"model from {src}/config.json: 2 layers, dim 32, 4 heads (2 key/value)" in out
    assert f"started from the weights in {src}" in out
    # a flag that agrees with config.json, and a shorter max_seq_len, are fine
    more = ["--model.dim", "32", "--model.max_seq_len", "32", "--model.family", "hf-llama"]
    assert main([*args[:-2], "--steps", "1", *more, "--init-from", str(src)]) == 0


def test_bad_hf_folders_exit_2(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["train", *RUN, "--steps", "1", "--log.dir", str(tmp_path / "log"), "--init-from"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in _bad([*base, str(empty)], capsys)

    gemma = _copy(src, tmp_path / "gemma")
    cfg = json.loads((gemma / "config.json").read_text())
    cfg["architectures"] = ["Gemma3ForConditionalGeneration"]
    (gemma / "config.json").write_text(json.dumps(cfg))
    err = _bad([*base, str(gemma)], capsys)
    assert (
        "architecture Gemma3ForConditionalGeneration is not supported (it is a "
        "vision-language model" in err
    )
    assert "plait loads LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in err

    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (gemma / "config.json").write_text(json.dumps(cfg))
    err = _bad([*base, str(gemma)], capsys)
    assert "architecture GPTNeoXForCausalLM is not supported; plait loads LlamaForCausalLM" in err

    scaled = _copy(src, tmp_path / "scaled")
    cfg = json.loads((scaled / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5000.0}
    (scaled / "config.json").write_text(json.dumps(cfg))
    assert "RoPE scaling 'yarn' is not supported" in _bad([*base, str(scaled)], capsys)

    gone = _copy(src, tmp_path / "gone")
    shard = sorted(gone.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert f"shard {shard.name} named by model.safetensors.index.json is missing" in _bad(
        [*base, str(gone)], capsys
    )

    wrong = _copy(src, tmp_path / "wrong")
    index = json.loads((wrong / "model.safetensors.index.json").read_text())["weight_map"]
    file = wrong / index["model.layers.0.self_attn.k_proj.weight"]
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    err = _bad([*base, str(wrong)], capsys)
    assert "'model.layers.0.self_attn.k_proj.weight'" in err and "has shape [8, 32]" in err

    err = _bad([*base[:-1], "--model.dim", "64", "--init-from", str(src)], capsys)
    assert "model.dim = 64 contradicts" in err and "which has 32" in err
    err = _bad([*base[:-1], "--model.max_seq_len", "128", "--init-from", str(src)], capsys)
    assert "model.max_seq_len = 128 contradicts" in err


def test_export_refuses_a_folder_in_use(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    run = ["train", *RUN, "--steps", "1", "--log.dir", str(tmp_path / "log")]
    assert main([*run, "--train.checkpoint_dir", str(ck), "--init-from", str(src)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = _bad(["checkpoint", "export", str(ck), "--format", "hf", "-o", str(out)], capsys)
    assert "is not an empty folder" in err
    assert main(["checkpoint", "export", str(ck), "-o", str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "model.safetensors").is_file()  # one file: under 5 GB


def _hf_window_loss(folder: Path, data: Path, seq: int) -> float:
    """transformers' mean next-token loss over the windows ``tokens[i·seq : i·seq+seq+1]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    t = torch.tensor(list(data.read_bytes()))
    n = (len(t) - 1) // seq
    x = torch.stack([t[i * seq : i * seq + seq] for i in range(n)])  # (windows, seq)
    y = torch.stack([t[i * seq + 1 : i * seq + seq + 1] for i in range(n)])
    with torch.no_grad():
        logits = model(x).logits  # (windows, seq, vocab)
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))


def _eval_body(ctx: WorkerContext, args: list[str], layout: dict[str, int]) -> float:
    cfg, batches = eval_config(args)
    mesh = ctx.mesh(dp=ctx.world_size // layout.get("tp", 1), tp=layout.get("tp", 1))
    data = eval_windows(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    return evaluate_windows(load_model(cfg, mesh), data, cfg, batches).loss


def test_plait_eval_of_a_hf_folder_equals_transformers(
    pools: Callable[[int], WorkerPool],
    src: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "d.txt"
    data.write_bytes(bytes(range(32, 127)) * 3)  # 285 byte tokens: 17 windows of 16 + 1
    want = _hf_window_loss(src, data, 16)
    args = ["--init-from", str(src), "--data", str(data), "--seq-len", "16", "--global-batch", "4"]
    capsys.readouterr()
    assert main(["eval", *args, "--nproc", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("plait: eval loss ") and "over 17 windows of 16 + 1 tokens" in line
    assert float(line.split()[3].rstrip(",")) == pytest.approx(want, abs=1e-6)  # 6 decimals
    for layout in ({"tp": 2}, {"tp": 2, "family": 1}):
        more = ["--model.family", "hf-llama"] if layout.pop("family", 0) else []
        got = pools(4).run(_eval_body, [*args, *more, "--tp", "2"], layout)
        assert got == pytest.approx([want] * 4, rel=1e-5)  # dp2 x tp2


def test_plait_eval_of_a_hf_folder_under_torchrun(src: Path, tmp_path: Path) -> None:
    """As users launch it: ``torchrun --nproc-per-node 2 -m plait eval`` of a Hugging Face
    folder (transformers' own class, tp 2) prints transformers' loss (6 decimals)."""
    data = tmp_path / "d.txt"
    data.write_bytes(bytes(range(32, 127)) * 3)  # 17 windows of 16 + 1
    want = _hf_window_loss(src, data, 16)
    args = ["--init-from", str(src), "--data", str(data), "--seq-len", "16", "--global-batch", "2"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "plait",
            "eval",
            *args,
            "--model.family",
            "hf-llama",
            "--tp",
            "2",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("plait: eval loss "))
    assert "over 17 windows of 16 + 1 tokens" in line
    assert float(line.split()[3].rstrip(",")) == pytest.approx(want, abs=1e-6)
