"""ZeRO-Offload's host side: gradients out during backward, the CPU step per unit, overlap.

With ``offload = optimizer`` (or ``params``) the fp32 masters and the optimizer state of
this rank's shards live on the host (Ren et al. 2021, "ZeRO-Offload"). :class:`HostStep`
runs the host side of one :class:`~plait.parallel.zero.optim.ShardedMasters`:

* **gradients leave the device unit by unit during backward**: the reducer calls
  :meth:`HostStep.on_reduced` as soon as a unit's averaged gradient shard of the
  synchronising backward is final (the reducer's early settling, see
  :attr:`~plait.parallel.zero.reducer.GradientReducer.settle_early`); the shard is
  copied into one of a **ring** of fp32 host landing buffers (pinned, on a side stream,
  with CUDA);
* **the CPU step of a unit starts as soon as its gradients land** (``eager``): a worker
  thread steps that unit's segments with the fused multi-threaded CPU AdamW
  (:mod:`plait.parallel.zero.cpu_adam`) while backward goes on, then copies the
  updated master into the device shard (non-blocking from pinned memory on a side
  stream with CUDA). Eager stepping needs a step that does not depend on the global
  gradient norm: no clipping (``max_norm = 0``), no fp16 loss scaling, and
  ``nonfinite = 'error'`` (a skipped step could not be undone). Otherwise the step
  runs after the norm in **two passes**: the global norm is taken from the reduced
  shards still on the device (:meth:`HostStep.grads_for_step`), then unit by unit the
  shard is copied into a ring buffer, unscaled/clipped there (:meth:`HostStep.scale`)
  and stepped on the worker, the next unit's copy overlapping this one's step;
* :meth:`HostStep.step` waits for the worker and the copies back; the caller then
  launches ZeRO-1/2's all-gathers, which complete unit by unit just before each unit's
  next forward (so the parameters' return overlaps the start of the next forward).

**Host memory** is the masters, the optimizer state and the ring: ``OFFLOAD_RING_BUFFERS``
(:mod:`plait.config.rules.features`) buffers the size of the largest unit's shard. A buffer is
reused once the host step of the unit that landed in it has finished (the landing waits
for it), so at most that many units' gradients are on the host in every mode but one:
the one-step-delayed update (``offload_delay``) keeps one buffer per unit, because its
host step reads the gradients while the next backward overwrites the device's.

With ``offload_dir`` the state (and with ``params`` the masters) are file-backed
(:mod:`plait.parallel.zero.offload_store`), the next slot's file read ahead while one
steps. :attr:`HostStep.events` records ``(kind, unit, seconds)`` of the last step:
``landed`` (gradient copy issued), ``step_start``, ``step_end``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from plait.config.rules.features import OFFLOAD_RING_BUFFERS
from plait.parallel.zero.flat import FlatUnit
from plait.parallel.zero.offload_store import OffloadStore, check_offload_dir, disk_bytes_needed

if TYPE_CHECKING:
    from plait.parallel.zero.optim import ShardedMasters, Slot


def _pinned(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``(numel,)`` zeros on the host, page-locked when ``pin`` (CUDA runs)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


class HostStep:
    """The host side of ``masters`` (see the module docstring).

    Args:
        masters: the sharded masters (on the CPU) and their inner optimizer.
        offload_dir: keep the optimizer state (and the masters with ``params``) in
            files there (None: in host memory).
        rank: this process's rank (the files' folder).
    """

    def __init__(
        self, masters: ShardedMasters, offload_dir: str | None = None, rank: int = 0
    ) -> None:
        zero = masters.zero
        self.masters = masters
        self.zero = zero
        self.cuda = zero.device.type == "cuda"
        self.eager = False
        self.events: list[tuple[str, str, float]] = []
        self._fresh = True  # the next note starts a new record of events
        self.started = threading.Event()  # set when the first step of a step begins
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="plait-cpu-adam")
        self._futures: dict[int, Future[None]] = {}
        self._landed: dict[int, Any] = {}  # slot index -> CUDA event (None on the CPU)
        self._back: dict[int, Any] = {}  # slot index -> CUDA event of the copy back
        self._index = {s.unit.index: k for k, s in enumerate(masters.slots)}
        self.delay = zero.offload_delay  # one-step-delayed update (opt-in)
        self.grads = self._landing_buffers()
        self._users: list[int | None] = [None] * len(self.grads)  # buffer -> slot in it
        self._buffer_of: dict[int, int] = {}  # slot -> ring buffer it landed in
        self._next = 0  # the ring buffer the next landing takes
        self._factors: list[float] = []  # unscale / clip factors applied after landing
        self._d2h = torch.cuda.Stream(zero.device) if self.cuda else None
        self._h2d = torch.cuda.Stream(zero.device) if self.cuda else None
        self.store: OffloadStore | None = None
        if offload_dir is not None:
            self._to_files(offload_dir, rank)
        in_files = self.store is not None and zero.offload == "params"
        if self.cuda and not in_files:  # page-locked masters: the copy back is asynchronous
            for s in masters.slots:
                if not s.alias:
                    s.master = s.master.pin_memory()
                    masters.rebind(s)
        if zero.driven_by == "autograd" and not self.delay:  # settle the reductions early
            zero.reducer.settle_early = True
        zero.reducer.on_reduced = self.on_reduced

    def _landing_buffers(self) -> list[torch.Tensor]:
        """The host landing buffers (the masters' dtype): one per slot (delayed), else the ring
        (``(largest shard_numel,)`` each, :data:`OFFLOAD_RING_BUFFERS` or fewer)."""
        slots = self.masters.slots
        dtype = slots[0].master.dtype if slots else torch.float32  # fp32 (fp64 kept)
        if self.delay:
            return [_pinned(s.master.numel(), dtype, self.cuda) for s in slots]
        n = max((s.master.numel() for s in slots), default=0)
        count = min(OFFLOAD_RING_BUFFERS, len(slots))
        return [_pinned(n, dtype, self.cuda) for _ in range(count)]

    def _buffer(self, k: int) -> torch.Tensor:
        """Slot ``k``'s landed gradient: ``(shard_numel,)`` fp32 on the host."""
        n = self.masters.slots[k].master.numel()
        return self.grads[k if self.delay else self._buffer_of[k]][:n]

    def _acquire(self, k: int) -> torch.Tensor:
        """Take the next ring buffer for slot ``k``, once the host step of the slot that
        last landed there has finished reading it."""
        b = self._next % len(self.grads)
        self._next += 1
        prev = self._users[b]
        if prev is not None and prev in self._futures:
            self._futures[prev].result()
        self._users[b] = k
        self._buffer_of[k] = b
        return self._buffer(k)

    def _land(self, k: int) -> None:
        """Copy slot ``k``'s reduced gradient shard into a ring buffer (asynchronous on
        a side stream with CUDA: the step waits for the recorded event)."""
        g = self.zero.reduced_grad(self.masters.slots[k].unit)  # (shard_numel,) reduce dtype
        host = self._acquire(k)
        ev = None
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.zero.device))
            with torch.cuda.stream(self._d2h):
                host.copy_(g, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._d2h)
            g.record_stream(self._d2h)
        else:
            host.copy_(g)
        self._landed[k] = ev

    # ------------------------------------------------------------------ files

    def _to_files(self, folder: str, rank: int) -> None:
        """Move the state (Adam's m and v; the masters with ``params``) into files."""
        slots = self.masters.slots
        with_masters = self.zero.offload == "params"
        dtype = slots[0].master.dtype if slots else torch.float32  # fp32 (fp64 kept)
        item = torch.empty((), dtype=dtype).element_size()
        check_offload_dir(
            folder, disk_bytes_needed([s.master.numel() for s in slots], with_masters, item)
        )
        self.store = OffloadStore(folder, rank)
        inner = self.masters.inner
        adam = type(inner).__name__ in ("Adam", "AdamW")
        for k, s in enumerate(slots):
            n = s.master.numel()
            parts = [n, n, n] if with_masters else [n, n]
            f = self.store.add(k, parts, dtype)
            if with_masters:
                f.parts[0].copy_(s.master)
                s.master = f.parts[0]
                self.masters.rebind(s)
            m, v = f.parts[-2], f.parts[-1]
            for seg, a, b in s.segments:
                if adam:  # the state torch's Adam would create, in the file
                    group = next(
                        g for g in inner.param_groups if any(p is seg for p in g["params"])
                    )
                    inner.state[seg] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": m[a:b].zero_(),
                        "exp_avg_sq": v[a:b].zero_(),
                    }
                    if group.get("amsgrad", False):
                        inner.state[seg]["max_exp_avg_sq"] = torch.zeros(b - a, dtype=dtype)

    def _rebind_state(self, k: int) -> None:
        """Keep slot ``k``'s Adam state in its file after a checkpoint load replaced the
        tensors (the loaded values are copied in)."""
        if self.store is None:
            return
        f = self.store.slots[k]
        m, v = f.parts[-2], f.parts[-1]
        for seg, a, b in self.masters.slots[k].segments:
            st = self.masters.inner.state.get(seg)
            if not st:
                continue
            for key, part in (("exp_avg", m[a:b]), ("exp_avg_sq", v[a:b])):
                t = st.get(key)
                if t is not None and t.data_ptr() != part.data_ptr():
                    part.copy_(t)
                    st[key] = part

    # ------------------------------------------------------------------ backward

    def on_reduced(self, u: FlatUnit) -> None:
        """``u``'s gradient shard is final: copy it to the host; step it when eager."""
        k = self._index.get(u.index)
        # delayed: the buffers are busy (copied at the step); not eager: landed after the
        # norm (two passes); under another driver (the pipeline) a unit may settle once
        # per micro-batch: copied at the step too
        if k is None or self.delay or not self.eager or self.zero.driven_by != "autograd":
            return
        self._land(k)
        self._note("landed", u.name)
        self._submit(k)

    def _submit(self, k: int) -> None:
        if k not in self._futures:
            self._futures[k] = self._pool.submit(self._step_slot, k, True)

    # ------------------------------------------------------------------ the step

    @property
    def scales_on_host(self) -> bool:
        """The gradients :meth:`grads_for_step` returns are the device's reduced shards
        (the ring): unscale and clip through :meth:`scale`, not in place."""
        return not self.delay

    def scale(self, factor: float) -> None:
        """Multiply every slot's gradient by ``factor`` once it has landed (before its
        host step; the factors apply in the order given)."""
        self._factors.append(factor)

    def grads_for_step(self) -> list[torch.Tensor]:
        """The gradients the global norm is taken from: the reduced shards on the device
        (``(shard_numel,)`` reduce dtype each; they land in the ring at :meth:`step`).
        Delayed: the host buffers, every slot's landed (copied now), once the previous
        step's host update has finished (it reads these buffers)."""
        if not self.delay:
            return [self.zero.reduced_grad(s.unit) for s in self.masters.slots]
        self._wait()
        for k, s in enumerate(self.masters.slots):
            if k not in self._landed:
                self.grads[k].copy_(self.zero.reduced_grad(s.unit))
                self._landed[k] = None
        for ev in self._landed.values():
            if ev is not None:
                ev.synchronize()
        return self.grads

    def _step_slot(self, k: int, copy_back: bool) -> None:
        """Step slot ``k`` on the host and (``copy_back``) copy its master into the
        device shard."""
        slot = self.masters.slots[k]
        self._note("step_start", slot.unit.name)
        self.started.set()
        ev = self._landed.get(k)
        if ev is not None:
            ev.synchronize()
        back = self._back.pop(k, None)
        if back is not None:  # the last copy back read this master: done before writing
            back.synchronize()
        if self.store is not None:
            self._rebind_state(k)
            if k + 1 < len(self.store.slots):
                self.store.slots[k + 1].prefetch()  # read the next slot ahead
        grad = self._buffer(k)
        for f in self._factors:  # unscale / clip (after the norm)
            grad.mul_(f)
        for seg, a, b in slot.segments:
            seg.grad = grad[a:b]
        try:
            self.masters.inner.step()
        finally:
            for seg, _, _ in slot.segments:
                seg.grad = None
        if copy_back:
            self._copy_back(k, slot)
        self._note("step_end", slot.unit.name)

    def _copy_back(self, k: int, slot: Slot) -> None:
        if slot.alias:
            return
        shard = self.zero.param_shard(slot.unit)  # (shard_numel,) model dtype
        if self._h2d is None:
            shard.copy_(slot.master)
            return
        with torch.cuda.stream(self._h2d):
            shard.copy_(slot.master, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        self._back[k] = ev

    @torch.no_grad()
    def step(self) -> None:
        """Step every slot not stepped yet (in order, on the worker), wait for them and
        for the copies back; the device's stream then waits for the copies.

        Delayed (``offload_delay``): the previous step's update is complete (see
        :meth:`grads_for_step`); its masters go to the device now and this step's
        update starts on the worker and is left running through the next forward and
        backward (the device computes the next gradients one update behind)."""
        if self.delay:
            for k, slot in enumerate(self.masters.slots):
                self._copy_back(k, slot)
            self._device_waits()
            self._submit_all(copy_back=False)
            self._landed = {}
            return
        for k in range(len(self.masters.slots)):  # the rest lands and steps unit by unit
            if k not in self._futures:
                self._land(k)
                self._note("landed", self.masters.slots[k].unit.name)
                self._submit(k)
        self._wait()

    def _submit_all(self, copy_back: bool = True) -> None:
        for k in range(len(self.masters.slots)):
            if k not in self._futures:
                self._futures[k] = self._pool.submit(self._step_slot, k, copy_back)

    def _wait(self) -> None:
        """Complete every submitted host step and its copy back."""
        try:
            for k in sorted(self._futures):
                self._futures[k].result()
        finally:
            self._futures = {}
            self._landed = {}
            self._reset_ring()
            self.started.clear()
            self._fresh = True
        self._device_waits()

    def _reset_ring(self) -> None:
        self._users = [None] * len(self.grads)
        self._buffer_of = {}
        self._next = 0
        self._factors = []

    def _device_waits(self) -> None:
        if self.cuda:
            stream = torch.cuda.current_stream(self.zero.device)
            for ev in self._back.values():
                stream.wait_event(ev)

    @torch.no_grad()
    def flush(self) -> bool:
        """Delayed: finish the pending update and put its masters on the device (before
        a checkpoint reads them); returns whether there was one (the caller re-gathers:
        ZeRO-1/2)."""
        if not self.delay or not self._futures:
            return False
        self._wait()
        for k, slot in enumerate(self.masters.slots):
            self._copy_back(k, slot)
        self._device_waits()
        return True

    def discard(self) -> None:
        """A skipped step: forget the landed gradients (nothing was stepped)."""
        self._landed = {}
        self._reset_ring()
        self._fresh = True

    def _note(self, kind: str, name: str) -> None:
        with self._lock:
            if self._fresh:  # the first event after a step: a new record
                self.events, self._fresh = [], False
            self.events.append((kind, name, time.perf_counter()))

    def close(self) -> None:
        """Stop the worker thread once its current task ends (the trainer calls it however
        the run ends; a pending delayed update is kept only if :meth:`flush` ran first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
