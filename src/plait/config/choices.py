"""The allowed-value sets of the configuration, and the check that a field holds one.

Each set of allowed values (pipeline schedules, recompute policies, offload kinds, ...)
is declared here once, as a ``Literal`` type; the tuple of its values is derived from it
(``typing.get_args``) and every other module imports both from :mod:`plait.config`
(which re-exports them). :func:`check_choices` checks every ``Literal`` field of a
section (and of the planner's :class:`~plait.plan.layout.Layout`) against its set.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from plait.config.rules.choices import check_choice

Backend = Literal["auto", "gloo", "nccl"]
Device = Literal["auto", "cpu", "cuda"]
Progress = Literal["auto", "bar", "lines", "none"]
Offload = Literal["none", "optimizer", "params"]
Recompute = Literal["none", "selective", "full"]
DType = Literal["fp32", "bf16", "fp16"]
ReduceDType = Literal["auto", "fp32", "bf16", "fp16"]
NonFinite = Literal["error", "skip"]
LrSchedule = Literal["cosine", "linear", "constant", "wsd"]
"""The learning-rate schedule after warm-up (:mod:`plait.train.lr_schedule`)."""
LrDecayShape = Literal["linear", "cosine", "1-sqrt"]
"""The shape of WSD's final decay (Hägele et al. 2024, section 3)."""
PipelineSchedule = Literal["naive", "gpipe", "1f1b", "interleaved", "zb"]
Balance = Literal["equal", "measured"]
PPGradReduce = Literal["step", "microbatch"]
AttentionKind = Literal["sdpa", "blockwise"]
ModelFamily = Literal["plait", "hf", "hf-llama"]
HF_FAMILIES: tuple[str, ...] = ("hf", "hf-llama")
"""The model.family values that build transformers' own class ('hf-llama': the old name,
an alias of 'hf')."""
RopeScaling = Literal["none", "linear", "llama3"]
AttentionBias = Literal["none", "qkv", "qkvo"]
"""Which attention projections have biases: none (Llama), q/k/v (Qwen2), all four."""
QKNorm = Literal["none", "head", "projection"]
"""RMSNorm of queries and keys before RoPE: none, per head (Qwen3), over the whole
projection (OLMo 2)."""
Architecture = Literal[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "olmo2",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
]
"""The Hugging Face families plait loads (:data:`plait.arch.families.FAMILIES`)."""
NormPlacement = Literal["pre", "post", "sandwich"]
"""Where a block's norms sit: before each sublayer (Llama), on its output (OLMo 2), or
both (Gemma 2/3: four norms per block)."""
Activation = Literal["silu", "gelu_tanh"]
"""The gated MLP's activation: SwiGLU ('silu') or GeGLU ('gelu_tanh', Gemma)."""
CPAttention = Literal["ring", "ulysses"]
MoERouter = Literal["softmax", "sigmoid"]
MoEAuxScope = Literal["layer", "model"]
Compression = Literal["none", "fp16", "bf16", "topk", "powersgd"]
CompressionAdam = Literal["before", "after"]
TopKScope = Literal["tensor", "bucket"]
"""Where top-k picks its largest entries: within each matrix, or across a bucket's matrices."""
WandbMode = Literal["off", "offline", "online"]
OptimizerName = Literal["adamw", "muon", "adafactor"]
"""The optimizer of a run (``train.optimizer``; docs/optimizers.md)."""
MuonLrAdjust = Literal["original", "match_rms_adamw"]
"""Muon's per-matrix learning-rate scaling (``torch.optim.Muon``'s ``adjust_lr_fn``)."""
NSDType = Literal["bfloat16", "float32", "float64"]
"""The dtype Muon's Newton-Schulz iteration runs in."""
LaunchBackend = Literal["local", "torchrun", "ray"]
TokenDType = Literal["uint16", "uint32"]
Auto = Literal["auto"]
"""The word of a number field plait may choose itself (``train.checkpoint_every = auto``)."""
PresetStyle = Literal["llama", "gpt"]
"""Block style of a model preset (:mod:`plait.config.presets`): ``llama`` (plait's built-in
block) or ``gpt`` (GPT-2/3's block)."""
PlannedSchedule = Literal["1f1b", "gpipe", "interleaved"]
"""The pipeline schedules the planner models (:class:`plait.plan.layout.Layout`); it
counts a run's 'naive' and 'zb' as '1f1b' (a safe over-estimate of their memory)."""

RECOMPUTES: tuple[Recompute, ...] = get_args(Recompute)
PIPELINE_SCHEDULES: tuple[PipelineSchedule, ...] = get_args(PipelineSchedule)
PLANNED_SCHEDULES: tuple[PlannedSchedule, ...] = get_args(PlannedSchedule)
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
CP_ATTENTIONS: tuple[CPAttention, ...] = get_args(CPAttention)
PP_GRAD_REDUCES: tuple[PPGradReduce, ...] = get_args(PPGradReduce)
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)
COMPRESSION_ADAMS: tuple[CompressionAdam, ...] = get_args(CompressionAdam)
TOPK_SCOPES: tuple[TopKScope, ...] = get_args(TopKScope)
NONFINITES: tuple[NonFinite, ...] = get_args(NonFinite)
PRESET_STYLES: tuple[PresetStyle, ...] = get_args(PresetStyle)
TOKEN_DTYPES: tuple[TokenDType, ...] = get_args(TokenDType)
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
AUTO: tuple[Auto, ...] = get_args(Auto)
"""('auto',): a value plait chooses itself (also ``plait train --layout auto``)."""
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""The ZeRO stages (``parallel.zero`` is a plain int: the planner counts with it)."""
ZERO_MEANING = (
    "0 = plain data parallel, 1 = optimizer state sharded, 2 = also gradients, "
    "3 = also parameters (fully sharded)"
)
"""What each of :data:`ZERO_STAGES` means, for the refusal of any other."""


_CHOICES: dict[type, tuple[tuple[str, tuple[Any, ...]], ...]] = {}


def _choices(cls: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """(field, allowed values) of each field of the dataclass ``cls`` annotated with a
    ``Literal`` (worked out once per class)."""
    if cls not in _CHOICES:
        hints = get_type_hints(cls)
        _CHOICES[cls] = tuple(
            (f.name, get_args(hints[f.name]))
            for f in fields(cls)
            if get_origin(hints[f.name]) is Literal
        )
    return _CHOICES[cls]


def check_choices(obj: object, prefix: str) -> None:
    """Each field of the dataclass ``obj`` annotated with a set of values (a ``Literal``)
    holds one of them; ``prefix`` names the owner in the message (``"parallel."``).
    The config sections and the planner's :class:`~plait.plan.layout.Layout` call it."""
    for name, allowed in _choices(type(obj)):
        check_choice(f"{prefix}{name}", getattr(obj, name), allowed)
