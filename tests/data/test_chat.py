"""Chat and instruction data: the prepared loss mask is exactly the assistant spans of the
template's rendering (with ``{% generation %}`` markers: equal to ``transformers``'
``return_assistant_tokens_mask``; without them, Llama 3's style: checked by hand), untrained
targets reach the loss as its ignore index (a one-token mask gives that token's gradient
only), through mixtures; bad input exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.cli import main
from plait.data import MixtureDataset, open_prepared, read_index
from plait.data.prepare import prepare
from plait.data.sample_prepare import SampleOptions

from .chat_fixtures import (
    BOS,
    EOS,
    EOT,
    LLAMA3,
    MARKED,
    REWRITES,
    conversations,
    tokenizer_folder,
    write_jsonl,
)

pytest.importorskip("transformers")


def samples_of(out: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every sample of an unpacked folder: ``(ids, mask)``."""
    idx = read_index(out)
    ids = np.concatenate([np.fromfile(out / s["file"], dtype=idx.dtype) for s in idx.shards])
    mask = np.concatenate([np.fromfile(out / m["file"], dtype=np.uint8) for m in idx.masks or []])
    ends = np.fromfile(out / "documents.bin", dtype=np.uint64).astype(np.int64)
    begins = np.concatenate([[0], ends[:-1]])
    return [(ids[a:b], mask[a:b]) for a, b in zip(begins, ends, strict=True)]


@pytest.fixture(scope="module")
def marked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("marked"), MARKED)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("llama3"), LLAMA3)


@pytest.mark.parametrize("train_on", ["assistant", "last"])
def test_mask_equals_transformers_generation_mask(
    marked: Path, tmp_path: Path, train_on: str
) -> None:
    from transformers import PreTrainedTokenizerFast

    convs = conversations()
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    prepare(str(src), str(tmp_path / "out"), f"hf:{marked}", samples=SampleOptions(True, train_on))
    got = samples_of(tmp_path / "out")
    hf = PreTrainedTokenizerFast.from_pretrained(str(marked))
    assert len(got) == len(convs)
    for (ids, mask), conv in zip(got, convs, strict=True):
        want = hf.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids[:-1].tolist() == list(want["input_ids"])  # then the separator
        assert ids[-1] == hf.convert_tokens_to_ids("<|end_of_text|>") and mask[-1] == 0
        ids, mask = ids[:-1], mask[:-1]
        expect = np.asarray(want["assistant_masks"], dtype=np.uint8)
        if train_on == "last":  # only the last marked run
            runs = np.flatnonzero(np.diff(np.concatenate([[0], expect])) == 1)
            expect[: runs[-1]] = 0
        assert mask.tolist() == expect.tolist()
        assert 0 < mask.sum() < len(mask)


