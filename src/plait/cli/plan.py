"""``plait plan``: predict one layout's memory and step time, or search every layout.

``plan_main`` takes the arguments after ``plan`` and returns an exit code; bad input is a
:class:`~plait.errors.ConfigError` (``plait`` prints it as one paragraph and exits with
code 2). Pure arithmetic on :mod:`plait.plan`: nothing runs and no torch is imported.
The hardware profiles it reads with ``--hardware PATH`` come from ``plait bench
calibrate`` (:mod:`plait.cli.bench`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import replace

from plait.cli.common import ConfigErrorParser
from plait.config import (
    COMPRESSIONS,
    CP_ATTENTIONS,
    OFFLOADS,
    OPTIMIZERS,
    PLANNED_SCHEDULES,
    PRESET_STYLES,
    RECOMPUTES,
    ZERO_STAGES,
)
from plait.config.rules.layout import check_world
from plait.config.rules.lora import check_lora
from plait.errors import ConfigError
from plait.plan.hardware import PRESETS as HARDWARE
from plait.plan.layout import (
    PRECISIONS,
    RUNTIMES,
    Layout,
    precision_preset,
    runtime_preset,
)
from plait.plan.lora import LoraSpec
from plait.plan.modelspec import MODEL_SPECS, ModelSpec, model_spec_preset
from plait.plan.moe_report import moe_from_args, moe_section
from plait.plan.optimizer import OptimizerSpec
from plait.plan.profile_toml import load_hardware

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``7e9``, ``7B``, ``175b``, ``1.5T``, ``350M`` -> a number."""
    if text.strip().startswith("-"):
        raise ConfigError(f"the parameter count must be positive, got {text}.")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        raise ConfigError(
            f"cannot read {text!r} as a parameter count; write e.g. 7e9, 7B, 350M or 1.5T."
        )
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def _plan_parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(
        prog="plait plan",
        description=(
            "Predict per-rank memory, step time, tokens/s and MFU of a training layout, or "
            "search every layout (--search) and explain the best. Pure arithmetic: nothing "
            "runs."
        ),
    )
    m = p.add_argument_group("model (a preset, --params, or a shape)")
    m.add_argument("--model", help=f"preset: {', '.join(MODEL_SPECS)}")
    m.add_argument("--params", help="parameter count (e.g. 7B); a llama-style shape is chosen")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int, help="default: --heads")
    m.add_argument("--ffn", type=int, help="MLP width (default: 8h/3 llama, 4h gpt)")
    m.add_argument("--vocab", type=int)
    m.add_argument("--style", choices=PRESET_STYLES, help="default: llama")
    m.add_argument(
        "--seq-len",
        "--seq",
        "--train.seq_len",
        dest="seq",
        type=int,
        help="tokens per sequence (default: the model's context)",
    )
    moe = p.add_argument_group("mixture of experts (docs/moe.md)")
    moe.add_argument("--experts", type=int, default=0, help="routed experts per MoE layer")
    moe.add_argument("--top-k", type=int, default=2)
    moe.add_argument("--expert-ffn", type=int, help="one expert's width (default: ffn / k)")
    moe.add_argument("--shared-experts", type=int, default=0)
    moe.add_argument("--moe-every", type=int, default=1, help="every n-th layer is MoE")
    moe.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    lo = p.add_argument_group("LoRA (docs/fine-tuning.md): a frozen base, trained adapters")
    lo.add_argument(
        "--lora-rank",
        "--lora.rank",
        dest="lora_rank",
        type=int,
        help="adapters of this rank; memory counts the base without gradients or optimizer "
        "state (step time still counts full training's data-parallel traffic)",
    )
    lo.add_argument(
        "--lora-targets",
        "--lora.targets",
        dest="lora_targets",
        default="q,k,v,o,gate,up,down",
        help="adapted layers, comma-separated (default: all seven)",
    )
    h = p.add_argument_group("hardware")
    h.add_argument(
        "--hardware",
        default="a100-80gb",
        help=f"preset ({', '.join(HARDWARE)}) or a profile from `plait bench calibrate`",
    )
    h.add_argument(
        "--devices",
        type=int,
        help="devices in the job (default: dp x tp x pp x cp when --dp is given, else one node)",
    )
    h.add_argument("--headroom", type=float, default=0.05, help="memory fraction kept free")
    lay = p.add_argument_group("layout")
    # every layout flag also answers to `plait train`'s dotted name for the same thing
    for axis in ("dp", "tp", "pp", "cp"):
        lay.add_argument(f"--{axis}", f"--parallel.{axis}", dest=axis, type=int)
    lay.add_argument(
        "--zero", "--parallel.zero", dest="zero", type=int, default=0, choices=ZERO_STAGES
    )
    lay.add_argument(
        "--zero-shard-size",
        "--parallel.zero_shard_size",
        dest="zero_shard_size",
        type=int,
        help="hybrid ZeRO factor F (default dp)",
    )
    lay.add_argument(
        "--global-batch",
        "--train.global_batch",
        dest="global_batch",
        type=int,
        help="sequences per optimizer step",
    )
    lay.add_argument(
        "--micro-batch", "--train.micro_batch", dest="micro_batch", type=int, default=1
    )
    lay.add_argument(
        "--microbatches",
        "--parallel.microbatches",
        dest="microbatches",
        type=int,
        help="pipeline micro-batches per step (default: global/(dp·mb))",
    )
    lay.add_argument(
        "--recompute", "--train.recompute", dest="recompute", choices=RECOMPUTES, default="none"
    )
    lay.add_argument(
        "--activation-offload",
        "--train.activation_offload",
        dest="activation_offload",
        action="store_true",
        help="saved block activations on the host between forward and backward",
    )
    lay.add_argument(
        "--activation-offload-blocks",
        "--train.activation_offload_blocks",
        dest="activation_offload_blocks",
        type=int,
        default=0,
        help="with --activation-offload: only the first N blocks of each rank (0: all)",
    )
    lay.add_argument(
        "--schedule",
        "--parallel.pipeline_schedule",
        dest="schedule",
        choices=PLANNED_SCHEDULES,
        default="1f1b",
    )
    lay.add_argument(
        "--chunks",
        "--parallel.chunks",
        dest="chunks",
        type=int,
        default=1,
        help="virtual pipeline stages (model chunks) per rank, interleaved",
    )
    lay.add_argument("--sequence-parallel", action="store_true")
    lay.add_argument(
        "--cp-attention", choices=CP_ATTENTIONS, default="ring", help="attention over cp"
    )
    lay.add_argument(
        "--compression",
        "--parallel.compression",
        dest="compression",
        choices=COMPRESSIONS,
        default="none",
        help="data-parallel gradient compression (zero 0)",
    )
    lay.add_argument(
        "--compression-ratio",
        "--parallel.compression_ratio",
        dest="compression_ratio",
        type=float,
        default=0.01,
        help="topk: fraction of gradient entries sent",
    )
    lay.add_argument(
        "--compression-rank",
        "--parallel.compression_rank",
        dest="compression_rank",
        type=int,
        default=4,
        help="powersgd: approximation rank",
    )
    lay.add_argument(
        "--offload", "--parallel.offload", dest="offload", default="none",
        choices=OFFLOADS,
        help="ZeRO-Offload (zero >= 1; params: zero 3); with --search: also tried",
    )  # fmt: skip
    lay.add_argument("--offload-dir", "--parallel.offload_dir", dest="offload_dir",
                     help="NVMe tier: optimizer state in files (the path is not read)")  # fmt: skip
    lay.add_argument("--grad-clip", "--train.grad_clip", dest="grad_clip", type=float,
                     default=1.0, help="as train.grad_clip; offload: 0 steps units under "
                     "backward, else the two-pass step after the norm")  # fmt: skip
    lay.add_argument("--optimizer", "--train.optimizer", dest="optimizer", default="adamw",
                     choices=OPTIMIZERS, help="its state bytes and step cost (docs/optimizers.md)")
    lay.add_argument("--ns-steps", "--optim.muon_ns_steps", dest="ns_steps", type=int,
                     default=5, help="muon: Newton-Schulz iterations per step")  # fmt: skip
    lay.add_argument("--precision", default="bf16-mixed", help=", ".join(PRECISIONS))
    lay.add_argument("--runtime", default="plait", help=", ".join(RUNTIMES))
    o = p.add_argument_group("output")
    o.add_argument("--search", action="store_true", help="rank every layout that fits")
    o.add_argument("--top", type=int, default=5, help="layouts shown by --search")
    o.add_argument("--json", action="store_true", help="print JSON for tools")
    o.add_argument("--list", action="store_true", help="list the presets and exit")
    return p


