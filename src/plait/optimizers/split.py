"""Which parameters Muon steps and which AdamW steps.

Muon orthogonalises *hidden* matrices: the attention projections, the MLP, the MoE
router and each expert's ``(out, in)`` matrix of a 3-D expert tensor. Everything else
is AdamW's: the token embeddings and the output head (their rows are per-token vectors,
not a linear map between hidden spaces, Jordan et al. 2024), norms and biases (1-D).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

HEAD_NAMES = ("output", "lm_head", "head", "score")
"""Module names of an output head (plait's ``output``, Hugging Face's ``lm_head``)."""

EXPERTS_IN_OUT = ("Experts",)
"""Module classes whose 3-D weights are ``(experts, in, out)`` stacks (plait's MoE: the
forward is ``x @ w[e]``); other 3-D weights are read as ``(experts, out, in)``."""


@dataclass
class MuonSplit:
    """The parameters of each rule, with their qualified names."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """2-D hidden matrices and 3-D expert stacks."""
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """Embeddings, output head, norms, biases."""
    in_out: set[int] = field(default_factory=set)
    """``id`` of the 3-D parameters stored ``(experts, in, out)`` (their matrices are
    transposed before orthogonalising, so each is the ``(out, in)`` map)."""

    def matrices(self) -> int:
        """The number of matrices Muon orthogonalises (each expert counts once)."""
        return sum(p.shape[0] if p.ndim == 3 else 1 for _, p in self.muon)

    def line(self) -> str:
        """The banner's line: how many parameters (and elements) each rule steps."""
        n_m = sum(p.numel() for _, p in self.muon)
        n_a = sum(p.numel() for _, p in self.adamw)
        return (
            f"muon on {len(self.muon)} tensors ({self.matrices()} matrices, {n_m:,} "
            f"elements), adamw on {len(self.adamw)} (embeddings, head, norms, biases: "
            f"{n_a:,})"
        )


def split_params(model: nn.Module) -> MuonSplit:
    """Split ``model``'s trainable parameters into Muon's and AdamW's (see the module
    docstring); a parameter shared by two modules (tied embeddings) goes where its
    first use says."""
    out = MuonSplit()
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        embedding_or_head = "Embedding" in type(module).__name__ or leaf in HEAD_NAMES
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.ndim in (2, 3) and not embedding_or_head:
                out.muon.append((name, p))
                if p.ndim == 3 and type(module).__name__ in EXPERTS_IN_OUT:
                    out.in_out.add(id(p))
            else:
                out.adamw.append((name, p))
    return out
