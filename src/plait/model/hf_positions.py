"""Packed samples in Hugging Face's own classes: restarted ``position_ids``.

``transformers`` 5 reads packed sequences from ``position_ids``: where a row's
positions restart, its attention mask becomes block-causal (``masking_utils``'s packed
sequence detection, for SDPA and eager attention alike), and its rotary embedding takes
the same positions. So a Hugging Face causal LM given the restarted positions of each
document (:func:`~plait.model.document_mask.restarted_positions` of the ids that
:func:`~plait.model.document_mask.document_ids` reads from the end-of-document tokens)
computes every packed sample as alone. :func:`add_packed_positions` adds them to every
call with a forward pre-hook, so the model's parameter names (and its tensor-parallel
plan) do not change.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.model.document_mask import document_ids, restarted_positions

HOOKED = "_plait_packed_positions"


def add_packed_positions(model: nn.Module, eos_id: int) -> None:
    """Make ``model`` (a ``transformers`` causal LM called with input ids ``(batch,
    seq)``) restart its positions, and so its block-causal mask, after each ``eos_id``;
    explicit ``position_ids`` in a call are kept."""

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        tokens = args[0] if args else kwargs.get("input_ids")
        if tokens is None or kwargs.get("position_ids") is not None:
            return None
        pos = restarted_positions(document_ids(tokens, eos_id))  # (batch, seq)
        return args, {**kwargs, "position_ids": pos}

    if getattr(model, HOOKED, None) is None:
        setattr(model, HOOKED, model.register_forward_pre_hook(hook, with_kwargs=True))
