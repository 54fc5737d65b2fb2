"""Expert parallelism: experts split over a sub-axis of the data-parallel ranks.

:mod:`~plait.parallel.expert.apply` (the parallelize hook), :mod:`~plait.parallel.expert.
dispatch` (all-to-all dispatch and combine), :mod:`~plait.parallel.expert.grads` (expert
gradients over their replica group). See docs/moe.md.
"""

from plait.parallel.expert.apply import (
    ExpertLayout,
    ExpertSplit,
    apply_expert_parallel,
    expert_split,
)
from plait.parallel.expert.dispatch import ExpertParallelDispatch, ep_bytes_per_layer
from plait.parallel.expert.grads import ExpertGradSync

__all__ = [
    "ExpertGradSync",
    "ExpertLayout",
    "ExpertParallelDispatch",
    "ExpertSplit",
    "apply_expert_parallel",
    "ep_bytes_per_layer",
    "expert_split",
]
