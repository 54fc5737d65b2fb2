"""The seconds ZeRO-Offload's host step adds to a training step: eager and two-pass.

The runtime (:class:`plait.parallel.zero.offload.HostStep`) steps the host in one of
two ways, and this module models each as it runs. Per ZeRO unit ``k`` with ``n_k``
elements in the rank's shard, at the host AdamW rate ``r`` (parameters/s) and the host
link ``L`` (bytes/s, one direction):

* ``d_k = n_k·g / L``: the gradient shard's device-to-host copy (``g``: gradient bytes),
* ``a_k = n_k / r``: the fused CPU AdamW of the unit's masters,
* ``z_k = SCALE_COST·n_k / r``: the two-pass path's unscale/clip of the landed shard
  on the host (one multiply: 8 of the 28 bytes AdamW moves per parameter; counted on
  every two-pass step, the worst case: the runtime skips it when the norm is under the
  threshold and nothing is fp16-scaled),
* ``u_k = n_k·p / L``: the updated master's host-to-device copy (``p``: parameter bytes).

**Eager** (no clipping, no fp16 scaling, ``nonfinite = 'error'``; pp = 1): each unit
lands and steps as soon as its gradient is final, during backward, so only
``max(Σa/U, Σa + Σd - backward)`` plus the copies back is exposed
(:func:`eager_exposed`).

**Two passes** (the default ``train.grad_clip = 1``, fp16 loss scaling, or a skip on a
non-finite norm; and every offloaded step under pipeline parallelism, where the units
land after the schedule): first the global norm is taken from the reduced shards still
on the device (``S·g`` bytes read at the device's element-wise bandwidth), then the
units flow through three resources in slot order, a ring of ``R`` landing buffers
(:data:`~plait.config.rules.features.OFFLOAD_RING_BUFFERS`) between the first two:

    D_k = max(D_{k-1}, H_{k-R}) + d_k     the copy stream (a buffer frees when the step
                                          of the unit that used it ends)
    H_k = max(H_{k-1}, D_k) + z_k + a_k   the worker thread
    B_k = max(B_{k-1}, H_k) + u_k         the copy-back stream

and the step ends at ``B_{U-1}`` (the device waits for the last copy back). So unit
``k+1``'s copy overlaps unit ``k``'s host step, and nothing overlaps backward
(:func:`two_pass_timeline`). With CUDA the copies run on side streams; on a CPU-only
run (``copy_back_on_worker``) the copy back is a plain copy inside the worker's step,
``H_k = max(H_{k-1}, D_k) + z_k + a_k + u_k``, and the landing copies run on the main
thread — the form ``benchmarks/offload.py`` checks against measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config.rules.features import OFFLOAD_RING_BUFFERS
from plait.plan.hardware import Hardware
from plait.plan.layout import Layout, Precision

DEFAULT_CPU_ADAM = 1.0e9
"""Parameters per second of the fused CPU AdamW when not measured: a 16-core host at
~30 GB/s of the 28 bytes AdamW moves per fp32 parameter (this machine measured ~1e9
with one thread on a 1M-element shard, benchmarks/RESULTS.md)."""

HOST_LINKS = (("gh200", 450e9), ("gb200", 450e9), ("h200", 50e9), ("h100", 50e9), ("a100", 25e9))
"""Host<->device bytes/s by device name: NVLink-C2C on Grace parts, PCIe 5 x16 (H100,
H200), PCIe 4 x16 (A100), pinned memory, one direction."""

SCALE_COST = 8 / 28
"""The host unscale/clip of a landed fp32 gradient (read and write 4 bytes) relative to
one AdamW update (28 bytes per parameter), both bound by host memory bandwidth."""


def host_link(hw: Hardware) -> float:
    """Host<->device bytes/s: the profile's measurement, else :data:`HOST_LINKS` by name,
    else PCIe 4."""
    measured = getattr(hw, "host_link_bytes_per_s", 0.0)
    if measured:
        return float(measured)
    low = hw.name.lower()
    return next((bw for key, bw in HOST_LINKS if key in low), 25e9)


def cpu_adam_rate(hw: Hardware) -> float:
    """Host AdamW parameters per second: measured, else :data:`DEFAULT_CPU_ADAM`."""
    measured = getattr(hw, "cpu_adam_params_per_s", 0.0)
    return float(measured) if measured else DEFAULT_CPU_ADAM


@dataclass(frozen=True)
class TwoPass:
    """The two-pass host step of one rank, in seconds."""

    norm: float
    """The global norm over the reduced shards on the device (before any copy)."""
    copied: tuple[float, ...]
    """``D_k``: when unit k's gradient has landed in its ring buffer (after the norm)."""
    stepped: tuple[float, ...]
    """``H_k``: when unit k's host step ends."""
    back: tuple[float, ...]
    """``B_k``: when unit k's updated master is back on the device."""

    busy: float
    """Seconds the copies and host steps keep their resources busy, summed: the step
    without any overlap (what process CPU time counts where the copies are memcpys)."""

    @property
    def total(self) -> float:
        """Seconds from the end of backward to the last copy back (the exposed time)."""
        return self.norm + max(self.back[-1], self.stepped[-1]) if self.back else self.norm