def test_mask_of_a_template_without_markers_by_hand(llama3: Path, tmp_path: Path) -> None:
    """Llama 3's style: each assistant turn's content and its <|eot_id|> are trained, the
    rest (headers, user and system turns) is not; built piece by piece here."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(llama3))

    def enc(text: str) -> list[int]:
        return list(hf(text, add_special_tokens=False)["input_ids"])

    convs = conversations()
    records = [{"messages": c} for c in convs[:2]] + [{"prompt": "hello", "completion": "world"}]
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    prepare(str(src), str(tmp_path / "out"), f"hf:{llama3}")  # a chat file: told by its record
    got = samples_of(tmp_path / "out")
    as_messages = [
        *convs[:2],
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}],
    ]
    for (ids, mask), conv in zip(got, as_messages, strict=True):
        want_ids, want_mask = enc(BOS), [0]
        end = enc(EOS)  # the separator: <|end_of_text|>, the template writes no such token
        for m in conv:
            head = enc(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n")
            body = enc(m["content"] + EOT)
            want_ids += head + body
            want_mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
        want_ids, want_mask = want_ids + end, [*want_mask, 0]
        assert ids.tolist() == want_ids
        assert mask.tolist() == want_mask


def test_untrained_targets_are_ignored_through_mixtures(llama3: Path, tmp_path: Path) -> None:
    convs = conversations()
    for name in ("a", "b"):
        src = write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": c} for c in convs] * 3)
        prepare(str(src), str(tmp_path / name), f"hf:{llama3}")
    a, _ = open_prepared(str(tmp_path / "a"), 12, None)
    b, _ = open_prepared(str(tmp_path / "b"), 12, None)
    (ids, mask), *_ = samples_of(tmp_path / "a")
    x, y = a.batch([0])  # (1, 12) twice: targets are tokens 1..12
    want = torch.from_numpy(ids[1:13].astype(np.int64))
    want[torch.from_numpy(mask[1:13] == 0)] = -100
    assert torch.equal(y[0], want) and torch.equal(
        x[0], torch.from_numpy(ids[:12].astype(np.int64))
    )
    mix = MixtureDataset([a, b], [0.5, 0.5])
    for i in range(len(mix)):
        s, k = mix.locate(i)
        assert torch.equal(mix.batch([i])[1], (a, b)[s].batch([k])[1])
    assert (mix.batch(list(range(len(mix))))[1] == -100).any()


def test_one_trained_token_gives_that_tokens_gradient_only(llama3: Path, tmp_path: Path) -> None:
    """An empty assistant turn: its <|eot_id|> is the one trained token."""
    from plait.parallel.loss import cross_entropy_loss

    conv = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": ""}]
    src = write_jsonl(tmp_path / "one.jsonl", [{"messages": conv}])
    prepare(str(src), str(tmp_path / "out"), f"hf:{llama3}", samples=SampleOptions(True, pack=24))
    data, _ = open_prepared(str(tmp_path / "out"), 24, None)
    x, y = data.batch([0])  # (1, 24)
    kept = (y != -100).nonzero()
    assert len(kept) == 1
    t = int(kept[0, 1])
    assert int(y[0, t]) == 1  # <|eot_id|>, the reply's end (its content is empty)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(320, 16), torch.nn.Linear(16, 320)).double()
    grads = []
    for loss in (
        lambda: cross_entropy_loss()(model(x), y),
        lambda: torch.nn.functional.cross_entropy(model(x)[0, t : t + 1], y[0, t : t + 1]),
    ):
        model.zero_grad()
        loss().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g_mask, g_one in zip(*grads, strict=True):
        torch.testing.assert_close(g_mask, g_one, rtol=1e-12, atol=0)
    emb = grads[0][0]  # only the inputs at positions <= t reach the embedding (one here)
    assert set(emb.abs().sum(1).nonzero().flatten().tolist()) == {int(x[0, t])}


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    assert main(["data", "prepare", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for n in needles:
        assert n in err, err


def test_bad_chat_input_exits_2_with_one_line(
    llama3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = ["--tokenizer", f"hf:{llama3}", "-o", str(tmp_path / "out")]
    good = {"messages": conversations()[0]}
    role = write_jsonl(
        tmp_path / "role.jsonl", [good, {"messages": [{"role": "robot", "content": "x"}]}]
    )
    _refused([str(role), *tok], capsys, f"{role}:2", "unknown role 'robot'")
    field = write_jsonl(tmp_path / "field.jsonl", [good, good, {"prompt": "only a prompt"}])
    _refused([str(field), *tok], capsys, f"{field}:3", "no 'completion' field")
    content = write_jsonl(tmp_path / "content.jsonl", [{"messages": [{"role": "user"}]}])
    _refused([str(content), *tok], capsys, f"{content}:1", "no 'role' or no 'content'")
    plain = tokenizer_folder(tmp_path / "plain", None)
    _refused(
        [str(role), "--tokenizer", f"hf:{plain}", "-o", str(tmp_path / "o2")],
        capsys,
        "has no chat template",
        "--chat-template FILE",
    )
    qwen3 = tmp_path / "rewrites.jinja"
    qwen3.write_text(REWRITES)
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>hm</think>b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    think = write_jsonl(tmp_path / "think.jsonl", [{"messages": turns}])
    _refused(
        [str(think), *tok, "--chat-template", str(qwen3)], capsys, "rewrites earlier turns", "Qwen3"
    )
    assert not (tmp_path / "out").exists()
    text = tmp_path / "text.txt"
    text.write_text("plain text")
    _refused([str(text), *tok, "--train-on", "last"], capsys, "for chat data")


def test_template_file_overrides_and_info_reports(
    llama3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tokenizer_folder(tmp_path / "plain", None)
    template = tmp_path / "t.jinja"
    template.write_text(LLAMA3)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations()])
    out = tmp_path / "out"
    args = [
        "data",
        "prepare",
        str(src),
        "-o",
        str(out),
        "--tokenizer",
        f"hf:{plain}",
        "--chat-template",
        str(template),
        "--train-on",
        "all",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "3 chat samples" in printed and "--train-on all" in printed
    a = samples_of(out)
    prepare(str(src), str(tmp_path / "ref"), f"hf:{llama3}", samples=SampleOptions(True, "all"))
    for (i1, m1), (i2, m2) in zip(a, samples_of(tmp_path / "ref"), strict=True):
        assert i1.tolist() == i2.tolist() and m1.tolist() == m2.tolist()
        assert m1[0] == 0 and m1[1:-1].all() and m1[-1] == 0  # all but the ends
    assert main(args) == 0  # a finished folder is verified, not rewritten
    assert "already prepared" in capsys.readouterr().out
    assert main(["data", "info", str(out)]) == 0
    assert "trained tokens (--train-on all)" in capsys.readouterr().out
    assert json.loads((out / "index.json").read_text())["version"] == 2


def test_packed_chat_document_ids_are_the_samples(llama3: Path, tmp_path: Path) -> None:
    """Every conversation ends with the folder's end id (<|end_of_text|>, not the turns'
    <|eot_id|>), so the ids ``data.mask_documents`` derives from it equal the packed
    windows' sample numbers (up to the padding, whose tokens are each their own)."""
    from plait.model.document_mask import document_ids

    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations()] * 4)
    prepare(str(src), str(tmp_path / "out"), f"hf:{llama3}", samples=SampleOptions(True, pack=48))
    idx = read_index(tmp_path / "out")
    data, _ = open_prepared(str(tmp_path / "out"), 48, None)
    rows = list(range(len(data)))
    x, _ = data.batch(rows)
    want = data.documents(rows)  # (windows, 48)
    got = document_ids(x, idx.eos_id)
    for r in rows:
        real = int(torch.nonzero(x[r] != idx.eos_id).max()) + 2  # through the closing end id
        assert torch.equal(got[r][:real], want[r][:real])
        assert real >= 48 or int(want[r, real:].min()) > int(want[r, real - 1])  # padding
    assert idx.eos_id == 4 and (x == 1).any()  # <|end_of_text|> separates; <|eot_id|> inside
