"""Hardware profiles: device memory, compute rates, links; datasheet presets.

A :class:`Hardware` says what one device can hold and how fast it computes and talks:

* **compute** as three rate curves: dense matrix multiplication (FLOP/s as a function of
  the GEMM's size), fused attention (FLOP/s as a function of sequence length) and
  memory-bound element-wise work (bytes/s as a function of tensor size). A datasheet
  preset gives each curve one point (a constant: peak x an achievable fraction); a
  calibrated profile (:mod:`plait.bench.calibrate`) measures several points.
* **links** in the alpha-beta model (Hockney 1994): sending ``S`` bytes over a link
  costs ``alpha + S / B``. Two link classes: inside a node (NVLink; loopback for CPU
  processes) and between nodes (InfiniBand/RoCE, the per-device share of the NICs).
  A calibrated link can carry per-collective fits, since e.g. gloo's all-gather is
  slower per byte than its all-reduce.

Units are SI: bytes, seconds, FLOP/s. "80 GB" is 80e9 bytes.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace

from plait.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""Operations a link can carry a measured (alpha, bandwidth) fit for."""

IN_STEP = "all_reduce_in_step"
"""A measured-only operation: the CPU/wall cost one all-reduce adds to a step when it is
issued as tensor parallelism issues it (synchronously, back to back with compute, no
barrier before it), which includes waiting for the slower peer; see
:func:`plait.bench.calibrate.measure_in_step`."""

MEASURED_OPS = (*COLLECTIVES, IN_STEP)
"""Operations a link can carry measured ``(group size, curve)`` points for."""


GRID_FIELDS = ("block_scale", "tp_block_scale", "sp_block_scale")
"""The :class:`Hardware` fields that hold a ``(hidden, tokens, ratio)`` grid."""
TP_GRID_DEGREE = 2
"""The tensor-parallel degree :attr:`Hardware.tp_block_scale` is measured at (pairs of
ranks, as the in-step all-reduce is)."""


def _check_grid(key: str, grid: tuple[tuple[float, float, float], ...]) -> None:
    """A grid field must be distinct positive points covering hidden sizes x tokens."""
    if not grid:
        return
    dims = {d for d, _, _ in grid}
    toks = {t for _, t, _ in grid}
    cells = {(d, t) for d, t, _ in grid}
    if any(min(p) <= 0 for p in grid) or len(cells) != len(grid):
        raise ConfigError(
            f"hardware.{key} needs distinct positive (hidden, tokens, ratio) points, got {grid}."
        )
    if len(cells) != len(dims) * len(toks):
        raise ConfigError(
            f"hardware.{key} must be a full grid of hidden sizes x token counts, "
            f"got {sorted(cells)}."
        )


@dataclass(frozen=True)
class Curve:
    """A positive rate as a function of a positive size, interpolated log-log.

    Between points the rate follows a power law; outside them it stays at the nearest
    end point. One point is a constant.
    """

    points: tuple[tuple[float, float], ...]
    """``(size, rate)`` pairs with strictly increasing sizes."""

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a rate curve needs at least one (size, rate) point.")
        sizes = [s for s, _ in self.points]
        if any(s <= 0 or r <= 0 for s, r in self.points):
            raise ConfigError(f"rate curve points must be positive, got {self.points}.")
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ConfigError(f"rate curve sizes must increase strictly, got {sizes}.")

    @classmethod
    def constant(cls, rate: float) -> Curve:
        """The curve that is ``rate`` everywhere."""
        return cls(((1.0, float(rate)),))

    def at(self, size: float) -> float:
        """The rate at ``size``."""
        pts = self.points
        if len(pts) == 1 or size <= pts[0][0]:
            return pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([s for s, _ in pts], size)
        (s0, r0), (s1, r1) = pts[i - 1], pts[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))

    @property
    def peak(self) -> float:
        """The highest rate on the curve."""
        return max(r for _, r in self.points)


