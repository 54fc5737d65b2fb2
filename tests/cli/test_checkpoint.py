"""``plait checkpoint info | consolidate`` and ``plait train --resume / --init-from``.

Everything runs in this process (one rank): a 2-step run writes two checkpoints, the
commands read them; bad input answers exit code 2 with one paragraph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from plait.checkpoint import CheckpointReader
from plait.cli import main
from tests.tiny import tiny_args

TINY = [*tiny_args(max_bytes=100_000), "--nproc", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ck")
    code = main(["train", *TINY, "--steps", "2", "--train.checkpoint_dir", str(d)])
    assert code == 0
    code = main(["train", *TINY, "--steps", "3", "--train.checkpoint_dir", str(d), "--resume"])
    assert code == 0
    return d


def test_info_describes_the_checkpoint(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["checkpoint", "info", str(root), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "step_00000003" in out and ": step 3 " in out
    assert "layout: world 1 = dp 1 x tp 1 x pp 1 x cp 1; zero 0; dtype fp32" in out
    assert "rank00000.safetensors" in out and "sha256" in out
    assert "layers.1.feed_forward.w2.weight  [32, 96]  float32  rank00000 [0:3072)" in out


def test_resume_flag_continues_from_latest(root: Path) -> None:
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000002", "step_00000003"]
    meta = CheckpointReader(root / "step_00000003").meta
    assert meta["config"]["train"]["resume"] == "latest"  # `--resume` alone
    assert meta["optimizer"]["steps"] == 3 and meta["sampler"]["step"] == 3


def test_consolidate_then_init_from(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "consolidate", str(root / "step_00000002"), "-o", str(out)]) == 0
    assert f"--init-from {out}" in capsys.readouterr().out
    with safe_open(str(out), framework="pt") as f:
        assert "tok_embeddings.weight" in f.keys()  # noqa: SIM118
        assert f.metadata()["step"] == "2"
    assert main(["train", *TINY, "--steps", "1", "--init-from", str(out)]) == 0
    assert f"started from the weights in {out}" in capsys.readouterr().out


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("plait: error: ") and "Traceback" not in err
    return err


def test_bad_input_is_one_paragraph(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    err = _bad(["train", *TINY, "--train.checkpoint_dir", str(empty), "--resume"], capsys)
    assert "there is no checkpoint" in err
    err = _bad(["train", *TINY, "--log.dir", str(tmp_path / "run"), "--resume"], capsys)
    assert "there is no checkpoint" in err and str(tmp_path / "run" / "checkpoints") in err
    err = _bad(["train", *TINY, "--init-from", str(tmp_path / "nope.safetensors")], capsys)
    assert "no weights file or checkpoint" in err
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(root / "step_00000003", copy)
    shard = copy / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = _bad(["checkpoint", "info", str(copy)], capsys)
    assert "rank00000.safetensors fails its checksum" in err


def test_consolidate_verifies_each_file_once(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI opens (and checksums) the checkpoint once and hands that reader on."""
    from plait.checkpoint import files

    seen: list[str] = []
    real = files.sha256_file

    def counted(path: Path) -> str:
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(files, "sha256_file", counted)
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "consolidate", str(root / "step_00000002"), "-o", str(out)]) == 0
    assert seen and len(seen) == len(set(seen)), seen
