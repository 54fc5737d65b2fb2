"""Every family plait loads, in and out: Qwen2, Qwen3, Phi-3, OLMo 2, Mistral, Gemma 2,
Gemma 3 (text) and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE.

Per family a tiny random model is made with transformers' own class (biases and norm
gains drawn at random, not the init's zeros and ones, so that a misplaced one shows;
Qwen3 with a head width of 16 where dim / heads is 8; Phi-3's fused tensors) and saved
with ``save_pretrained`` in several shards; nothing is downloaded. Checked:

* the float64 loss through the Python API (:func:`plait.checkpoint.load_hf_weights`)
  equals transformers' (rel 1e-10; OLMo 2 1e-9, see the test) in one process
  and under tp2 (the pool); the MoE families in one process and ep2, from the hub's
  per-expert layout and (ep2) from transformers 5's fused one, with the model-wide
  load-balancing loss equal to transformers' ``aux_loss`` and each ep rank reading
  only its experts' bytes;
* greedy generation (plait's KV-cache decoder) equals transformers' ``generate`` tokens
  (float64, no near-tie: the top-2 margin of every step exceeds 1e-4);
* ``plait checkpoint export --format hf`` after one training step (one process; Phi-3
  also trained under tp2) writes a folder transformers loads to the plait model's logits;
* every spec round-trips config.json -> ModelConfig -> config.json: each entry plait
  writes equals transformers' own, and transformers reads plait's back to the same
  fields;
* refusals: an unknown architecture names the supported ones, a known family's
  unsupported feature is named, a fused tensor of the wrong shape names both shapes.
The Mistral model's window (64) is longer than the sequences: sliding windows are
another module's (model.sliding_window is carried over, not applied here). The Gemma
models' windows (6) are shorter than the sequences (16), their caps small enough to bind
(Gemma 2: attention 5, final 3), query_pre_attn_scalar (12) other than the head width
(16); Gemma 3 has a sliding layer (local RoPE base 100) and a full one (linear RoPE
scaling, factor 2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.arch.families import FAMILIES, REFUSED
from plait.arch.spec import expert_tensors, plait_shapes
from plait.checkpoint import CheckpointError, export_hf, load_hf_weights, pretrained_config
from plait.checkpoint.hf import hf_config, model_fields
from plait.config import ModelConfig, ParallelConfig
from plait.errors import ConfigError
from plait.mesh import init_mesh
from plait.model.factory import build_model
from plait.model.generate import SampleSettings, generate, make_decoder
from plait.parallel.parallelize import parallelize
from plait.testing import WorkerContext, WorkerPool
from tests.checkpoint.test_hf import TINY_HF, _fp64_body, fp64_import, hf_loss, tokens
from tests.checkpoint.test_hf_export import _plait_logits, _train_body

transformers = pytest.importorskip("transformers")

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 16, "attention_bias": True}),
    "phi3": ("Phi3", {}),
    "olmo2": ("Olmo2", {}),
    "mistral": ("Mistral", {"sliding_window": 64}),
    "mixtral": ("Mixtral", {**_MOE, "num_local_experts": 4}),
    "qwen2-moe": (
        "Qwen2Moe",
        {
            **_MOE,
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 2,  # layer 0 dense, layer 1 MoE
        },
    ),
    "qwen3-moe": (
        "Qwen3Moe",
        {
            **_MOE,
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "head_dim": 16,
            "norm_topk_prob": True,
        },
    ),
    "gemma2": (
        "Gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 12,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "sliding_window": 6,
        },
    ),
    "gemma3": (
        "Gemma3",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 12,
            "final_logit_softcapping": 3.0,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            },
        },
    ),
}
"""transformers' class prefix and the extra config of each family's tiny model."""

MOE = ["mixtral", "qwen2-moe", "qwen3-moe"]
DENSE = [f for f in CONFIGS if f not in MOE]


def hf_config_of(family: str) -> Any:
    """transformers' config of the tiny model of ``family``."""
    prefix, extra = CONFIGS[family]
    cls = getattr(transformers, "Gemma3TextConfig" if family == "gemma3" else f"{prefix}Config")
    return cls(**TINY_HF, **IDS, rope_theta=5000.0, rms_norm_eps=1e-6, **extra)