def model_from_args(ns: argparse.Namespace) -> ModelSpec:
    """The model of ``--model``, ``--params`` or the shape flags."""
    shape = [ns.layers, ns.hidden, ns.heads, ns.vocab]
    given = sum(x is not None for x in (ns.model, ns.params)) + any(x is not None for x in shape)
    if given != 1:
        raise ConfigError(
            "give exactly one model: --model NAME (one of "
            f"{', '.join(MODEL_SPECS)}), --params N, or --layers --hidden --heads --vocab."
        )
    shaping = [f"--{f.replace('_', '-')}" for f in ("kv_heads", "ffn", "style") if getattr(ns, f)]
    if shaping and (ns.model is not None or ns.params is not None):
        raise ConfigError(
            f"{', '.join(shaping)} only shape(s) a model given by --layers --hidden --heads "
            "--vocab; --model and --params choose their own shape, so drop "
            f"{', '.join(shaping)} or give the full shape instead."
        )
    if ns.model is not None:
        return model_spec_preset(ns.model)
    if ns.params is not None:
        return ModelSpec.from_params(parse_count(ns.params), seq=ns.seq or 2048)
    if any(x is None for x in shape):
        raise ConfigError("a model shape needs all of --layers --hidden --heads --vocab.")
    for name, v in zip(("layers", "hidden", "heads", "vocab"), shape, strict=True):
        if v <= 0:
            raise ConfigError(f"--{name} must be positive, got {v}.")
    ffn = ns.ffn or (4 * ns.hidden if ns.style == "gpt" else 256 * -(-8 * ns.hidden // 3 // 256))
    return ModelSpec(
        "custom",
        ns.layers,
        ns.hidden,
        ns.heads,
        ns.kv_heads or ns.heads,
        ffn,
        ns.vocab,
        ns.style or "llama",
        ns.seq or 2048,
    )


def _list() -> str:
    lines = ["models:"]
    for name, s in MODEL_SPECS.items():
        lines.append(
            f"  {name:<12} {s.param_count() / 1e9:8.3f} B  L={s.n_layers} h={s.hidden} "
            f"a={s.n_heads} kv={s.n_kv_heads} f={s.ffn_hidden} V={s.vocab} ({s.style})"
        )
    lines.append("hardware:")
    for name, hw in HARDWARE.items():
        lines.append(
            f"  {name:<12} {hw.memory_bytes / 1e9:.0f} GB, {hw.peak_flops / 1e12:.0f} TFLOP/s, "
            f"{hw.devices_per_node} per node"
        )
    lines.append(f"precisions: {', '.join(PRECISIONS)}; runtimes: {', '.join(RUNTIMES)}")
    return "\n".join(lines)


def plan_main(argv: Sequence[str]) -> int:
    """``plait plan``."""
    from plait.plan.offload_check import format_offload
    from plait.plan.query import Query
    from plait.plan.report import estimate_json, format_estimate, format_search, search_json
    from plait.plan.search import search, with_layout
    from plait.plan.space import Space

    ns = _plan_parser().parse_args(list(argv))
    if ns.list:
        print(_list())
        return 0
    positive = (
        "seq", "devices", "tp", "pp", "cp", "dp", "micro_batch", "microbatches",
        "global_batch", "top", "ffn", "kv_heads", "zero_shard_size", "chunks",
    )  # fmt: skip
    for flag in positive:  # before any default is applied: 0 is refused, never replaced
        v = getattr(ns, flag)
        if v is not None and v <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {v}.")
    if not 0.0 <= ns.headroom < 1.0:
        raise ConfigError(f"--headroom must be in [0, 1), got {ns.headroom}.")
    spec = model_from_args(ns)
    hw = load_hardware(ns.hardware)
    seq = ns.seq or spec.max_positions
    if ns.devices is not None:
        devices = ns.devices
    elif ns.dp is not None and not ns.search:  # a whole layout: its product is the job
        devices = ns.dp * (ns.tp or 1) * (ns.pp or 1) * (ns.cp or 1)
    else:
        devices = hw.devices_per_node
    prec, rt = precision_preset(ns.precision), runtime_preset(ns.runtime)
    if ns.experts < 0 or ns.ep <= 0:
        raise ConfigError(f"--experts must be >= 0 and --ep positive, got {ns.experts}, {ns.ep}.")
    if ns.ep > 1 and not ns.experts:  # as `plait train` refuses parallel.ep on a dense model
        raise ConfigError(f"--ep {ns.ep} needs a mixture-of-experts model: set --experts.")
    moe = moe_from_args(ns, spec) if ns.experts else None
    if ns.lora_rank is not None:
        check_lora(ns.lora_rank, 1.0, 0.0)
    lora = LoraSpec(ns.lora_rank, ns.lora_targets) if ns.lora_rank is not None else None
    opt = OptimizerSpec(ns.optimizer, ns.ns_steps)
    if ns.search:
        gb = ns.global_batch or devices
        q = Query(spec, hw, devices, gb, seq, prec, rt, ns.headroom, moe, lora, opt)
        space = Space(offload=("none", ns.offload)) if ns.offload != "none" else None
        result = search(q, space, top=ns.top)
        print(json.dumps(search_json(result), indent=2) if ns.json else format_search(result))
        if ns.experts and not ns.json:  # the ep choices of the data ranks
            print(moe_section(ns, q))
        return 0
    tp, pp, cp = ns.tp or 1, ns.pp or 1, ns.cp or 1
    dp = check_world(ns.dp, tp, pp, cp, devices, devices=True)
    mb = ns.micro_batch
    if ns.microbatches is not None:
        m = ns.microbatches
    elif ns.global_batch is not None:
        if ns.global_batch % (dp * mb):
            raise ConfigError(
                f"--global-batch {ns.global_batch} is not divisible by dp x micro-batch = "
                f"{dp} x {mb}."
            )
        m = ns.global_batch // (dp * mb)
    else:
        m = pp  # enough micro-batches to fill the pipeline
    layout = Layout(
        dp,
        tp,
        pp,
        cp,
        ns.zero,
        ns.zero_shard_size,
        mb,
        m,
        ns.recompute,
        ns.schedule,
        ns.chunks,
        ns.sequence_parallel,
        ns.cp_attention,
        ns.compression,
        ns.compression_ratio,
        ns.compression_rank,
    )
    gb = ns.global_batch or layout.global_batch
    q = Query(spec, hw, devices, gb, seq, prec, rt, ns.headroom, moe, lora, opt)
    if moe is not None and (dp * cp % ns.ep or ns.experts % ns.ep):
        raise ConfigError(
            f"--ep {ns.ep} must divide the data ranks dp x cp = {dp * cp} and the "
            f"{ns.experts} experts."
        )
    layout = replace(
        layout,
        activation_offload=ns.activation_offload,
        activation_offload_blocks=ns.activation_offload_blocks,
        offload=ns.offload,
        offload_nvme=ns.offload_dir is not None,
        offload_two_pass=ns.grad_clip > 0 or prec.name.startswith("fp16"),
    )
    if moe is not None:
        layout = replace(layout, ep=ns.ep)
    e = with_layout(q, layout)
    print(json.dumps(estimate_json(e), indent=2) if ns.json else format_estimate(e))
    if layout.offload != "none" and not ns.json:
        print(format_offload(e))
    if ns.experts and not ns.json:
        print(moe_section(ns, q, layout))
    return 0
