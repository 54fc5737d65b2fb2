"""`plait plan`: the text report, the JSON schema, and bad input (exit code 2)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.cli import main
from plait.cli.plan import parse_count

NUM = (int, float)

ESTIMATE_SCHEMA: dict[str, Any] = {
    "schema": int,
    "kind": str,
    "model": {
        "name": str, "n_layers": int, "hidden": int, "n_heads": int, "n_kv_heads": int,
        "ffn_hidden": int, "vocab": int, "style": str, "max_positions": int,
        "tie_embeddings": bool, "params": int,
    },
    "hardware": str,
    "precision": str,
    "runtime": str,
    "seq_len": int,
    "layout": {
        "dp": int, "tp": int, "pp": int, "cp": int, "zero": int,
        "zero_shard_size": (int, type(None)),
        "micro_batch": int, "microbatches": int, "recompute": str, "schedule": str,
        "chunks": int, "sequence_parallel": bool, "cp_attention": str, "compression": str,
        "compression_ratio": float, "compression_rank": int, "world": int,
        "pp_grad_reduce": str, "pp_reshard": bool, "offload": str, "offload_nvme": bool,
        "edge_trim": int, "offload_delay": bool, "ep": int, "offload_two_pass": bool,
        "activation_offload": bool, "activation_offload_blocks": int,
    },
    "global_batch": int,
    "memory_bytes": {
        k: NUM
        for k in (
            "stage", "params", "grads", "master", "optimizer", "activations",
            "embedding_head", "buffers", "in_flight", "layer_activation", "host_activations",
            "state", "total",
        )
    },
    "usable_bytes": NUM,
    "fits": bool,
    "time_s": {
        k: NUM
        for k in (
            "compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "bubble", "dp_comm",
            "optimizer", "other", "dp_comm_total", "ep_comm", "total",
        )
    },
    "tokens_per_s": NUM,
    "mfu": NUM,
    "hfu": NUM,
}  # fmt: skip

SEARCH_SCHEMA: dict[str, Any] = {
    "schema": int,
    "kind": str,
    "query": {
        "model": ESTIMATE_SCHEMA["model"], "hardware": str, "devices": int,
        "global_batch": int, "seq_len": int, "precision": str, "runtime": str, "headroom": NUM,
        "moe": (dict, type(None)),
    },
    "evaluated": int,
    "rejected": dict,
    "rejected_examples": dict,
    "top": list,
    "explanation": str,
}  # fmt: skip


def _check(doc: Any, schema: Any, where: str = "$") -> None:
    if isinstance(schema, dict):
        assert isinstance(doc, dict), where
        assert set(doc) == set(schema), f"{where}: keys {sorted(set(doc) ^ set(schema))}"
        for k, sub in schema.items():
            _check(doc[k], sub, f"{where}.{k}")
    else:
        assert isinstance(doc, schema), f"{where}: {type(doc).__name__}"
        assert not (schema is int and isinstance(doc, bool)), where


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "plan", "--model", "llama2-7b", "--devices", "16", "--tp", "2", "--pp", "2",
        "--zero", "1", "--global-batch", "32", "--recompute", "selective", "--json",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    _check(doc, ESTIMATE_SCHEMA)
    assert doc["kind"] == "estimate" and doc["schema"] == 1
    assert doc["layout"]["dp"] == 4 and doc["layout"]["microbatches"] == 8
    t = doc["time_s"]
    parts = sum(v for k, v in t.items() if k not in ("total", "dp_comm_total"))
    assert parts == pytest.approx(t["total"])
    m = doc["memory_bytes"]
    assert m["total"] == pytest.approx(
        m["state"] + m["activations"] + m["embedding_head"] + m["buffers"]
    )


def test_search_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "plan", "--model", "gpt2-355m", "--devices", "8", "--global-batch", "16",
        "--search", "--top", "2", "--json",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    _check(doc, SEARCH_SCHEMA)
    assert len(doc["top"]) == 2
    for entry in doc["top"]:
        _check({"schema": 1, "kind": "estimate", **entry}, ESTIMATE_SCHEMA)
    assert doc["top"][0]["time_s"]["total"] <= doc["top"][1]["time_s"]["total"]


def test_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--layers", "4", "--hidden", "256", "--heads", "4",
                        "--vocab", "1000", "--seq", "128", "--hardware", "h100-80gb")  # fmt: skip
    assert code == 0
    for text in ("memory per rank", "optimizer state", "step time", "MFU", "fits"):
        assert text in out
    code, out, _ = _run(capsys, "plan", "--params", "1.3B", "--search", "--top", "2")
    assert code == 0 and "predicted fastest" in out
    code, out, _ = _run(capsys, "plan", "--list")
    assert code == 0 and "llama3-405b" in out and "h200" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-5"], "unknown model preset 'gpt-5'; choose one of tiny, small"),
        (
            ["--model", "small", "--hardware", "tpu"],
            "unknown hardware preset 'tpu'; choose one of a100-40gb, a100-80gb, h100-80gb, h200",
        ),
        (["--model", "small", "--seq", "0"], "--seq must be positive, got 0"),
        (["--model", "small", "--search", "--global-batch", "0"], "--global-batch must be"),
        (["--params", "1B", "--kv-heads", "-2"], "--kv-heads must be positive"),
        (["--model", "gpt2-124m", "--kv-heads", "5"], "--kv-heads only shape(s) a model"),
        (["--params", "1B", "--ffn", "100", "--style", "gpt"], "--ffn, --style only shape(s)"),
        (["--model", "small", "--headroom", "1.5"], "--headroom must be in [0, 1)"),
        (["--model", "tiny", "--devices", "6", "--tp", "4"], "does not divide the 6 devices"),
        (["--params=-3B"], "must be positive"),
        (["--params", "lots"], "cannot read 'lots'"),
        (["--layers", "0", "--hidden", "64", "--heads", "4", "--vocab", "10"], "--layers must"),
        (["--layers", "2", "--hidden", "64"], "needs all of"),
        (["--model", "small", "--devices", "0"], "--devices must be positive"),
        (["--model", "small", "--devices", "8", "--tp", "3"], "does not divide the 8 devices"),
        (["--model", "small", "--devices", "8", "--dp", "4"], "does not match the 8 devices"),
        (["--model", "small", "--devices", "8", "--tp", "8"], "tp=8 does not divide the 4 heads"),
        (["--model", "small", "--micro-batch", "0"], "--micro-batch must be positive"),
        (["--model", "small", "--zero", "5"], "invalid choice"),
        (["--model", "small", "--precision", "fp8"], "unknown precision 'fp8'"),
        (["--model", "small", "--hardware", "/nonexistent/x.toml"], "cannot read hardware"),
        (["--model", "small", "--model", "tiny", "--params", "1B"], "exactly one model"),
        (["--model", "small", "--devices", "4", "--dp", "4", "--ep", "2"], "needs a mixture-of"),
        (["--model", "small", "--search", "--ep", "2"], "needs a mixture-of-experts model"),
    ],
)
def test_bad_input_exits_2_with_one_paragraph(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = _run(capsys, "plan", *args)
    assert code == 2
    assert out == ""
    assert message in err
    assert err.startswith("plait: error: ") and err.count("\n") == 1


def test_parse_count() -> None:
    assert parse_count("7B") == 7e9
    assert parse_count("350m") == 350e6
    assert parse_count("1.5T") == 1.5e12
    assert parse_count("6.7e9") == 6.7e9


@pytest.mark.parametrize("command", [["bench", "calibrate"], ["calibrate"]])
def test_calibrate_refuses_bad_input(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    # `plait bench calibrate` (issue 6) and its alias `plait calibrate`
    code, _, err = _run(capsys, *command, "--nproc", "1")
    assert code == 2 and "at least 2" in err
    code, _, err = _run(capsys, *command, "--bogus")
    assert code == 2 and "plait bench calibrate: unrecognized arguments: --bogus" in err
    code, _, err = _run(capsys, *command, "--memory-gb", "-1")
    assert code == 2 and "--memory-gb must be positive" in err


def test_bench_lists_calibrate(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "bench", "--help")
    assert code == 0 and "calibrate" in err


def test_plan_takes_the_train_names_and_infers_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """`plait train`'s names for the same things give the same estimate as plan's own, and
    a layout with --dp and no --devices is a job of dp x tp x pp x cp devices."""
    plan_names = [
        *["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--zero-shard-size", "2"],
        *["--seq", "1024", "--global-batch", "16", "--micro-batch", "2", "--microbatches", "4"],
        *["--schedule", "interleaved", "--chunks", "2", "--recompute", "full"],
    ]
    train_names = [
        *["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2"],
        *["--parallel.zero", "1", "--parallel.zero_shard_size", "2", "--seq-len", "1024"],
        *["--train.global_batch", "16", "--train.micro_batch", "2"],
        *["--parallel.microbatches", "4", "--parallel.pipeline_schedule", "interleaved"],
        *["--parallel.chunks", "2", "--train.recompute", "full"],
    ]
    docs = []
    for names in (plan_names, train_names):
        code, out, err = _run(capsys, "plan", "--model", "llama2-7b", *names, "--json")
        assert code == 0, err
        docs.append(json.loads(out))
    assert docs[0] == docs[1]
    assert docs[0]["layout"]["world"] == 8 and docs[0]["layout"]["dp"] == 2
    assert docs[0]["layout"]["chunks"] == 2 and docs[0]["seq_len"] == 1024
    code, out, _ = _run(capsys, "plan", "--model", "tiny", "--dp", "1", "--json")
    assert code == 0 and json.loads(out)["layout"]["world"] == 1
    code, _, err = _run(capsys, "plan", "--model", "tiny", "--chunk", "2", "--chunkz", "2")
    assert code == 2 and "did you mean '--chunks'?" in err
