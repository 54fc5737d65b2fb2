"""A rank reads only the halves of a batch it needs (issue 44): on every kind of window
set, the inputs alone, the targets alone (masks applied) and neither give exactly the
halves of a whole read, absent halves hold no storage, and the bytes counted are exactly
the tokens (and mask bytes) copied."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.config import DataConfig
from plait.data import TokenDataset, make_datasets, open_prepared
from plait.data.dataset import WindowSet
from plait.data.parts import BOTH, Parts, absent, is_absent
from plait.data.prepare import prepare
from plait.data.read_count import READ
from plait.data.sample_prepare import SampleOptions

SEQ = 16
INPUTS, TARGETS, NEITHER = Parts(targets=False), Parts(inputs=False), Parts(False, False)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A packed folder with a loss mask (uint8 beside the tokens)."""
    root = tmp_path_factory.mktemp("packed_parts")
    rng = np.random.default_rng(4)
    docs = ["".join(rng.choice(list("abcdefgh"), size=int(n))) for n in rng.integers(3, 15, 80)]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prepare(
        str(src),
        str(root / "out"),
        "byte",
        samples=SampleOptions(chat=False, pack=SEQ),
        shard_tokens=999,
    )
    return root / "out"


def _sets(byte_folder: Path, byte_folder_b: Path, packed: Path) -> dict[str, tuple[WindowSet, int]]:
    """Each kind of window set, with the bytes of one token (and its mask byte, if any)."""
    tokens = np.arange(2_000, dtype=np.uint16) % 251
    mix, _ = make_datasets(DataConfig(source=f"{byte_folder}:0.5,{byte_folder_b}:0.5"), SEQ, 256)
    return {
        "tokens": (TokenDataset(tokens, SEQ), 2),
        "prepared": (open_prepared(str(byte_folder), SEQ, 0.05)[0], 2),
        "packed": (open_prepared(str(packed), SEQ, None)[0], 2),
        "mixture": (mix, 2),
    }


def test_each_half_alone_equals_the_whole_read_and_counts_its_bytes(
    byte_folder: Path, byte_folder_b: Path, packed: Path
) -> None:
    for name, (data, item) in _sets(byte_folder, byte_folder_b, packed).items():
        idx = [7, 0, 3, 7, 11]
        masked = getattr(data, "masks", None) is not None
        before = READ.total
        x, y = data.batch(idx, BOTH)
        both = READ.total - before
        assert both == len(idx) * ((SEQ + 1) * item + (SEQ if masked else 0)), name
        if name == "packed":
            assert masked and bool((y == -100).any())  # the mask reached the targets
        before = READ.total
        xi, yi = data.batch(idx, INPUTS)
        assert READ.total - before == len(idx) * SEQ * item, name
        assert torch.equal(xi, x) and is_absent(yi) and yi.shape == y.shape
        before = READ.total
        xt, yt = data.batch(idx, TARGETS)
        assert READ.total - before == len(idx) * SEQ * (item + (1 if masked else 0)), name
        assert torch.equal(yt, y) and is_absent(xt) and xt.shape == x.shape
        before = READ.total
        xn, yn = data.batch(idx, NEITHER)
        assert READ.total - before == 0 and is_absent(xn) and is_absent(yn), name


def test_absent_parts_hold_no_storage() -> None:
    a = absent(64, 4096)
    assert a.shape == (64, 4096) and a.dtype == torch.long and is_absent(a)
    assert a.untyped_storage().nbytes() == 8
    assert not is_absent(torch.zeros(64, 4096, dtype=torch.long))
    assert Parts().span(SEQ) == (0, SEQ + 1) and INPUTS.span(SEQ) == (0, SEQ)
    assert TARGETS.span(SEQ) == (1, SEQ + 1) and NEITHER.span(SEQ) == (0, 0)
