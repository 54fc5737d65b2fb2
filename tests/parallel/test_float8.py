"""float8 training (torchao): refused with one line where it cannot run (on the CPU, on
a GPU below compute capability 8.9, without torchao: exit 2 before any rank starts);
on a float8 GPU (``gpu`` tests) the linear layers are converted (not the output head),
the tensor-parallel local product equals ``F.linear`` within float8 tolerance and a few
training steps track bf16."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.errors import ConfigError
from plait.parallel import float8
from plait.parallel.float8 import check_float8, float8_problem
from tests.tiny import run_plait, tiny_args

HAS_F8 = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability() >= (8, 9)
    and importlib.util.find_spec("torchao") is not None
)


def test_problems_name_the_cause() -> None:
    assert "on the CPU" in (float8_problem("cpu", None, True) or "")
    assert "has 8.0" in (float8_problem("cuda", (8, 0), True) or "")
    assert "torchao" in (float8_problem("cuda", (9, 0), False) or "")
    assert float8_problem("cuda", (8, 9), True) is None
    assert float8_problem("cuda", (9, 0), True) is None
    check_float8(False, "cpu")  # off: nothing to check


def test_without_torchao_on_a_float8_gpu_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(float8.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs torchao, which is not installed") as e:
        check_float8(True, "cuda")
    assert "\n" not in str(e.value)


def test_cli_refuses_float8_on_cpu_with_one_line(tmp_path: Path) -> None:
    args = ["train", "--nproc", "2", "--device", "cpu", "--steps", "1", *tiny_args()]
    r = run_plait([*args, "--precision.float8", "true"], tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "precision.float8 needs a CUDA GPU" in lines[0], r.stderr
    assert "rank" not in r.stderr  # refused in the launching process


needs_f8 = pytest.mark.skipif(not HAS_F8, reason="needs CUDA 8.9+ and torchao")


@pytest.mark.gpu
@needs_f8
def test_float8_matmul_close_to_linear() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16, generator=g)
    want = F.linear(x, w, b).float()
    got = float8.float8_matmul(256, 128)(x, w, b).float()
    rel = (got - want).norm() / want.norm()
    assert rel < 0.1, rel  # e4m3: ~2-3 significant bits


@pytest.mark.gpu
@needs_f8
def test_float8_training_tracks_bf16() -> None:
    from plait import init_mesh, parallelize
    from plait.config import ModelConfig, PrecisionConfig
    from plait.model import Transformer

    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=64)
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0)).cuda()
    losses = {}
    for f8 in (False, True):
        with torch.device("meta"):
            model = Transformer(cfg, seed=0)
        pm = parallelize(
            model, init_mesh(device="cuda"), precision=PrecisionConfig(dtype="bf16", float8=f8)
        )
        names = {type(m).__name__ for m in pm.modules()}
        assert ("Float8Linear" in names) == f8
        out_head = dict(pm.named_modules())
        assert all(
            type(m).__name__ != "Float8Linear" for n, m in out_head.items() if n.endswith("output")
        )
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        run = []
        for _ in range(20):
            run.append(float(pm.step(tokens[:, :-1], tokens[:, 1:])))
            opt.step()
            opt.zero_grad()
        losses[f8] = run
    assert losses[True][-1] < losses[True][0] - 0.5
    assert abs(losses[True][-1] - losses[False][-1]) < 0.1 * losses[False][-1], losses


def test_the_output_head_stays_in_high_precision_whatever_its_name() -> None:
    """plait's ``output``, Hugging Face's ``lm_head``, and a head only
    ``get_output_embeddings`` names are all kept out of float8; the blocks' layers are not."""
    from plait.config import ModelConfig
    from plait.model import Transformer

    class Named(torch.nn.Module):  # a model plait did not write, HF naming
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)
            self.lm_head = torch.nn.Linear(32, 64)

    class Getter(torch.nn.Module):  # its head under another name, as HF's API reports it
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)
            self.unembed = torch.nn.Linear(32, 64)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.unembed

    assert float8.high_precision_names(Named()) == {"lm_head"}
    assert float8.high_precision_names(Getter()) == {"unembed"}
    plait_model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2))
    assert float8.high_precision_names(plait_model) == {"output"}