def make_family(folder: Path, family: str, seed: int = 0) -> Path:
    """The tiny random model of ``family`` saved in ``folder`` in several shards."""
    torch.manual_seed(seed)
    cfg = hf_config_of(family)
    model = getattr(transformers, f"{CONFIGS[family][0]}ForCausalLM")(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            if name.endswith(".gate.weight"):  # routers: clear top-k choices, no near-ties
                p.copy_(torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="20KB")  # MoE: the hub's per-expert names
    if family in MOE:  # transformers 5's in-memory layout (fused experts) beside it
        from safetensors.torch import save_file

        fused = folder.parent / f"{folder.name}-fused"
        fused.mkdir()
        (fused / "config.json").write_bytes((folder / "config.json").read_bytes())
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {f: make_family(root / f, f, seed=i) for i, f in enumerate(CONFIGS)}
    return {**out, **{f"{f}-fused": root / f"{f}-fused" for f in MOE}}


def test_every_family_is_specified_and_tested() -> None:
    assert sorted(FAMILIES) == sorted([*CONFIGS, "llama"])  # Llama: tests/checkpoint/test_hf.py


@pytest.mark.parametrize("family", list(CONFIGS))
def test_loads_with_several_shards_into_the_family_features(
    dirs: dict[str, Path], family: str
) -> None:
    assert len(list(dirs[family].glob("*.safetensors"))) > 2
    cfg = pretrained_config(dirs[family])
    assert cfg.arch == family
    want = {
        "qwen2": {"attention_bias": "qkv"},
        "qwen3": {"attention_bias": "qkvo", "qk_norm": "head", "head_width": 16},
        "phi3": {},
        "olmo2": {"qk_norm": "projection", "norm_placement": "post"},
        "mistral": {"sliding_window": 64},
        "mixtral": {"moe_experts": 4, "moe_every": 1, "moe_norm_topk_prob": True},
        "qwen2-moe": {
            "attention_bias": "qkv",
            "moe_every": 2,
            "moe_shared_experts": 2,
            "moe_shared_expert_gate": True,
            "moe_norm_topk_prob": False,
        },
        "qwen3-moe": {"qk_norm": "head", "head_width": 16, "moe_norm_topk_prob": True},
        "gemma2": {
            "norm_placement": "sandwich",
            "norm_unit_offset": True,
            "embedding_scale": True,
            "activation": "gelu_tanh",
            "query_pre_attn_scalar": 12.0,
            "attn_logit_softcap": 5.0,
            "final_logit_softcap": 3.0,
            "layer_types": ("sliding_attention", "full_attention"),
            "tie_embeddings": True,
        },
        "gemma3": {
            "qk_norm": "head",
            "query_pre_attn_scalar": 12.0,
            "attn_logit_softcap": None,
            "rope_local_theta": 100.0,
            "rope_scaling": "linear",
            "rope_factor": 2.0,
        },
    }[family]
    assert {k: getattr(cfg, k) for k in want} == want
    assert (cfg.rope_theta, cfg.norm_eps, cfg.kv_heads) == (5000.0, 1e-6, 2)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"tp": 2})], ids=["1", "tp2"])
