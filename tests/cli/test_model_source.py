"""eval, generate, export and resume load the model a checkpoint's run trained.

A run started from a tiny Hugging Face Llama (dim 32, GQA 4:2, rope_theta 5000: not
plait's defaults) writes a checkpoint; ``plait eval --init-from CKPT`` (which built the
default model and failed on the first tensor's shape), ``plait generate``, ``plait
train --resume`` and ``plait checkpoint export`` then run without any model flag, and a
flag contradicting the checkpoint's shape is refused with one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import main
from tests.checkpoint.test_hf import make_hf_llama

pytest.importorskip("transformers")

RUN = ["--seq-len", "16", "--global-batch", "4", "--data.max_bytes", "20000", "--nproc", "1"]
RUN += ["--progress", "none", "--train.eval_every", "0", "--log.peak_tflops", "1"]


def test_commands_take_the_model_from_the_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    hf = make_hf_llama(tmp_path / "hf", tied=False)
    ckpt = tmp_path / "ckpt"
    first = ["--init-from", str(hf), "--steps", "1", "--train.checkpoint_dir", str(ckpt)]
    assert main(["train", *RUN, *first, "--log.dir", str(tmp_path / "a")]) == 0
    capfd.readouterr()

    evaluate = ["eval", "--init-from", str(ckpt), "--seq-len", "16", "--global-batch", "4"]
    evaluate += ["--data.max_bytes", "2000"]
    assert main(evaluate) == 0
    out = capfd.readouterr().out
    assert "plait: eval loss" in out

    assert main([*evaluate, "--model.dim", "64"]) == 2  # the checkpoint's dim is 32
    err = capfd.readouterr().err.strip()
    assert "--model.dim 64 contradicts the checkpoint" in err and "model.dim = 32" in err
    assert len(err.splitlines()) == 1

    gen = ["generate", "--init-from", str(ckpt), "--prompt", "The", "--max-new-tokens", "3"]
    assert main(gen) == 0
    assert capfd.readouterr().out.startswith("The")
    assert main([*gen, "--model.n_kv_heads", "4"]) == 2
    assert "--model.n_kv_heads 4 contradicts the checkpoint" in capfd.readouterr().err

    resume = ["--resume", "latest", "--train.checkpoint_dir", str(ckpt), "--steps", "2"]
    assert main(["train", *RUN, *resume, "--log.dir", str(tmp_path / "b")]) == 0
    rows = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [2]
    capfd.readouterr()
    assert main(["train", *RUN, *resume, "--steps", "3", "--model.n_layers", "4"]) == 2
    assert "--model.n_layers 4 contradicts the checkpoint" in capfd.readouterr().err

    out_dir = tmp_path / "export"
    assert main(["checkpoint", "export", str(ckpt), "-o", str(out_dir)]) == 0
    config = json.loads((out_dir / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["num_key_value_heads"] == 2
    assert config["rope_theta"] == 5000.0


def test_eval_and_generate_take_a_lora_runs_adapters(tmp_path: Path) -> None:
    """``checkpoint_defaults(..., adapters=True)`` (eval, generate) fills the ``lora``
    section of a LoRA run's checkpoint, without its ``init_from`` (the adapters are the
    checkpoint's tensors) or a newer writer's unknown fields; a given ``lora`` section
    wins; without ``adapters`` (train) nothing is filled."""
    from plait.checkpoint.format import FORMAT, METADATA, VERSION
    from plait.cli.model_source import checkpoint_defaults

    saved = {"rank": 8, "alpha": 4.0, "targets": "q,v", "dropout": 0.1}
    config = {"model": {"dim": 32}, "lora": {**saved, "init_from": "peft_dir", "newer": 1}}
    meta = {"format": FORMAT, "version": VERSION, "config": config}
    (tmp_path / METADATA).write_text(json.dumps(meta), "utf-8")

    def filled(adapters: bool, **more: object) -> dict[str, object]:
        data: dict[str, object] = {"train": {"init_from": str(tmp_path)}, **more}
        notes = checkpoint_defaults(data, adapters=adapters)
        assert ("LoRA rank 8 adapters" in " ".join(notes)) == (adapters and not more)
        return data

    assert filled(True)["lora"] == saved
    assert "lora" not in filled(False)
    assert filled(True, lora={"rank": 4})["lora"] == {"rank": 4}
