"""LoRA's state bytes: the planner against the tensors the runtime allocates, per rank.

``parallelize(..., lora=...)`` on 2 gloo ranks (dp2 plain and ZeRO-1/3, tp2; fp32, and
bf16 with fp32 masters, where the frozen base is held in bf16) after one optimizer
step; each rank's exact bytes (:func:`plait.train.memory.memory_report`: weights, frozen
base included, gradients, masters, optimizer state) must equal the planner's
:func:`~plait.plan.memory.memory_per_rank` with ``Query.lora`` set: equality, no
tolerance. The rank (3) and the model make ZeRO pad every unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from plait.config import LoraConfig, ModelConfig
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout
from plait.plan.lora import LoraSpec
from plait.plan.memory import memory_per_rank
from plait.plan.modelspec import ModelSpec
from plait.plan.query import Query
from plait.testing import WorkerPool
from tests.plan.queries import MEMORY_ONLY

CFG = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
RANK, TARGETS = 3, "q,v,o,up,down"


def _body(ctx: Any, dp: int, tp: int, zero: int, dtype: str) -> dict[str, int]:
    import torch

    from plait.model import Transformer
    from plait.optim import Optimizer
    from plait.parallel.parallelize import parallelize
    from plait.train.memory import memory_report

    mesh = ctx.mesh(dp=dp, tp=tp)
    lora = LoraConfig(rank=RANK, alpha=6.0, targets=TARGETS)
    pm = parallelize(Transformer(CFG, seed=0), mesh, zero=zero, precision=dtype, lora=lora)
    trained = [p for p in pm.parameters() if p.requires_grad]
    opt = Optimizer(pm, torch.optim.AdamW(trained, lr=1e-3))
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    pm.step(x, x)
    opt.step()
    b = memory_report(pm, opt, mesh.rank).bytes
    return {
        "rank": mesh.index("dp"),
        "params": b["params"],
        "grads": b["grads"],
        "master": b["master"],
        "optimizer": b["optimizer"] + b["optimizer_scalars"],
    }


CASES = [  # (dp, tp, zero, dtype)
    (2, 1, 0, "fp32"),
    (2, 1, 1, "fp32"),
    (2, 1, 3, "bf16"),
    (1, 2, 0, "bf16"),
]


@pytest.mark.parametrize(("dp", "tp", "zero", "dtype"), CASES)
def test_lora_state_bytes_equal_the_planner(
    pools: Callable[[int], WorkerPool], dp: int, tp: int, zero: int, dtype: str
) -> None:
    results = pools(dp * tp).run(_body, dp, tp, zero, dtype)
    spec = ModelSpec.from_config(CFG)
    layout = Layout(dp=dp, tp=tp, zero=zero)
    precision = PRECISIONS["fp32" if dtype == "fp32" else "bf16-mixed"]
    q = Query.of_layout(
        spec,
        layout,
        MEMORY_ONLY,
        precision,
        RUNTIMES["plait"],
        8,
        0.0,
        None,
        LoraSpec(RANK, TARGETS),
    )
    for got in results:
        mem = memory_per_rank(q, layout, got["rank"])
        want = {"params": mem.params, "grads": mem.grads, "master": mem.master}
        want["optimizer"] = mem.optimizer
        assert {k: got[k] for k in want} == want, f"rank {got['rank']}"


def test_plan_cli_counts_lora(capsys: pytest.CaptureFixture[str]) -> None:
    """``plait plan --lora-rank`` reports the planner's LoRA memory (less state than full
    training of the same layout); a rank of 0 exits 2."""
    import json

    from plait.cli import main

    args = ["plan", "--model", "llama2-7b", "--devices", "8", "--zero", "1", "--json"]
    args += ["--global-batch", "8"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)["memory_bytes"]
    assert main([*args, "--lora-rank", "16", "--lora-targets", "q,v"]) == 0
    lora = json.loads(capsys.readouterr().out)["memory_bytes"]
    assert lora["state"] < full["state"] / 2  # 2-byte frozen base vs 4 + 12/8 bytes/param
    assert lora["activations"] == full["activations"]
    assert main([*args, "--lora-rank", "0"]) == 2
    assert "lora.rank must be >= 1" in capsys.readouterr().err