@dataclass(frozen=True)
class Link:
    """One link class in the alpha-beta model: a message of S bytes costs alpha + S/B."""

    latency_s: float
    """alpha: the start-up cost of one message (one step of a collective), seconds."""
    bandwidth: float
    """B: the bytes per second one device achieves on this link in one direction."""
    collectives: tuple[tuple[str, float, float], ...] = ()
    """Measured ``(operation, alpha, B)`` fits that replace the generic figures for that
    operation (operations from :data:`COLLECTIVES`)."""
    measured: tuple[tuple[str, int, Curve], ...] = ()
    """Measured ``(operation, group size, seconds as a function of message bytes)``: for a
    message inside the measured range on a group of that size, the interpolated
    measurement replaces the alpha-beta line (a two-parameter line cannot follow a
    transport whose latency tail varies with the size, as gloo's on loopback does)."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ConfigError(
                f"a link needs latency >= 0 and bandwidth > 0, got alpha={self.latency_s}, "
                f"B={self.bandwidth}."
            )
        for op, a, b in self.collectives:
            if op not in COLLECTIVES:
                raise ConfigError(f"unknown collective {op!r}; use one of {COLLECTIVES}.")
            if a < 0 or b <= 0:
                raise ConfigError(f"collective fit {op}: alpha must be >= 0 and B > 0.")

    def measured_seconds(self, op: str, n: int, nbytes: float) -> float | None:
        """The interpolated measurement of ``op`` on ``n`` ranks for ``nbytes`` (the
        op's message convention), or None outside what was measured."""
        for name, size, curve in self.measured:
            lo, hi = curve.points[0][0], curve.points[-1][0]
            if name == op and (size == n or op == "p2p") and lo <= nbytes <= hi:
                return curve.at(nbytes)
        return None

    def fit(self, op: str) -> tuple[float, float]:
        """``(alpha, B)`` for ``op``: the measured fit when there is one."""
        for name, a, b in self.collectives:
            if name == op:
                return a, b
        return self.latency_s, self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """What one device holds and how fast it computes and communicates."""

    name: str
    """Short name, e.g. ``a100-80gb`` or ``cpu-calibrated``."""
    memory_bytes: float
    """Device memory capacity in bytes (80 GB = 80e9)."""
    peak_flops: float
    """Dense peak FLOP/s of one device in the compute dtype: the MFU denominator."""
    matmul: Curve
    """Achieved GEMM FLOP/s as a function of the GEMM's size (M*K*N)^(1/3) (a calibrated
    profile: of a linear layer in training, forward and backward GEMMs together)."""
    attention: Curve
    """Achieved fused-attention FLOP/s (forward + backward, causal mask not discounted)
    as a function of the sequence length."""
    elementwise: Curve
    """Achieved memory-bound bytes/s (reads + writes) as a function of tensor bytes (a
    calibrated profile: of a block's norm/rotary/activation/residual layers in training,
    with backward charged twice the forward bytes)."""
    optimizer_bandwidth: float
    """Effective bytes/s of the optimizer step (Adam) plus gradient clipping."""
    op_overhead_s: float
    """Fixed cost per operator call that is not hidden (CPU dispatch); 0 on GPUs whose
    kernel launches run ahead of the device."""
    devices_per_node: int
    """Devices that share one node (and its fast intra-node link)."""
    intra: Link
    """The link between devices of one node."""
    inter: Link
    """The per-device link between nodes."""
    source: str = ""
    """Where the figures come from (datasheet, measurement date and machine)."""
    comm_overlap: float = 1.0
    """Fraction of the compute window that data-parallel / ZeRO / context-parallel
    traffic can hide under: 1 on GPUs (copy engines and NICs move the bytes), 0 for CPU
    ranks of one core each, whose transport threads need the same cores."""
    cpu_adam_params_per_s: float = 0.0
    """Host AdamW parameters per second (ZeRO-Offload's CPU step), measured by ``plait
    bench calibrate`` (:mod:`plait.bench.cpu_adam`); 0: :mod:`plait.plan.offload`'s default."""
    host_link_bytes_per_s: float = 0.0
    """Host<->device bytes/s (PCIe, NVLink-C2C); 0: by device name (plan.offload)."""
    block_overhead_s: float = 0.0
    """Fixed seconds one transformer block's forward + backward costs beyond what the
    rates charge (module calls, autograd bookkeeping, views): measured by ``plait bench
    calibrate`` as a tiny block's time minus the planner's charge for it; 0 on GPUs
    whose launches run ahead of the device."""
    ring_overhead_s: float = 0.0
    """Fixed seconds one layer's ring attention (forward + backward, cp > 1) costs beyond
    what the rates and the in-step exchanges charge (its per-chunk Python calls):
    measured by ``plait bench calibrate`` on pairs of ranks at a tiny shape; 0 on GPUs."""
    pp_action_overhead_s: float = 0.0
    """Fixed seconds one pipeline compute action (a piece's forward or backward of one
    micro-batch) costs beyond what the rates, the point-to-point messages and the loss
    broadcast charge (the schedule's Python, the piece's module calls, one autograd
    backward call per action, receive buffers): measured by ``plait bench calibrate`` on
    a tiny two-stage pipeline (:func:`plait.plan.overheads.pipeline_action_seconds`);
    0 on GPUs."""
    pp_action_per_work: float = 0.0
    """Extra seconds a pipeline rank pays per second of its pieces' compute, on top of
    ``pp_action_overhead_s`` per action: the hand-off of each message costs more the
    more work came before it (on CPU ranks: the transport's threads wake and copy on
    the cores the work just used). Measured by ``plait bench calibrate`` from two
    pipelines of different work per micro-batch (:mod:`plait.bench.calibrate_pipeline`);
    0 on GPUs."""
    block_scale: tuple[tuple[float, float, float], ...] = ()
    """Measured ``(hidden, tokens, ratio)`` points of a rectangular grid: a transformer
    block's forward + backward as measured (a stack of plait's blocks in training, at
    that hidden size and that many tokens per micro-batch) over what the planner charges
    for it with the rates and fixed costs above. What the per-operator rates miss when
    the operators run together (cache misses between them, gradients summed where a
    tensor has several consumers, autograd's nodes at size); interpolated log-bilinearly
    between the grid's points and clamped at its edges
    (:func:`plait.plan.overheads.block_scale`). ``plait bench calibrate`` measures it on
    a grid of powers of two around small CPU models
    (:data:`plait.bench.measure.BLOCK_GRID_DIMS` x :data:`~plait.bench.measure.
    BLOCK_GRID_BATCHES`); empty (a ratio of 1) for presets."""
    tp_block_scale: tuple[tuple[float, float, float], ...] = ()
    """The same kind of grid for a tensor-parallel block at tp = :data:`TP_GRID_DEGREE`
    (without sequence parallelism): the block with its tensor-parallel collectives, timed
    on pairs of ranks all at once (:mod:`plait.bench.tp_block`), over what the planner
    charges for it, compute and in-step collectives together, without ``block_scale``.
    The planner multiplies a tp-2 block's compute and collectives by it, in place of
    ``block_scale`` (:func:`plait.plan.overheads.tp_block_ratio`). What it corrects: the
    sharded block's own composition (its narrower GEMMs, the region functions) and the
    in-step cost of collectives at the work a real block puts between them, with as many
    ranks sharing the machine as calibrated. Empty for presets and one-rank profiles."""
    sp_block_scale: tuple[tuple[float, float, float], ...] = ()
    """:attr:`tp_block_scale` for a block under sequence parallelism (its all-gathers,
    reduce-scatters and norm-gain sums)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("hardware.name must not be empty.")
        if not 0.0 <= self.comm_overlap <= 1.0:
            raise ConfigError(f"hardware.comm_overlap must be in [0, 1], got {self.comm_overlap}.")
        for key in ("memory_bytes", "peak_flops", "optimizer_bandwidth", "devices_per_node"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"hardware.{key} must be positive, got {getattr(self, key)}.")
        if self.op_overhead_s < 0:
            raise ConfigError(f"hardware.op_overhead_s must be >= 0, got {self.op_overhead_s}.")
        if self.ring_overhead_s < 0:
            raise ConfigError(f"hardware.ring_overhead_s must be >= 0, got {self.ring_overhead_s}.")
        if self.block_overhead_s < 0:
            raise ConfigError(
                f"hardware.block_overhead_s must be >= 0, got {self.block_overhead_s}."
            )
        if self.pp_action_per_work < 0:
            raise ConfigError(
                f"hardware.pp_action_per_work must be >= 0, got {self.pp_action_per_work}."
            )
        if self.pp_action_overhead_s < 0:
            raise ConfigError(
                f"hardware.pp_action_overhead_s must be >= 0, got {self.pp_action_overhead_s}."
            )
        for key in GRID_FIELDS:
            _check_grid(key, getattr(self, key))

    def with_memory(self, memory_bytes: float) -> Hardware:
        """The same device with a different memory capacity."""
        return replace(self, memory_bytes=memory_bytes)


def _gpu(
    name: str,
    memory_mib: float,
    peak_tflops: float,
    hbm_tbs: float,
    nvlink_gbs: float,
    nic_gbs: float,
    matmul_eff: float,
    attention_eff: float,
    source: str,
) -> Hardware:
    """A datasheet GPU with the stated achievable fractions (see :data:`PRESETS`);
    ``memory_mib`` is the capacity CUDA reports (``nvidia-smi``'s total): the marketed
    "80 GB" of an A100 or H100 is 80 GiB of HBM (85.9e9 bytes), of which an H100 exposes
    81,559 MiB (79.6 GiB) and an A100 81,920 MiB, not 80e9 bytes (74.5 GiB)."""
    peak = peak_tflops * 1e12
    hbm = hbm_tbs * 1e12
    return Hardware(
        name=name,
        memory_bytes=memory_mib * 2**20,
        peak_flops=peak,
        matmul=Curve.constant(peak * matmul_eff),
        attention=Curve.constant(peak * attention_eff),
        elementwise=Curve.constant(hbm * ELEMENTWISE_EFFICIENCY),
        optimizer_bandwidth=hbm * ELEMENTWISE_EFFICIENCY,
        op_overhead_s=0.0,
        devices_per_node=8,
        intra=Link(NVLINK_ALPHA_S, nvlink_gbs * 1e9 * LINK_EFFICIENCY),
        inter=Link(IB_ALPHA_S, nic_gbs * 1e9 * LINK_EFFICIENCY),
        source=source,
    )


ELEMENTWISE_EFFICIENCY = 0.7
"""Assumed fraction of HBM bandwidth that memory-bound kernels reach."""
LINK_EFFICIENCY = 0.8
"""Assumed fraction of a link's datasheet bandwidth a ring collective reaches (nccl-tests
bus bandwidth is typically 75-90 % of the per-direction figure)."""
NVLINK_ALPHA_S = 3e-6
"""Assumed per-step latency of an intra-node (NVLink) collective step."""
IB_ALPHA_S = 8e-6
"""Assumed per-step latency of an inter-node (InfiniBand/RoCE) collective step."""

PRESETS: dict[str, Hardware] = {
    "a100-40gb": _gpu(
        "a100-40gb",
        40960,
        312,
        1.555,
        300,
        25,
        0.80,
        0.55,
        "NVIDIA A100 SXM4 40GB datasheet: 312 TFLOP/s dense bf16, 1.555 TB/s HBM2, "
        "NVLink3 600 GB/s bidirectional (300 per direction), 1x HDR 200 Gb/s NIC per GPU "
        "(DGX A100); 80 % of peak on large GEMMs, 55 % in FlashAttention-2 (assumed).",
    ),
    "a100-80gb": _gpu(
        "a100-80gb",
        81920,
        312,
        2.039,
        300,
        25,
        0.80,
        0.55,
        "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e, "
        "NVLink3 300 GB/s per direction, 1x HDR 200 Gb/s NIC per GPU (DGX A100); "
        "80 % of peak on large GEMMs, 55 % in FlashAttention-2 (assumed).",
    ),
    "h100-80gb": _gpu(
        "h100-80gb",
        81559,
        989,
        3.35,
        450,
        50,
        0.75,
        0.45,
        "NVIDIA H100 SXM5 80GB datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, "
        "NVLink4 900 GB/s bidirectional (450 per direction), 1x NDR 400 Gb/s NIC per GPU "
        "(DGX H100); 75 % of peak on large GEMMs, 45 % in FlashAttention-2 (assumed).",
    ),
    "h200": _gpu(
        "h200",
        143771,
        989,
        4.8,
        450,
        50,
        0.75,
        0.45,
        "NVIDIA H200 SXM 141GB datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, "
        "NVLink4 450 GB/s per direction, 1x NDR 400 Gb/s NIC per GPU; "
        "75 % of peak on large GEMMs, 45 % in FlashAttention-2 (assumed).",
    ),
}
"""Datasheet hardware presets (nodes of 8 devices)."""


def hardware_preset(name: str) -> Hardware:
    """The preset ``name``; unknown names are refused with the list."""
    if name not in PRESETS:
        raise ConfigError(
            f"unknown hardware preset {name!r}; choose one of {', '.join(sorted(PRESETS))}, "
            "or pass a profile written by `plait bench calibrate` (a .toml path)."
        )
    return PRESETS[name]


@dataclass(frozen=True)
class Cluster:
    """How many devices of one kind a job gets."""

    hardware: Hardware
    """The device (and its links)."""
    num_devices: int
    """Total devices; nodes hold ``hardware.devices_per_node`` each."""

    def __post_init__(self) -> None:
        if self.num_devices <= 0:
            raise ConfigError(f"the number of devices must be positive, got {self.num_devices}.")

    @property
    def nodes(self) -> int:
        """Nodes used (the last one may be partly used)."""
        return -(-self.num_devices // self.hardware.devices_per_node)
