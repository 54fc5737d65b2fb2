"""The gradient reducer: coordinates a ZeRO wrapper's per-unit reductions (the gradient path).

Under the autograd driver a post-accumulate-grad hook on every flattened parameter hands
its gradient to :meth:`GradientReducer.on_grad`; when every parameter of a unit has one,
the unit's flat ``(padded,)`` gradient is reduce-scattered asynchronously over the shard
group (ReduceScatter, Rajbhandari et al. 2020), the average landing in this rank's
``(shard_numel,)`` piece; with hybrid sharding the piece is then all-reduced over the
replicate group (AllReduce). Stages 0/1 keep full gradient buffers (``.grad`` is a view
into them) and communicate only in the synchronising backward (``no_sync`` accumulates
locally), launching each unit's reduce-scatter from the hook and waiting for them only
at the end of backward; stages 2/3 reduce on every backward and keep only the shard.
Stage 2 writes each gradient straight into its bucket's reduce-scatter input, a buffer of
a :class:`~plait.parallel.zero.bucket.BufferRing` kept across steps (the same storage
every step, as DataParallel's buckets; ``MAX_REDUCES_IN_FLIGHT + 1`` buffers of the
largest bucket, or each bucket's own when that is less: at most the model's gradients);
stage 3 copies them into a transient per-unit buffer. Stages 2/3 add each averaged
shard into the unit's ``grad_shard`` as soon as its reduce-scatter is waited for (the
in-flight cap), so at most the outputs of the reductions in flight exist beside the
gradient shards, not one per unit until the end of backward.

:class:`GradientReducer` owns the units' reductions for one
:class:`~plait.parallel.zero.ZeroDataParallel`, behind an interface that names no
driver: what to reduce (:meth:`~GradientReducer.on_grad`, a parameter's gradient as
autograd makes it; :meth:`~GradientReducer.reduce`, a unit's gradients accumulated in
``.grad``), when (:meth:`~GradientReducer.finish_backward` / :meth:`~GradientReducer.finish`
complete every reduction; :meth:`~GradientReducer.abandon` after a failure), the cap on
reduce-scatters in flight (stage 3: launching one more completes the oldest, freeing its
transient buffer, in ``_cap``; stage 2: a bucket that finds every kept buffer in use
completes the oldest, in ``_hold``), the gradient-buffer bytes, and the refusal
of parameters that got no gradient (:class:`~plait.errors.UnusedParametersError`, unless
``find_unused_parameters``). Two drivers call it, handed it in a
:class:`~plait.parallel.zero.drive.ZeroDrive`: the autograd hooks
(:class:`~plait.parallel.zero.driver.AutogradDriver`) or the pipeline schedule
(:class:`~plait.parallel.pipeline.zero.PipelineZero`). It reports to its observers only:
``note`` (events) and :attr:`~GradientReducer.on_launch`.

With ``bucket_bytes`` (stages 1/2) a unit whose gradients are complete waits for the rest
of its :class:`~plait.parallel.zero.bucket.GradBucket`; the bucket goes out in one call.
Each unit's reduction is a :class:`~plait.parallel.zero.unit_reduction.UnitReduction` (its
states and transitions are listed there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait import comm
from plait.comm import AxisGroup
from plait.errors import UnusedParametersError
from plait.parallel.zero.bucket import BufferRing, GradBucket, plan_buckets
from plait.parallel.zero.flat import FlatUnit
from plait.parallel.zero.unit_reduction import ReduceState, UnitReduction


class GradientReducer:
    """The backward-time gradient path of one ZeRO-wrapped module.

    Args:
        units: the wrapper's flat units.
        stage: the ZeRO stage (0/1 keep full gradient buffers, 2/3 transient ones).
        shard_group, replicate_group: the hybrid-sharding groups of the dp axis (a unit
            with groups of its own, :attr:`FlatUnit.groups`, is reduced over those).
        reduce_dtype: the dtype gradients are reduced in.
        device: where the transient buffers live.
        find_unused_parameters: reduce zeros for parameters with no gradient.
        note: records an event ``(kind, unit name)`` (tests read the order).
        bucket_bytes: stages 1/2: reduce-scatter consecutive units together in buckets of
            at least this many bytes (None: one reduce-scatter per unit).
    """

    MAX_REDUCES_IN_FLIGHT = 2
    """Stages 2/3: reduce-scatters allowed in flight before the oldest is completed (its
    transient full gradient buffer is freed then; stage 2 keeps one more buffer than this,
    for the bucket collecting gradients, and waits only when all are in use). Stages 0/1
    reduce from the persistent gradient buffers and wait for nothing before the end of
    backward."""

    def __init__(
        self,
        units: list[FlatUnit],
        stage: int,
        shard_group: AxisGroup,
        replicate_group: AxisGroup,
        reduce_dtype: torch.dtype,
        device: torch.device,
        find_unused_parameters: bool,
        note: Callable[[str, str], None],
        bucket_bytes: int | None = None,
    ) -> None:
        self.units = [UnitReduction(u) for u in units]
        fuse = bucket_bytes is not None and stage in (1, 2) and shard_group.size > 1
        size = torch.empty((), dtype=reduce_dtype).element_size()
        self.buckets = (
            plan_buckets(self.units, bucket_bytes, size)  # type: ignore[arg-type]
            if fuse
            else [GradBucket([r]) for r in reversed(self.units)]
        )
        self._bucket_of = {r.unit.index: b for b in self.buckets for r in b.units}
        self._pos = {r.unit.index: k for b in self.buckets for k, r in enumerate(b.units)}
        self.ring: BufferRing | None = None  # stage 2: the reduce-scatter inputs, kept
        if stage == 2 and self.buckets:
            # K buffers of the largest bucket, or each bucket's own when that is less
            k, sizes = self.MAX_REDUCES_IN_FLIGHT + 1, [b.numel for b in self.buckets]
            own = sum(sizes) <= k * max(sizes)
            self.ring = BufferRing(
                len(sizes) if own else k, None if own else max(sizes), reduce_dtype, device
            )
        self.stage = stage
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.reduce_dtype, self.device = reduce_dtype, device
        self.find_unused_parameters = find_unused_parameters
        self._note = note
        self.on_launch: Callable[[FlatUnit], None] | None = None
        """Called with a unit once its reduce-scatter is launched (the autograd driver
        frees a stage-3 unit's gathered parameters then); None: nothing."""
        self.on_reduced: Callable[[FlatUnit], None] | None = None
        """Called with a unit once its averaged gradient shard of a synchronising
        backward is final (ZeRO-Offload copies it to the host and may step it then)."""
        self.fold_outputs = True
        """Stages 2/3: add each reduce-scatter output into ``grad_shard`` once it is
        waited for (False: keep every output to :meth:`finish`, the end of backward, as
        before issue 44; a benchmark compares the two)."""
        self.settle_early = False
        """Complete each reduction as soon as its reduce-scatter is waited for (the
        in-flight cap applies to every stage), so :attr:`on_reduced` fires during
        backward (ZeRO-Offload's overlap); False: at the end of backward."""
        self._early: set[int] = set()  # units settled before finish() this backward
        self.sync = True  # False inside no_sync (stages 0/1 accumulate locally)
        self.in_backward = False
        self.grad_buffer_bytes = 0  # stages 2/3: gradient buffers in use, and the peak
        self.peak_grad_buffer_bytes = 0
        self._launched: list[UnitReduction] = []  # in launch order, this backward

    # ------------------------------------------------------------------ what to reduce

    @property
    def communicates(self) -> bool:
        """Whether a gradient arriving now is reduced in this backward (stages 0/1 inside
        ``no_sync`` accumulate locally instead)."""
        return self.sync or self.stage >= 2

    def begin_backward(self) -> bool:
        """Note that a reducing backward pass runs; returns whether it is new (the caller
        then arranges :meth:`finish_backward` at its end)."""
        if self.in_backward:
            return False
        self.in_backward = True
        self._note("backward", "")
        return True

    def on_grad(self, u: FlatUnit, i: int, p: torch.Tensor) -> None:
        """Parameter ``i`` of ``u`` has its accumulated gradient ``p.grad`` (in a backward
        begun by :meth:`begin_backward`); the unit is launched once all of its are in."""
        assert p.grad is not None
        if not self.communicates:
            return
        if self.stage <= 1:
            assert u.grad_full is not None
            view = u.view(i, u.grad_full)
            if p.grad.data_ptr() != view.data_ptr():  # .grad was replaced: adopt its value
                view.copy_(p.grad)
                p.grad = view
        elif self.ring is not None:  # stage 2: into the bucket's kept buffer
            b = self._bucket_of[u.index]
            self._hold(b)
            b.write(self._pos[u.index], i, p.grad)
            p.grad = None
        else:
            if u.grad_full is None:
                self._alloc_buffer(u)
            assert u.grad_full is not None
            u.view(i, u.grad_full).copy_(p.grad)
            p.grad = None
        r = self.units[u.index]
        if r.mark_ready(i):
            self._note("grad", u.name)  # the unit's first gradient arrived
        if r.complete:
            self._complete(r)

    # ------------------------------------------------------------------ pieces

    def _alloc_buffer(self, u: FlatUnit) -> None:
        """Stages 2/3: a transient ``(padded,)`` buffer for ``u``'s full gradients (every
        parameter's run is written by its hook or zeroed at the end of backward; only
        the padding is zeroed here)."""
        u.grad_full = torch.empty(u.padded, dtype=self.reduce_dtype, device=self.device)
        u.grad_full[u.numel :].zero_()
        self.grad_buffer_bytes += u.grad_full.numel() * u.grad_full.element_size()
        self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self.grad_buffer_bytes)

    def _hold(self, b: GradBucket) -> None:
        """Stage 2: give ``b`` a kept buffer (its padding zeroed) unless it has one; with
        every buffer in use, the oldest reduce-scatter in flight is completed first (it
        gives its buffer back)."""
        assert self.ring is not None
        if b.buffer is not None:
            return
        while self.ring.full(b.numel):
            oldest = next((v for v in self._launched if v.state is ReduceState.SCATTERING), None)
            if oldest is None:  # nothing to wait for: the ring grows by one
                break
            self._finish_scatter(oldest)
        b.buffer = self.ring.take(b.numel)
        b.zero_padding()
        self.grad_buffer_bytes += b.buffer.numel() * b.buffer.element_size()
        self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self.grad_buffer_bytes)

    def _release(self, b: GradBucket) -> None:
        """``b``'s reduce-scatter input is no longer needed: back to the ring (stage 2) or
        freed."""
        if b.buffer is not None:
            self.grad_buffer_bytes -= b.buffer.numel() * b.buffer.element_size()
            if self.ring is not None:
                self.ring.give(b.buffer)
            b.buffer = None

    @property
    def kept_grad_buffer_bytes(self) -> int:
        """Stage 2: bytes of the gradient buffers kept across steps (0 otherwise)."""
        return self.ring.kept_bytes if self.ring is not None else 0

    def _drop_buffer(self, u: FlatUnit) -> None:
        if self.stage >= 2 and u.grad_full is not None:
            self.grad_buffer_bytes -= u.grad_full.numel() * u.grad_full.element_size()
            u.grad_full = None

    def _complete(self, r: UnitReduction) -> None:
        """``r``'s gradients are final: reduce-scatter its bucket once every unit of the
        bucket is (a bucket of one unit goes at once)."""
        b = self._bucket_of[r.unit.index]
        if len(b.units) == 1 and self.ring is None:
            self._launch(r)
            return
        b.done.add(r.unit.index)
        if len(b.done) == len(b.units):
            self._launch_bucket(b)

    def _launch_bucket(self, b: GradBucket) -> None:
        """One reduce-scatter for the units of ``b`` (see :class:`GradBucket`; its units
        share their groups)."""
        f = self._shard_group(b.units[0].unit).size
        if self.ring is not None:  # stage 2: the gradients were written into it
            assert b.buffer is not None
            buf = b.buffer
        else:
            buf = torch.empty(f * b.width, dtype=self.reduce_dtype, device=self.device)
            grid = buf.view(f, b.width)  # (F, width): row r = chunk r of every unit
            for r, col in zip(b.units, b.cols, strict=True):
                u = r.unit
                assert u.grad_full is not None
                grid[:, col : col + u.shard_numel].copy_(u.grad_full.view(f, u.shard_numel))
            b.buffer = buf
            self.grad_buffer_bytes += buf.numel() * buf.element_size()
            self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self.grad_buffer_bytes)
        out, h = comm.reduce_scatter(
            buf, self._shard_group(b.units[0].unit), op="avg", async_op=True
        )
        for r, col in zip(b.units, b.cols, strict=True):
            r.joined(out[col : col + r.unit.shard_numel], h, buf)
            self._launched.append(r)
            self._note("reduce", r.unit.name)
        b.done.clear()
        if self.ring is None or self.settle_early:  # offload: gradients out during backward
            self._cap()

    def _launch(self, r: UnitReduction) -> None:
        """Reduce-scatter ``r``'s unit (from its ``(padded,)`` ``grad_full``)."""
        u = r.unit
        assert u.grad_full is not None
        buffer = u.grad_full.to(self.reduce_dtype)  # (padded,) a copy only if dtypes differ
        r.launch(buffer, self._shard_group(u))
        self._launched.append(r)
        self._note("reduce", u.name)
        if self.on_launch is not None:
            self.on_launch(u)
        self._cap()

    def _cap(self) -> None:
        """Stage 3: at most ``MAX_REDUCES_IN_FLIGHT`` reduce-scatters stay in flight;
        one more completes the oldest, which frees its transient buffer. Stages 0/1 reduce
        from persistent buffers: nothing to free early, nothing to wait for; stage 2 waits
        in backward only when a bucket finds its kept buffers all in use (``_hold``)."""
        if self.stage <= 1 and not self.settle_early:
            return
        in_flight = [v for v in self._launched if v.state is ReduceState.SCATTERING]
        for v in in_flight[: max(0, len(in_flight) - self.MAX_REDUCES_IN_FLIGHT)]:
            self._finish_scatter(v)

    def _finish_scatter(self, r: UnitReduction) -> None:
        self._end_scatter(r)
        if (self.settle_early and self.sync) or self._folds(r):
            self._settle(r)
            self._early.add(r.unit.index)

    def _folds(self, r: UnitReduction) -> bool:
        """Stages 2/3: a reduce-scatter output waited for is added into the unit's
        ``grad_shard`` at once and dropped (one output per reduction in flight, not one
        per unit to the end of backward), unless the replicas' all-reduce (hybrid
        sharding) is still in flight, or an :attr:`on_reduced` observer is told when
        (ZeRO-Offload: :attr:`settle_early` decides); those wait for :meth:`finish`."""
        alone = self._replicate_group(r.unit).size == 1 and self.on_reduced is None
        return self.fold_outputs and self.stage >= 2 and alone

    def _shard_group(self, u: FlatUnit) -> AxisGroup:
        """The group ``u``'s gradient is reduce-scattered over (its own, or the wrapper's)."""
        return u.groups[0] if u.groups is not None else self.shard_group

    def _replicate_group(self, u: FlatUnit) -> AxisGroup:
        """The group ``u``'s gradient shard is all-reduced over (hybrid sharding)."""
        return u.groups[1] if u.groups is not None else self.replicate_group

    def _end_scatter(self, r: UnitReduction) -> None:
        r.finish_scatter(self._replicate_group(r.unit))
        self._note("scattered", r.unit.name)  # its reduce-scatter was waited for
        self._drop_buffer(r.unit)
        self._release(self._bucket_of[r.unit.index])  # the bucket's input is not needed

    def _settle(self, r: UnitReduction) -> None:
        """Complete ``r``'s reduction: stages 0/1 keep the averaged shard (REDUCED), 2/3
        add it into the unit's ``grad_shard`` (IDLE again)."""
        if r.state is ReduceState.SCATTERING:
            self._end_scatter(r)
        out = r.finish(keep=self.stage <= 1)
        if self.stage >= 2:
            assert r.unit.grad_shard is not None
            r.unit.grad_shard.add_(out)
        if self.sync and self.on_reduced is not None:
            self.on_reduced(r.unit)

    def _refuse_unused(self, missing: list[str]) -> None:
        """Parameters with no gradient: zeros are reduced for them with
        ``find_unused_parameters``; otherwise the reductions are abandoned and refused."""
        if missing and not self.find_unused_parameters:
            self.abandon()
            raise UnusedParametersError(missing)

    # ------------------------------------------------------------------ when

    @torch.no_grad()
    def reduce(self, u: FlatUnit) -> None:
        """Stages 2/3: reduce-scatter ``u``'s gradients accumulated in ``.grad`` now (a
        driver that lets autograd accumulate over several backwards: the pipeline) and
        drop them. A unit reduced again before :meth:`finish` adds its previous shard
        first; a parameter with no gradient is refused as at the end of backward."""
        assert self.stage >= 2
        r = self.units[u.index]
        if r.in_flight:
            self._launched.remove(r)
            self._settle(r)
        elif u.index in self._early:  # its previous output is already in grad_shard
            self._early.discard(u.index)
            self._launched.remove(r)
        self._refuse_unused([u.names[i] for i, p in enumerate(u.params) if p.grad is None])
        self._alloc_buffer(u)
        full = u.grad_full
        assert full is not None
        for i, p in enumerate(u.params):
            if p.grad is None:
                u.view(i, full).zero_()
            else:
                u.view(i, full).copy_(p.grad)
                p.grad = None
        self._launch(r)

    def finish(self) -> None:
        """Wait for every launched reduction (in launch order): stages 0/1 keep the
        averaged shards, 2/3 add them into the units' ``grad_shard``."""
        for r in self._launched:
            if r.state is ReduceState.SCATTERING:
                self._finish_scatter(r)
        for r in self._launched:
            if r.unit.index not in self._early:
                self._settle(r)
        self._launched = []
        self._early = set()

    def finish_backward(self) -> None:
        """End of a synchronising backward: reduce what is left (zeros for parameters
        with no gradient, or refused), wait, keep the shards."""
        self.in_backward = False
        missing = [
            r.unit.names[i]
            for r in self.units
            if not r.in_flight and r.unit.index not in self._early
            for i in range(len(r.unit.params))
            if i not in r.ready
        ]
        self._refuse_unused(missing)
        for r in self.units:
            if r.in_flight or r.unit.index in self._early:  # launched during backward
                continue
            u = r.unit
            if self.ring is not None:  # stage 2: zeros in the bucket's kept buffer
                b = self._bucket_of[u.index]
                self._hold(b)
                for i in range(len(u.params)):
                    if i not in r.ready:
                        b.write(self._pos[u.index], i, None)
                self._complete(r)
                continue
            if u.grad_full is None:
                self._alloc_buffer(u)
            full = u.grad_full
            assert full is not None
            if self.stage >= 2:  # a fresh buffer: the missing gradients count as zeros
                for i in range(len(u.params)):
                    if i not in r.ready:
                        u.view(i, full).zero_()
            self._complete(r)
        self.finish()

    def abandon(self) -> None:
        """A failed backward or step: complete what is in flight, drop buffers and states."""
        self.in_backward = False
        for r in self._launched:
            if r.unit.index in self._early:
                continue
            if r.state is ReduceState.SCATTERING:
                r.finish_scatter(self._replicate_group(r.unit))
            r.finish(keep=False)
        self._launched = []
        self._early = set()
        for r in self.units:
            r.reset()
            self._drop_buffer(r.unit)
        for b in self.buckets:
            b.done.clear()
            self._release(b)

    def reduced(self, u: FlatUnit) -> torch.Tensor | None:
        """Stages 0/1: the averaged shard of ``u`` from the last synchronising backward."""
        r = self.units[u.index]
        return r.shard if r.state is ReduceState.REDUCED else None

    def reset_peak(self) -> None:
        """Restart the peak of transient gradient-buffer bytes from what is alive now."""
        self.peak_grad_buffer_bytes = self.grad_buffer_bytes

    def reset(self) -> None:
        """``zero_grad``: every unit back to IDLE."""
        for r in self.units:
            r.reset()
        for b in self.buckets:
            b.done.clear()
