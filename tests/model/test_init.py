"""Meta build on one process: every tensor's initial value alone, by name.

* the built-in transformer's values equal a direct build, bit for bit, whatever order
  they are asked for in;
* a factory model and a Hugging Face Llama built on the meta device (nothing
  allocated) get every value from their modules' own initialisers (no NaN left, the
  norms ones, the rotary tables exact), the same on every call and in any order;
* a factory model plait cannot initialise one tensor at a time is built in full, with a
  warning naming the module and the memory; an initialiser that leaves a tensor unset is
  refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.model import Transformer
from plait.model.factory import build_meta_model
from plait.model.init import SEED_ATTR, InitialValues, build_on_meta, has_meta

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def test_builtin_values_equal_a_direct_build_in_any_order() -> None:
    direct = Transformer(CFG, seed=5)
    meta = build_meta_model(CFG, seed=5)
    assert has_meta(meta) and getattr(meta, SEED_ATTR) == 5
    values = InitialValues(meta)
    want = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    for name in reversed(list(want)):
        assert torch.equal(values.value(name), want[name]), name


@pytest.mark.parametrize("kind", ["factory", "hf-llama"])
def test_other_models_initialise_module_by_module(kind: str) -> None:
    if kind == "hf-llama":
        pytest.importorskip("transformers")
        cfg = dataclasses.replace(CFG, family="hf-llama")
    else:
        cfg = dataclasses.replace(CFG, factory="tests.model.factory_models:build")
    meta = build_meta_model(cfg, seed=3)
    assert all(t.is_meta for t in meta.parameters())
    values = InitialValues(meta)
    names = [n for n, _ in meta.named_parameters()]
    first = {n: values.value(n).clone() for n in names}
    again = InitialValues(build_meta_model(cfg, seed=3))
    for n in reversed(names):  # another order, another object: the same values
        assert torch.equal(again.value(n), first[n]), n
    for n, v in first.items():
        assert not v.isnan().any(), n
        if n.endswith("norm.weight") or (".ln" in n and n.endswith("weight")):
            assert torch.equal(v, torch.ones_like(v)), n
    other = InitialValues(build_meta_model(cfg, seed=4))
    assert not torch.equal(other.value(names[0]), first[names[0]])
    if kind == "hf-llama":  # the rotary tables are computed, not left empty
        inv = next(n for n, _ in meta.named_buffers() if n.endswith("inv_freq"))
        head_dim = CFG.dim // CFG.n_heads
        want = 1.0 / (CFG.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        torch.testing.assert_close(values.value(inv), want)


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))  # no reset_parameters: plait cannot redo it
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def bare(cfg: ModelConfig) -> nn.Module:
    """A factory (``tests.model.test_init:bare``) whose model has a bare parameter."""
    return _Bare()


class _Forgetful(nn.Linear):
    def reset_parameters(self) -> None:  # sets the weight only
        nn.init.zeros_(self.weight)


def test_uninitialisable_factory_is_built_in_full_with_a_warning() -> None:
    cfg = dataclasses.replace(CFG, factory="tests.model.test_init:bare")
    with pytest.warns(UserWarning, match=r"<root> has no reset_parameters\(\).*GiB in float32"):
        model = build_meta_model(cfg, seed=0)
    assert not has_meta(model)
    assert torch.equal(model.get_parameter("scale"), torch.ones(8))


def test_a_value_no_initialiser_set_is_refused_by_name() -> None:
    model = build_on_meta(_Forgetful, 4, 4, seed=0)
    values = InitialValues(model)
    for name in ("weight", "bias"):  # the module is initialised as a whole
        with pytest.raises(ConfigError, match=r"^bias: no initialiser of _Forgetful set it"):
            values.value(name)
