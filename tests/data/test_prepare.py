"""``plait data prepare``: complete shards and index, documents decoded back in order,
output independent of the worker count, resume after a kill, bad input refused (exit 2,
the file named)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from plait.cli import main
from plait.data import make_tokenizer, read_index
from plait.data.prepare import prepare
from plait.data.writer import KILL_AFTER_ENV


def decoded_documents(out: Path, spec: str) -> list[str]:
    """Every document of a prepared folder, decoded; each must end with eos."""
    idx = read_index(out)
    stream = np.concatenate([np.fromfile(out / s["file"], dtype=idx.dtype) for s in idx.shards])
    ends = np.fromfile(out / "documents.bin", dtype=np.uint64).astype(np.int64)
    assert len(stream) == idx.tokens and len(ends) == idx.documents and ends[-1] == idx.tokens
    tok = make_tokenizer(spec)
    docs, begin = [], 0
    for end in ends:
        assert stream[end - 1] == idx.eos_id  # the separator closes every document
        docs.append(tok.decode(stream[begin : end - 1]))
        begin = end
    assert int((stream == idx.eos_id).sum()) == idx.documents  # no other eos
    return docs


def shard_bytes(out: Path, index: bool = True) -> dict[str, bytes]:
    """Every file of a folder (but ``index.json``, which names the source, unless ``index``)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if index or p.suffix == ".bin"}


def test_text_folder_round_trip(
    bpe: Path, text_folder: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, docs = text_folder
    spec = f"hf:{bpe}"
    s = prepare(str(root), str(tmp_path / "out"), spec, shard_tokens=700)
    idx = read_index(tmp_path / "out")
    assert (s.documents, s.shards) == (len(docs), len(idx.shards)) and s.shards > 3
    assert idx.problems() == [] and idx.vocab_size == 400 and idx.dtype == "uint16"
    assert all(sh["tokens"] == 700 for sh in idx.shards[:-1])
    assert decoded_documents(tmp_path / "out", spec) == docs
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["index.json", "documents.bin", *(sh["file"] for sh in idx.shards)]
    )


def test_jsonl_same_for_any_worker_count(
    bpe: Path, jsonl_file: tuple[Path, list[str]], tmp_path: Path
) -> None:
    path, docs = jsonl_file
    spec = f"hf:{bpe}"
    one = prepare(str(path), str(tmp_path / "w1"), spec, workers=1, shard_tokens=500)
    three = prepare(str(path), str(tmp_path / "w3"), spec, workers=3, shard_tokens=500)
    assert (one.tokens, one.shards) == (three.tokens, three.shards)
    assert shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w3")
    assert decoded_documents(tmp_path / "w1", spec) == docs


