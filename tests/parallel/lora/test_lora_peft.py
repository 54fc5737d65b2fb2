"""LoRA adapters in PEFT's format: a run under tp2 exported with ``plait checkpoint
export --format peft`` loads with ``peft.PeftModel.from_pretrained`` onto the
``transformers`` base to plait's logits, ``--merge-lora`` writes weights that
``transformers`` alone runs to the same logits, and ``lora.init_from`` of an adapter
that ``peft`` made continues from it. Tolerance: float32 logits, 1e-5 absolute (the
paths differ in summation order only; a dropped or transposed factor moves them by
> 1e-3, checked against the base's logits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.checkpoint.hf import pretrained_config
from plait.checkpoint.peft_io import read_tensor
from plait.checkpoint.read import CheckpointReader
from plait.config import LoraConfig
from plait.mesh import init_mesh
from plait.model import Transformer
from plait.parallel.lora import apply_lora
from plait.parallel.parallelize import parallelize
from tests.checkpoint.test_hf import make_hf_llama
from tests.tiny import run_plait

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-5
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "q,v,o,down"]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(_tokens()).logits  # (2, 12, 256)
    return out


def _base(folder: Path) -> Transformer:
    """plait's one-device model with the Hugging Face folder's weights."""
    from safetensors.torch import load_file

    from plait.checkpoint.hf import hf_to_plait

    model = Transformer(pretrained_config(folder), seed=0)
    weights = load_file(str(folder / "model.safetensors"))
    state = {hf_to_plait(k): v for k, v in weights.items()}
    model.load_state_dict({k: v for k, v in state.items() if k is not None}, strict=True)
    return model.eval()


def test_tp2_run_exports_to_peft_and_merged(tmp_path: Path) -> None:
    """Train 2 steps with LoRA under tp2 from a Hugging Face folder; the adapter export
    loads with peft to plait's logits (from the checkpoint's tensors), the merged export
    runs in transformers to the same logits; exporting without --merge-lora is refused."""
    hf = make_hf_llama(tmp_path / "hf", tied=False, shard="1MB")
    args = ["train", "--init-from", str(hf), *LORA, "--nproc", "2", "--parallel.tp", "2"]
    args += ["--steps", "2", "--seq-len", "16", "--global-batch", "4", "--progress", "none"]
    args += ["--data.max_bytes", "50000", "--train.eval_every", "0", "--log.peak_tflops", "1"]
    args += ["--train.checkpoint_dir", "ck", "--log.dir", "run"]
    r = run_plait(args, tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    refused = run_plait(["checkpoint", "export", "ck", "-o", "plain"], tmp_path)
    assert refused.returncode == 2 and "--merge-lora" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    for extra in (["--format", "peft", "-o", "adapter"], ["--merge-lora", "-o", "merged"]):
        r = run_plait(["checkpoint", "export", "ck", *extra], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]

    reader = CheckpointReader(tmp_path / "ck" / "step_00000002")
    mine = _base(hf)
    apply_lora(mine, LoraConfig(rank=4, alpha=8.0, targets="q,v,o,down"), seed=0)
    mine.load_state_dict({n: read_tensor(reader, n) for n in reader.params}, strict=True)
    with torch.no_grad():
        ours = mine(_tokens())  # (2, 12, 256)

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    before = _hf_logits(base)
    with_peft = _hf_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter"))
    merged = _hf_logits(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    )
    assert (with_peft - before).abs().max() > 1e-3  # the adapter was trained
    torch.testing.assert_close(with_peft, ours, rtol=0, atol=TOL)
    torch.testing.assert_close(merged, ours, rtol=0, atol=TOL)


def test_init_from_a_peft_made_adapter(tmp_path: Path) -> None:
    """An adapter ``peft`` made (random A and B) and saved, given as lora.init_from:
    plait's model starts from exactly its factors and gives peft's logits."""
    hf = make_hf_llama(tmp_path / "hf", tied=False, shard="1MB")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    made = peft.get_peft_model(base, cfg)
    made.save_pretrained(tmp_path / "made")
    want = _hf_logits(made)

    lora = LoraConfig(rank=4, alpha=8.0, targets="q,v,gate", init_from=str(tmp_path / "made"))
    pm = parallelize(_base(hf), init_mesh(), lora=lora)
    with torch.no_grad():
        got = pm(_tokens())
    saved = {n: p for n, p in made.named_parameters() if "lora_" in n}
    a = dict(pm.named_parameters())["module.module.layers.1.attention.wv.lora_A.weight"]
    assert torch.equal(
        a, saved["base_model.model.model.layers.1.self_attn.v_proj.lora_A.default.weight"]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    """A LoRA run under ZeRO-1 dp2 (built-in model, fp32) saved at step 2 and resumed
    to step 4 ends with the same tensors, adapters, base and optimizer state, bit for
    bit, as the run that went through; its banner names the adapters' size."""
    from tests.tiny import tiny_args

    common = ["train", *tiny_args(50_000), *LORA, "--nproc", "2", "--parallel.zero", "1"]
    common += ["--steps", "4", "--train.checkpoint_every", "2"]
    r = run_plait([*common, "--train.checkpoint_dir", "a", "--log.dir", "ra"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = ["--train.resume", "a/step_00000002", "--train.checkpoint_dir", "b"]
    r = run_plait([*common, *resumed, "--log.dir", "rb"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from a/step_00000002 at step 2" in r.stdout + r.stderr
    one = CheckpointReader(tmp_path / "a" / "step_00000004")
    two = CheckpointReader(tmp_path / "b" / "step_00000004")
    assert sorted(one.params) == sorted(two.params)
    assert any(".lora_B." in n for n in one.params) and "output.weight" in one.params
    assert "exp_avg" in one.kinds("layers.0.attention.wq.lora_A.weight")
    adapters = sum(e.numel for n, e in one.params.items() if ".lora_" in n)
    line = f"LoRA rank 4, alpha 8 (scale 2) on q,v,o,down: {adapters:,} adapter parameters"
    assert line in r.stdout, r.stdout  # the banner says what is trained
    for name in one.params:
        for kind in one.kinds(name):
            numel = one.entry(name).numel
            a, b = one.read(name, kind, None, 0, numel), two.read(name, kind, None, 0, numel)
            assert torch.equal(a, b), f"{name} {kind}"
