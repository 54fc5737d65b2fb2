"""Activation offloading in the planner (``train.activation_offload``): what stays on
the device, what the host holds, and the copies' exposed time.

The runtime (:mod:`plait.parallel.activation_offload`) copies everything an offloaded
block saves for backward to host memory during its forward and back before its backward.
Per rank (a pipeline stage of ``L`` blocks, ``N`` offloaded: every block, or the first
``train.activation_offload_blocks``) and micro-batch in flight:

* **device**: the saved activations of the ``L - N`` other blocks; in backward the
  offloaded block being computed and the one fetched ahead of it are back on the
  device (``min(N, 2)`` blocks of one micro-batch, a transient buffer);
* **host**: ``N`` blocks' saved activations per micro-batch in flight (page-locked on
  CUDA);
* **time**: each offloaded block's bytes cross the host link twice (out in forward,
  back in backward, :func:`~plait.plan.offload_time.host_link`); the copies run on a
  side stream under the stage's compute, so only what exceeds the compute is exposed:
  ``max(0, 2·N·A / link - (forward + backward))`` per micro-batch, ``A`` one block's
  saved bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.hardware import Hardware
from plait.plan.layout import Layout
from plait.plan.offload_time import host_link

REFETCHED_BLOCKS = 2
"""Offloaded blocks back on the device at once in backward: the one computing and the
one fetched ahead of it (the runtime's prefetch of the previous block)."""


def offloaded_blocks(layout: Layout, layers: int) -> int:
    """Blocks of a rank holding ``layers`` whose saved activations go to the host."""
    if not layout.activation_offload:
        return 0
    n = layout.activation_offload_blocks
    return layers if n == 0 else min(n, layers)


@dataclass(frozen=True)
class OffloadedActivations:
    """One rank's saved block activations with offloading, in bytes."""

    device: float
    """Saved activations of the blocks kept on the device, every micro-batch in flight."""
    host: float
    """Saved activations of the offloaded blocks, every micro-batch in flight."""
    refetch: float
    """Backward's transient: offloaded blocks back on the device at once (one micro-batch)."""


def split_activations(
    per_layer: float, layers: int, flight: float, layout: Layout
) -> OffloadedActivations:
    """``layers`` blocks saving ``per_layer`` bytes each per micro-batch, ``flight``
    micro-batches in flight: the device's, the host's and backward's transient."""
    off = offloaded_blocks(layout, layers)
    return OffloadedActivations(
        device=per_layer * (layers - off) * flight,
        host=per_layer * off * flight,
        refetch=per_layer * min(off, REFETCHED_BLOCKS),
    )


def exposed_copy_seconds(
    per_layer: float, layers: int, layout: Layout, hw: Hardware, compute_s: float
) -> float:
    """Seconds per micro-batch the offload copies add to a stage whose forward and
    backward take ``compute_s``: what of ``2·N·per_layer`` bytes over the host link the
    compute does not hide."""
    off = offloaded_blocks(layout, layers)
    return max(0.0, 2 * off * per_layer / host_link(hw) - compute_s)
