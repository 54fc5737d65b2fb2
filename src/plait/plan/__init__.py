"""The planner: what fits, how fast it runs, and which layout to choose.

Pure arithmetic over a model shape, a layout, a precision policy and a hardware
profile: nothing here imports torch or needs a process group, so the planner runs where
torch is not installed (``tests/plan/test_isolation.py``). Measuring the machine
(α, β, FLOP/s) is :mod:`plait.bench.calibrate`'s job; its profiles load here as data.

Functions take the bundled question, a :class:`~plait.plan.query.Query` (model,
hardware, precision, runtime, sequence length, headroom, MoE part), and a
:class:`~plait.plan.layout.Layout`: ``f(q, layout, ...)``.

The modules import one way, in levels (``tests/test_layers.py`` checks this order and
that the import graph has no cycle; a module imports only its own level or earlier):

0. the words: ``text`` (sizes and durations in messages), ``hardware``, ``layout``,
   ``modelspec``, ``moe``, ``lora``;
1. the inputs: ``profile_toml`` (hardware files), ``query``;
2. the terms: ``activations``, ``units``, ``network``, ``compression``,
   ``offload_time``, ``offload``, ``activation_offload``, ``pipeline_zero``,
   ``overheads``, ``compute``, ``tp_comm``, ``dp_comm``;
3. ``memory`` (a rank's bytes);
4. ``estimate``, ``moe_estimate`` (memory and step time of one layout);
5. the choice: ``evaluate`` (dense or MoE), ``space`` (the candidates), ``fit``,
   ``explain``, ``offload_check``, ``search``, ``moe_report``;
6. ``report``, ``auto`` (what ``plait plan`` prints, what ``--layout auto`` picks);
7. this package.
"""

from plait.plan.estimate import Estimate, StepTime, estimate, step_time
from plait.plan.fit import FitVerdict, check_fits
from plait.plan.hardware import PRESETS as HARDWARE_PRESETS
from plait.plan.hardware import Cluster, Curve, Hardware, Link
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout, Precision, Runtime
from plait.plan.memory import MemoryBreakdown, memory_per_rank
from plait.plan.modelspec import MODEL_SPECS, ModelSpec
from plait.plan.profile_toml import load_hardware
from plait.plan.query import Query

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_SPECS",
    "PRECISIONS",
    "RUNTIMES",
    "Cluster",
    "Curve",
    "Estimate",
    "FitVerdict",
    "Hardware",
    "Layout",
    "Link",
    "MemoryBreakdown",
    "ModelSpec",
    "Precision",
    "Query",
    "Runtime",
    "StepTime",
    "check_fits",
    "estimate",
    "load_hardware",
    "memory_per_rank",
    "step_time",
]
