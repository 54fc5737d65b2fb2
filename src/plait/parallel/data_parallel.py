"""Data parallelism for any ``nn.Module``: bucketed, overlapped gradient all-reduce.

Every rank holds the same weights (broadcast from data-parallel rank 0 at wrap time)
and sees different micro-batches. Gradients live in flat buckets of about ``bucket_mb``
MiB in *reverse registration order* (roughly the order backward produces them): every
``.grad`` is a view into its bucket (PyTorch DDP's ``gradient_as_bucket_view``), so a
rank holds one copy of the gradients, as many bytes as the parameters. Autograd
accumulates into the views; when it has made a fresh gradient instead (after
``zero_grad(set_to_none=True)``), the post-accumulate-grad hook moves it into the bucket
and points ``.grad`` back at the view. The hook divides each final gradient by the group
size in place; when a bucket's last gradient is in, the bucket's all-reduce (a sum of
the pre-divided gradients: the mean over ranks) is launched asynchronously, so
communication overlaps the rest of backward. At the end of backward a callback launches
whatever is left and waits for every bucket: the averaged gradients are then in place.

Inside :meth:`DataParallel.no_sync` the hooks do nothing: gradients accumulate locally
and the next backward outside the context reduces the accumulated sum, so k micro-steps
cost one round of communication.

With a ``compressor`` (:mod:`plait.parallel.compression`) each complete bucket goes to
``compressor.reduce`` instead of the plain all-reduce (after the compressor's warm-up
steps); the rest is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.errors import UnusedParametersError
from plait.mesh import Mesh
from plait.parallel.compression import Compressor, Finish
from plait.parallel.tensor.layers import tp_norm_weight
from plait.pieces import LocalPiece


@dataclass
class _Bucket:
    """A flat buffer holding the gradients of a run of parameters (one dtype)."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    buffer: torch.Tensor  # (numel,) flat gradients of every parameter; .grad are views
    ready: set[int] = field(default_factory=set)  # positions whose gradient has arrived
    pending: Finish | None = None  # completes the launched reduction

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def _make_buckets(named: Sequence[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[_Bucket]:
    """Greedy buckets over ``named`` (already in reverse registration order).

    A bucket closes once it holds at least ``bucket_bytes`` (so it may exceed the cap by
    one tensor), or when the dtype or device changes.
    """
    buckets: list[_Bucket] = []
    cur: list[tuple[str, nn.Parameter]] = []
    cur_bytes = 0

    def close() -> None:
        nonlocal cur, cur_bytes
        if not cur:
            return
        offsets, total = [], 0
        for _, p in cur:
            offsets.append(total)
            total += p.numel()
        first = cur[0][1]
        buf = torch.zeros(total, dtype=first.dtype, device=first.device)
        buckets.append(
            _Bucket(len(buckets), [p for _, p in cur], [n for n, _ in cur], offsets, buf)
        )
        cur, cur_bytes = [], 0

    for name, p in named:
        if cur and (p.dtype != cur[0][1].dtype or p.device != cur[0][1].device):
            close()
        cur.append((name, p))
        cur_bytes += p.numel() * p.element_size()
        if cur_bytes >= bucket_bytes:  # as DDP: a bucket closes once it reaches the cap
            close()
    close()
    return buckets


def _no_wait() -> None:
    """Nothing to wait for (a one-rank group's all-reduce completes at once)."""


@torch.no_grad()
def broadcast_module_state(
    module: nn.Module, group: AxisGroup, skip: set[int] | None = None
) -> None:
    """Make every replica's parameters and buffers equal to the group's first rank
    (one broadcast per dtype and device); parameters whose id is in ``skip`` are left."""
    skip = skip or set()
    params = [p.data for p in module.parameters() if id(p) not in skip]
    tensors = params + list(module.buffers())
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])  # (total,)
        comm.broadcast(flat, group, src=0)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class DataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``mesh``'s ``axes`` (default "dp").

    Args:
        module: any ``nn.Module``; its parameters and buffers are broadcast from the
            first rank of the group so every replica starts identical.
        mesh: the device mesh.
        bucket_mb: bucket size in MiB (the unit of one asynchronous all-reduce).
        find_unused_parameters: reduce zeros for parameters that get no gradient
            instead of raising :class:`~plait.errors.UnusedParametersError` naming them.
        axes: the mesh axes gradients are averaged over.
        record_events: keep :attr:`events` (gradient arrivals, bucket launches and the
            end of backward, in order) for the last backward pass.
        compressor: reduce each bucket through this gradient compressor instead of the
            plain all-reduce (None: plain).
        broadcast: broadcast the first rank's parameters and buffers (False: they are
            equal by construction, as after ``parallelize``'s meta-device materialisation).
        exclude: trainable parameters this wrapper neither reduces nor describes (expert
            weights, reduced over their own replica group by ``plait.parallel.expert``).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        bucket_mb: float = 25.0,
        find_unused_parameters: bool = False,
        axes: Sequence[str] = ("dp",),
        record_events: bool = False,
        compressor: Compressor | None = None,
        broadcast: bool = True,
        exclude: Sequence[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.module = module
        self.mesh = mesh
        self.group: AxisGroup = mesh.axis(*axes)
        self.find_unused_parameters = find_unused_parameters
        self.record_events = record_events
        self.compressor = compressor
        self.events: list[tuple[str, Any]] = []
        self._sync = True
        self._in_backward = False
        self._exclude = {id(p) for p in exclude}
        named = self._held()
        if not named:
            raise ValueError("DataParallel needs a module with at least one trainable parameter")
        self.buckets = _make_buckets(list(reversed(named)), int(bucket_mb * 2**20))
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
        if broadcast:  # False: equal on every rank by construction (a meta build)
            self._broadcast_state()
        for b in self.buckets:  # .grad is a view into its bucket from the start
            for i, p in enumerate(b.params):
                p.grad = b.view(i)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]

    # ------------------------------------------------------------------ set-up

    def _held(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters this wrapper reduces (all but ``exclude``)."""
        return [
            (n, p)
            for n, p in self.module.named_parameters()
            if p.requires_grad and id(p) not in self._exclude
        ]

    def _broadcast_state(self) -> None:
        broadcast_module_state(self.module, self.group, self._exclude)

    # ------------------------------------------------------------------ hooks

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            if self.record_events:
                self.events = []
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, i = self._where[p]  # type: ignore[index]
        view, g = bucket.view(i), p.grad
        assert g is not None
        n = self.group.size
        if g.data_ptr() == view.data_ptr() and g.shape == view.shape:
            if n > 1:
                view.div_(n)  # pre-divide in place: the sum is the mean
        else:  # a fresh gradient: moved into the bucket (divided on the way in)
            torch.div(g, n, out=view)
            p.grad = view
        bucket.ready.add(i)
        if self.record_events:
            self.events.append(("grad", bucket.names[i]))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    @staticmethod
    def _adopt(p: torch.Tensor, bucket: _Bucket, i: int) -> None:
        """Make ``p.grad`` the bucket's view again, moving a fresh gradient into it."""
        view = bucket.view(i)
        g = p.grad
        if g is None:  # no gradient this pass (find_unused_parameters)
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
            view.copy_(g)
        else:
            return
        p.grad = view

    def _launch(self, bucket: _Bucket) -> None:
        c = self.compressor
        if c is not None and c.active:
            bucket.pending = c.reduce(bucket.index, bucket.buffer, bucket.shapes, self.group)
        else:
            handle = comm.all_reduce(bucket.buffer, self.group, op="sum", async_op=True)
            bucket.pending = handle.wait if handle is not None else _no_wait
        if self.record_events:
            self.events.append(("launch", bucket.index))

    def _finish_backward(self) -> None:
        """Runs once at the end of a synchronising backward pass."""
        self._in_backward = False
        if self.record_events:
            self.events.append(("backward_end", None))
        missing = [
            b.names[i]
            for b in self.buckets
            for i in range(len(b.params))
            if b.pending is None and i not in b.ready
        ]
        if missing and not self.find_unused_parameters:
            for b in self.buckets:  # leave a clean state for the next pass
                b.ready.clear()
                if b.pending is not None:
                    b.pending()
                    b.pending = None
            raise UnusedParametersError(missing)
        for b in self.buckets:
            if b.pending is None:
                for i, p in enumerate(b.params):
                    if i not in b.ready:  # unused: its gradient counts as zero
                        p.grad = None
                        self._adopt(p, b, i)
                self._launch(b)
        for b in self.buckets:
            assert b.pending is not None
            b.pending()  # the averaged gradients are in the bucket, i.e. in .grad
            b.ready.clear()
            b.pending = None
        if self.compressor is not None:
            self.compressor.end_step()
        if self.record_events:
            self.events.append(("synced", None))

    # ------------------------------------------------------------------ API

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync` (backward passes do not communicate)."""
        return self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication."""
        old = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = old

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def local_pieces(self) -> list[LocalPiece]:
        """Every trainable parameter whole, in the module's own names. The replicas are
        identical, so each parameter is written by one rank of the group, chosen to
        spread the bytes evenly (largest first, to the replica with the fewest bytes so
        far: every replica computes the same assignment), so a checkpoint save writes
        in parallel."""
        held = self._held()
        size, me = self.group.size, self.group.index
        load = [0] * size
        writer: dict[str, int] = {}
        for n, p in sorted(held, key=lambda np_: (-np_[1].numel(), np_[0])):
            r = min(range(size), key=lambda i: (load[i], i))
            writer[n] = r
            load[r] += p.numel() * p.element_size()
        out = []
        for n, p in held:
            flat = p.detach().reshape(-1)  # (numel,) a view of the parameter
            shape = list(p.shape)
            write = writer[n] == me
            out.append(LocalPiece(n, shape, None, 0, p.numel(), flat, p, p.dtype, write))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (``set_to_none``: the next backward moves its fresh
        gradients into the buckets), or zero the buckets in place, ``.grad`` staying a
        view into them."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.grad = None if set_to_none else b.view(i)
            if not set_to_none:
                b.buffer.zero_()

    def bucket_summary(self) -> list[tuple[int, int, int]]:
        """``(bucket index, parameter count, bytes)`` for each bucket."""
        return [
            (b.index, len(b.params), b.buffer.numel() * b.buffer.element_size())
            for b in self.buckets
        ]

    # ------------------------------------------------------------------ optimizer
    # What plait.optim.Optimizer reads (its OptimizerTarget protocol).

    def norm_groups(self) -> list[AxisGroup]:
        """The groups a global gradient norm's local square is summed over: the mesh's
        tp axis when it has several ranks (the wrapped module is then tensor-parallel).
        The replicas over ``axes`` hold equal gradients, so they are not summed."""
        return [self.mesh.axis("tp")] if self.mesh.size("tp") > 1 else []

    def norm_weight(self, p: torch.Tensor) -> float:
        """Weight of ``p``'s squared gradient norm in the global norm: 1/k for a tensor
        held identically by k tp ranks, else 1."""
        return tp_norm_weight(p)

    def zero_wrapper(self) -> None:
        """No ZeRO shards: the parameters are their own (fp32) masters."""
        return None