def test_parquet_and_datasets_folder_equal_jsonl(
    bpe: Path, jsonl_file: tuple[Path, list[str]], tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, docs = jsonl_file
    spec = f"hf:{bpe}"
    prepare(str(path), str(tmp_path / "j"), spec, shard_tokens=500)
    pq.write_table(
        pa.table({"body": docs, "n": list(range(len(docs)))}),
        tmp_path / "d.parquet",
        row_group_size=7,
    )
    prepare(str(tmp_path / "d.parquet"), str(tmp_path / "p"), spec, fld="body", shard_tokens=500)
    assert shard_bytes(tmp_path / "j", False) == shard_bytes(tmp_path / "p", False)
    try:
        import datasets
    except ImportError:  # the optional extra: refused, naming the folder
        (tmp_path / "ds").mkdir()
        (tmp_path / "ds" / "state.json").write_text("{}")
        with pytest.raises(Exception, match="datasets package"):
            prepare(str(tmp_path / "ds"), str(tmp_path / "h"), spec)
        return
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    prepare(str(tmp_path / "ds"), str(tmp_path / "h"), spec, shard_tokens=500)
    assert shard_bytes(tmp_path / "j", False) == shard_bytes(tmp_path / "h", False)


def _killed_child(args: list[str]) -> None:
    os.environ[KILL_AFTER_ENV] = "5"  # SIGKILLs itself after its 5th shard
    main(args)


def test_killed_prepare_finishes_with_identical_shards(
    bpe: Path,
    jsonl_file: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = jsonl_file
    spec = f"hf:{bpe}"
    ref = tmp_path / "ref"
    prepare(str(path), str(ref), spec, workers=2, shard_tokens=400)
    out = tmp_path / "out"
    args = [
        "data",
        "prepare",
        str(path),
        "-o",
        str(out),
        "--tokenizer",
        spec,
        "--workers",
        "2",
        "--shard-tokens",
        "400",
    ]
    child = mp.get_context("fork").Process(target=_killed_child, args=(args,))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    assert not (out / "index.json").exists() and (out / "shard_00004.bin").exists()
    kept = {n: (out / n).stat().st_mtime_ns for n in (f"shard_{i:05d}.bin" for i in range(5))}
    assert main(args) == 0
    assert "5 kept from an earlier run" in capsys.readouterr().out
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # not rewritten
    assert shard_bytes(out) == shard_bytes(ref)
    # a finished folder: verified, nothing rewritten
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(args) == 0
    assert "already prepared and verified" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_damaged_folder_is_reported(
    bpe: Path,
    jsonl_file: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = jsonl_file
    out = tmp_path / "out"
    args = [
        "data",
        "prepare",
        str(path),
        "-o",
        str(out),
        "--tokenizer",
        f"hf:{bpe}",
        "--shard-tokens",
        "900",
    ]
    assert main(args) == 0
    shard = out / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["data", "info", str(out)]) == 2
    assert "shard_00001.bin: its SHA-256 differs" in capsys.readouterr().err
    assert main(args) == 2
    assert "damaged" in capsys.readouterr().err


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    assert main(["data", "prepare", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    for n in needles:
        assert n in err, err


def test_bad_input_exits_2_naming_the_file(
    bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = ["--tokenizer", f"hf:{bpe}", "-o", str(tmp_path / "out")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    _refused([str(bad), *tok], capsys, f"{bad}:2", "no field 'text'")
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps({"body": "b"}) + "\n")
    _refused([str(first), *tok], capsys, f"{first}:1", "no field 'text'")
    latin = tmp_path / "texts" / "latin1.txt"
    latin.parent.mkdir()
    latin.write_bytes("café".encode("latin-1"))
    _refused([str(latin), *tok], capsys, str(latin), "not UTF-8")  # a folder skips it
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    _refused([str(broken), *tok], capsys, str(broken), "not a readable parquet file")
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("x")
        locked.chmod(0)
        _refused([str(locked), *tok], capsys, str(locked), "cannot read")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused([str(empty), *tok], capsys, str(empty), "is empty")
    (tmp_path / "zero.txt").write_text("")
    _refused([str(tmp_path / "zero.txt"), *tok], capsys, "zero.txt", "empty")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    _refused([str(blank), *tok], capsys, str(blank), "no text")
    _refused([str(tmp_path / "missing.txt"), *tok], capsys, "missing.txt", "does not exist")
    _refused(
        [str(bad), "--tokenizer", f"hf:{tmp_path}", "-o", str(tmp_path / "o2")],
        capsys,
        "no tokenizer.json",
    )
    assert not (tmp_path / "out").exists()  # nothing left behind
    good = tmp_path / "good.txt"
    good.write_text("some text")
    _refused(
        [str(good), "--tokenizer", "byte", "-o", str(tmp_path)],
        capsys,
        str(tmp_path),
        "is not empty",
    )


def test_vocabulary_larger_than_the_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    vocab["[UNK]"] = 70_001
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    big = tmp_path / "big" / "tokenizer.json"
    big.parent.mkdir()
    tok.save(str(big))
    src = tmp_path / "a.txt"
    src.write_text("w1 w69999 w5")
    out = tmp_path / "out"
    _refused(
        [str(src), "-o", str(out), "--tokenizer", f"hf:{big.parent}", "--dtype", "uint16"],
        capsys,
        str(big),
        "does not fit the token dtype uint16",
    )
    s = prepare(str(src), str(out), f"hf:{big.parent}")  # chosen automatically: uint32
    assert s.dtype == "uint32" and decoded_documents(out, f"hf:{big.parent}") == ["w1 w69999 w5"]


def test_prepare_and_train_skip_the_same_files_and_prepare_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.data.corpus import sorted_files

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "__pycache__").mkdir()
    (src / ".git").mkdir()
    (src / "a.txt").write_text("first text")
    (src / "sub" / "b.py").write_text("print('second')")
    (src / "__pycache__" / "m.cpython-312.pyc").write_bytes(b"\x00\x01pyc")
    (src / ".git" / "HEAD").write_text("ref")
    (src / ".hidden.txt").write_text("hidden")
    (src / "blob.bin").write_bytes(b"\x89PNG\x00\x00data")
    (src / "latin1.txt").write_bytes("café".encode("latin-1"))
    out = tmp_path / "out"
    assert main(["data", "prepare", str(src), "-o", str(out), "--tokenizer", "byte"]) == 0
    printed = capsys.readouterr().out
    assert f"skipped 2 binary file(s) under {src}: blob.bin, latin1.txt" in printed
    assert decoded_documents(out, "byte") == ["first text", "print('second')"]
    assert sorted_files(src, None) == [src / "a.txt", src / "sub" / "b.py"]  # train's rule