@pytest.mark.parametrize("family", DENSE)
def test_float64_loss_equals_transformers(
    pools: Callable[[int], WorkerPool],
    dirs: dict[str, Path],
    family: str,
    world: int,
    layout: dict[str, int],
) -> None:
    folder = str(dirs[family])
    want = hf_loss(dirs[family], torch.float64)
    got = (
        [_fp64_body(None, folder, layout)]
        if world == 1
        else pools(world).run(_fp64_body, folder, layout)
    )
    # OLMo 2: its post-norms round their outputs to float32 (as transformers' do) right
    # on the residual stream, so a last-bit difference before them (the RoPE tables:
    # transformers computes the angles in float32, plait in float64; the q/k norm's sum
    # of squares: plait in float64, for tp) flips some float32 bits: seen at 2e-10
    # relative; a wrong norm moves the loss by 1e-3 or more. Gemma's norms compute in
    # float32 whatever the model's dtype (transformers' Gemma2RMSNorm casts x.float()), on
    # all four norms of every block: seen from 3.5e-10 to 1.2e-9 as the random weights
    # change, so 1e-8 (a wrong feature moves the loss by 1e-3 or more)
    rel = {"olmo2": 1e-9, "gemma2": 1e-8, "gemma3": 1e-8}.get(family, 1e-10)
    for loss in got:
        assert loss == pytest.approx(want, rel=rel)


