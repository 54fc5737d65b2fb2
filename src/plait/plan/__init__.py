"""The planner: what fits, how fast it runs, and which layout to choose.

Pure arithmetic over a model shape, a layout, a precision policy and a hardware
profile: nothing here imports torch or needs a process group, so the planner runs where
torch is not installed (``tests/plan/test_isolation.py``). Measuring the machine
(α, β, FLOP/s) is :mod:`plait.bench.calibrate`'s job; its profiles load here as data.
"""

from plait.plan.estimate import Estimate, StepTime, estimate, step_time
from plait.plan.fit import FitVerdict, check_fits
from plait.plan.hardware import PRESETS as HARDWARE_PRESETS
from plait.plan.hardware import Cluster, Curve, Hardware, Link
from plait.plan.layout import PRECISIONS, RUNTIMES, Layout, Precision, Runtime
from plait.plan.memory import MemoryBreakdown, memory_per_rank
from plait.plan.modelspec import MODEL_SPECS, ModelSpec
from plait.plan.profile_toml import load_hardware

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
    "Runtime",
    "StepTime",
    "check_fits",
    "estimate",
    "load_hardware",
    "memory_per_rank",
    "step_time",
]