def two_pass_timeline(
    shards: list[int],
    rate: float,
    link: float,
    grad_bytes: int,
    param_bytes: int,
    norm_s: float = 0.0,
    *,
    scaled: bool = True,
    copy_back_on_worker: bool = False,
    ring: int = OFFLOAD_RING_BUFFERS,
) -> TwoPass:
    """The two-pass step's per-unit times (see the module docstring) for units whose
    shards hold ``shards`` elements, in slot order. ``scaled``: the landed gradients are
    unscaled/clipped on the host (:data:`SCALE_COST`); ``norm_s``: the norm's seconds."""
    d_end: list[float] = []
    h_end: list[float] = []
    b_end: list[float] = []
    busy = 0.0
    for k, n in enumerate(shards):
        d = n * grad_bytes / link
        a = n / rate + (SCALE_COST * n / rate if scaled else 0.0)
        u = n * param_bytes / link
        free = h_end[k - ring] if k >= ring else 0.0  # the ring buffer's previous user
        d_end.append(max(d_end[-1] if d_end else 0.0, free) + d)
        if copy_back_on_worker:  # a plain copy inside the worker's step
            h_end.append(max(h_end[-1] if h_end else 0.0, d_end[k]) + a + u)
            b_end.append(h_end[k])
        else:
            h_end.append(max(h_end[-1] if h_end else 0.0, d_end[k]) + a)
            b_end.append(max(b_end[-1] if b_end else 0.0, h_end[k]) + u)
        busy += d + a + u
    return TwoPass(norm_s, tuple(d_end), tuple(h_end), tuple(b_end), norm_s + busy)


def eager_exposed(shards: list[int], rate: float, link: float, precision: Precision,
                  backward_s: float) -> float:  # fmt: skip
    """The eager path's exposed seconds: the host steps of the first units run under
    backward, ``max(Σa/U, Σa + Σd - backward) + Σu`` (see the module docstring)."""
    n = sum(shards)
    cpu = n / rate
    d2h = n * precision.grad_bytes / link
    h2d = n * precision.param_bytes / link
    return max(cpu / max(len(shards), 1), cpu + d2h - backward_s) + h2d


def offload_step_time(
    shards: list[int],
    layout: Layout,
    hw: Hardware,
    precision: Precision,
    backward_s: float,
    step_s: float = 0.0,
) -> float:
    """Seconds the offloaded step adds to one optimizer step (exposed): ``shards`` the
    elements of each ZeRO unit's shard on the rank (slot order), ``backward_s`` the
    backward of the last micro-batch, ``step_s`` the device's forward and backward of
    the whole step. Eager when ``layout.offload_two_pass`` is off and pp = 1, else the
    two-pass flow (:func:`two_pass_timeline`); with ``layout.offload_delay`` the host's
    whole flow (copies, step, copy back) runs under the next step's device work, and only
    what exceeds ``step_s`` is exposed. With ``params`` every micro-batch also gathers
    each unit's shard from the host twice (forward, backward)."""
    link, rate = host_link(hw), cpu_adam_rate(hw)
    if layout.offload_delay:  # DeepSpeed's delayed parameter update: one step stale
        n = sum(shards)
        host = n / rate + n * (precision.grad_bytes + precision.param_bytes) / link
        if layout.offload_two_pass:  # the norm first, and the host's unscale/clip pass
            host += n * precision.grad_bytes / hw.optimizer_bandwidth + SCALE_COST * n / rate
        exposed = max(0.0, host - step_s)
    elif layout.offload_two_pass or layout.pp > 1:
        norm_s = sum(shards) * precision.grad_bytes / hw.optimizer_bandwidth
        flow = two_pass_timeline(
            shards, rate, link, precision.grad_bytes, precision.param_bytes, norm_s,
            scaled=layout.offload_two_pass,
        )  # fmt: skip
        exposed = flow.total
    else:
        exposed = eager_exposed(shards, rate, link, precision, backward_s)
    if layout.offload == "params":  # each unit's shard, forward and backward, prefetched
        per_mb = 2 * sum(shards) * precision.param_bytes / link / max(len(shards), 1)
        exposed += layout.microbatches * per_mb
    return exposed