def hf_moe_reference(folder: Path) -> tuple[float, float]:
    """transformers' float64 loss of :func:`tokens` and its ``aux_loss`` (the
    load-balancing loss over every MoE layer, ``output_router_logits=True``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float64,
        experts_implementation="eager",  # no float64 grouped_mm
    )
    x, y = tokens()
    with torch.no_grad():
        out = model(x, output_router_logits=True)
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))
    return float(loss), float(out.aux_loss)


def _moe_body(ctx: WorkerContext | None, folder: str, layout: dict[str, int]) -> dict[str, Any]:
    """The float64 import of an MoE family: the loss, this rank's part of the model-wide
    load-balancing loss (the mean over ranks is the global batch's) and the bytes read."""
    pm, loss, read = fp64_import(ctx, folder, layout)
    share = next(m.aux_share for m in pm.modules() if getattr(m, "aux_share", None) is not None)
    return {"loss": loss, "aux": float(share.loss()), "read": read}


@pytest.mark.parametrize(
    "world,layout,fused",
    [(1, {}, False), (2, {"ep": 2}, False), (2, {"ep": 2}, True)],
    ids=["1", "ep2", "ep2-fused"],
)
@pytest.mark.parametrize("family", MOE)
def test_moe_float64_loss_and_aux_equal_transformers(
    pools: Callable[[int], WorkerPool],
    dirs: dict[str, Path],
    family: str,
    world: int,
    layout: dict[str, int],
    fused: bool,
) -> None:
    """Mixtral, Qwen2-MoE, Qwen3-MoE imported into plait's MoE (ep2: each rank holds and
    reads 2 of the 4 experts of every MoE layer) compute transformers' loss and
    load-balancing loss; the fused folder (transformers 5's in-memory names) the same."""
    folder = dirs[f"{family}-fused" if fused else family]
    want, want_aux = hf_moe_reference(dirs[family])
    got = (
        [_moe_body(None, str(folder), layout)]
        if world == 1
        else pools(world).run(_moe_body, str(folder), layout)
    )
    # transformers routes in float32 even in a float64 model (softmax of .float() logits,
    # the top-k weights cast back): seen at 4e-11 relative on the loss; a wrong router,
    # expert or transpose moves it by 1e-3 or more
    for r in got:
        assert r["loss"] == pytest.approx(want, rel=1e-10)
    # its load-balancing loss sums the probabilities in float32: seen at 5e-8
    aux = sum(r["aux"] for r in got) / len(got)
    assert aux == pytest.approx(want_aux, rel=1e-6)
    cfg = pretrained_config(folder)
    bytes_of = {n: 4 * math.prod(shape) for n, shape in plait_shapes(cfg).items()}
    total = sum(bytes_of.values())
    experts = {n: b for n, b in bytes_of.items() if n in expert_tensors(FAMILIES[cfg.arch], cfg)}
    # ep2, hub layout: each rank reads its half of every expert tensor, nothing else of
    # them; fused: its rows of gate_up_proj for w1 and again for w3, of down_proj once
    skipped = sum(experts.values()) * (world - 1) // world
    if fused:
        skipped = sum(b for n, b in experts.items() if n.endswith("w2")) * (world - 1) // world
    for r in got:
        assert r["read"] == total - skipped


@pytest.mark.parametrize("family", MOE)
def test_spec_shapes_are_the_models(dirs: dict[str, Path], family: str) -> None:
    """The spec's parameter shapes (what import and export check) are the built-in
    transformer's, MoE layers included (Qwen2-MoE: a dense layer, then an MoE one)."""
    cfg = pretrained_config(dirs[family])
    with torch.device("meta"):
        model = build_model(cfg, seed=0)
    assert plait_shapes(cfg) == {n: list(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", MOE)
def test_moe_refusals(dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    """transformers' own class is refused for the MoE families (before any rank); a folder
    whose experts contradict config.json names the tensor and both shapes."""
    from plait.config import Config, TrainConfig
    from plait.parallel.checks import validate_run

    cfg = Config(
        model=pretrained_config(dirs[family], family="hf"),
        train=TrainConfig(global_batch=2, seq_len=16),
    )
    with pytest.raises(ConfigError, match="not wired for plait's mixtures of experts"):
        validate_run(cfg, 1)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in dirs[family].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    hf = json.loads((bad / "config.json").read_text())
    key = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    hf[key] *= 2
    (bad / "config.json").write_text(json.dumps(hf))
    from plait.checkpoint.hf_read import open_hf

    with pytest.raises(CheckpointError, match=r"experts\.\d+\..*has shape \[\d+, \d+\].*implies"):
        open_hf(bad)


HF_LAYOUTS = [(f, 1, {}) for f in DENSE] + [
    (f, 2, {"tp": 2}) for f in ("qwen2", "qwen3", "mistral")
]


@pytest.mark.parametrize("family,world,layout", HF_LAYOUTS, ids=lambda v: str(v))
def test_transformers_own_class_equals_transformers(
    pools: Callable[[int], WorkerPool],
    dirs: dict[str, Path],
    family: str,
    world: int,
    layout: dict[str, int],
) -> None:
    """model.family 'hf': transformers' own class of the family, loaded rank-locally by
    its own names (Phi-3's fused tensors whole), in one process and tp2 (Qwen3's per-head
    q/k norms replicated, their gradients summed)."""
    folder = str(dirs[family])
    want = hf_loss(dirs[family], torch.float64)
    got = (
        [_fp64_body(None, folder, layout, family="hf")]
        if world == 1
        else pools(world).run(_fp64_body, folder, layout, family="hf")
    )
    # Gemma: transformers' class built from the config and cast to float64 is not bit for
    # bit the one from_pretrained builds in float64 (seen at 2.5e-9; plait's own path is
    # checked at 1e-9 above); a missing feature moves the loss by 1e-3 or more
    rel = 1e-8 if family.startswith("gemma") else 1e-12
    for loss in got:
        assert loss == pytest.approx(want, rel=rel)


@pytest.mark.parametrize("family", ["phi3", "olmo2", "gemma2"])
def test_transformers_own_class_refuses_tp_by_name(dirs: dict[str, Path], family: str) -> None:
    from plait.config import Config, TrainConfig
    from plait.parallel.checks import validate_run

    cfg = Config(
        model=pretrained_config(dirs[family], family="hf"),
        parallel=ParallelConfig(tp=2),
        train=TrainConfig(global_batch=2, seq_len=16),
    )
    with pytest.raises(ConfigError, match=f"model.arch {family}: .* Use model.family 'plait'"):
        validate_run(cfg, 2)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_generation_equals_transformers(dirs: dict[str, Path], family: str) -> None:
    folder = dirs[family]
    prompt, n = [5, 17, 99, 3], 8
    moe = {"experts_implementation": "eager"} if family in MOE else {}  # float64: no grouped_mm
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **moe)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    for scores in out.scores:  # (1, vocab) per step: no near-tie
        top = torch.topk(scores[0], 2).values
        assert float(top[0] - top[1]) > 1e-4
    want = out.sequences[0, len(prompt) :].tolist()
    model = build_model(pretrained_config(folder), seed=0).double()
    pm = parallelize(model, init_mesh(), ParallelConfig())
    load_hf_weights(pm, folder)
    decoder = make_decoder(model, len(prompt) + n)
    assert generate(decoder, prompt, SampleSettings(max_new_tokens=n)) == want


@pytest.mark.parametrize(
    "family,world,layout",
    [(f, 1, {}) for f in CONFIGS] + [("phi3", 2, {"tp": 2})],
    ids=lambda v: str(v),
)
def test_export_round_trip(
    pools: Callable[[int], WorkerPool],
    dirs: dict[str, Path],
    tmp_path: Path,
    family: str,
    world: int,
    layout: dict[str, int],
) -> None:
    """One training step, checkpointed, exported: transformers loads the family's folder
    (its own config.json and names) to the plait model's logits."""
    root = tmp_path / "ck"
    if world == 1:
        _train_one(str(dirs[family]), str(root))
    else:
        pools(world).run(_train_body, str(dirs[family]), "plait", layout, str(root))
    step = sorted(root.glob("step_*"))[-1]
    out = tmp_path / "hf"
    summary = export_hf(step, out, shard_size=20_000)
    assert len(summary["files"]) > 1
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family].architecture]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(tokens()[0]).logits
    mine = _plait_logits(step, "plait")
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


def _train_one(folder: str, root: str) -> None:
    from plait.train.trainer import Trainer
    from tests.checkpoint.test_hf import run_config

    cfg = run_config(Path(folder), "plait", {}, steps=1)
    cfg.train.checkpoint_dir = root
    Trainer(cfg, init_mesh(), False).run()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_config_round_trips(family: str) -> None:
    theirs = hf_config_of(family).to_dict()
    theirs["architectures"] = [FAMILIES[family].architecture]
    m = ModelConfig(**model_fields(theirs, "test"))
    mine = hf_config(m, "float32")
    # the token ids are the tokenizer's (plait writes None), the dtype the weights'
    skip = {"torch_dtype", "dtype", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id"}
    for key, value in mine.items():
        if key in theirs and key not in skip:
            assert value == theirs[key], key
    back = transformers.AutoConfig.for_model(**{k: v for k, v in mine.items() if k != "dtype"})
    again = ModelConfig(
        **model_fields({**back.to_dict(), "architectures": mine["architectures"]}, "x")
    )
    assert again == m


def test_refusals_name_the_reason(dirs: dict[str, Path], tmp_path: Path) -> None:
    base = hf_config_of("qwen2").to_dict()
    for r in REFUSED:
        with pytest.raises(
            CheckpointError, match=f"architecture {r.architecture} is not supported"
        ):
            model_fields({**base, "architectures": [r.architecture]}, "x")
    with pytest.raises(
        CheckpointError, match="GPT2LMHeadModel is not supported; plait loads Llama"
    ):
        model_fields({**base, "architectures": ["GPT2LMHeadModel"]}, "x")
    yarn = {**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    with pytest.raises(CheckpointError, match=r"Qwen2ForCausalLM with RoPE scaling 'yarn'.*YaRN"):
        model_fields(yarn, "x")
    partial = {**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor 0\.5"):
        model_fields(partial, "x")
    # a Phi-3 folder whose fused tensor contradicts config.json
    bad = tmp_path / "phi3"
    bad.mkdir()
    for f in dirs["phi3"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"qkv_proj.weight'.*has shape \[64, 32\].*\[96, 32\]"
    ):
        from plait.checkpoint.hf_read import open_hf

        open_hf(bad)
