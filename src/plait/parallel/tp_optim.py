"""The optimizer wrapper of a tensor-parallel model: global-norm clipping over dp and tp.

:class:`~plait.parallel.zero_optim.ZeroOptimizer` clips by the L2 norm of every gradient
element of the data-parallel replica, summed over the ZeRO shard group. Under tensor
parallelism one replica is spread over the tp ranks, so the norm must also be summed
over tp — counting each element once: a sharded parameter's squared norm adds up over
the tp ranks, while a tensor held identically by ``k`` tp ranks (a replicated norm
gain, a key/value head replicated because there are fewer KV heads than tp ranks)
would be counted ``k`` times. Each local squared norm is therefore weighted by
``1/k`` (:attr:`plait.parallel.tensor.TPShard.norm_weight`) before one all-reduce over
tp. Padded vocabulary rows have zero gradients and add nothing.

Everything else (loss scaling, skipping non-finite steps, ZeRO masters) is the base
class's; only the norm differs, so a tp = 1 mesh gives the base class's result.
``ZeroOptimizer`` itself computes the same norm when the wrapped model carries its mesh
(``DataParallel`` and ``ZeroDataParallel`` do); this class takes the mesh explicitly, so
it also serves a bare tensor-parallel module, and it is the base that
:class:`~plait.parallel.pipeline.engine.PipelineOptimizer` extends to the pp axis.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait import comm
from plait.mesh import Mesh
from plait.parallel.tensor import shard_info
from plait.parallel.zero_optim import ZeroOptimizer


def _weight(p: torch.Tensor) -> float:
    info = shard_info(p)
    return info.norm_weight if info is not None else 1.0


class TensorParallelOptimizer(ZeroOptimizer):
    """A :class:`ZeroOptimizer` whose global gradient norm spans the tp axis of ``mesh``.

    Same arguments as :class:`ZeroOptimizer` plus the mesh; ``model`` is the (dp- or
    ZeRO-wrapped) model whose parameters :func:`~plait.parallel.tp_plan.
    apply_tensor_parallel` placed (their :func:`~plait.parallel.tensor.shard_info`
    gives the weights).
    """

    def __init__(self, model: nn.Module, optimizer: Any, mesh: Mesh, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.tp_group = mesh.axis("tp")

    def _local_square_norms(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """``(k,)`` float64 weighted squared norms of this rank's gradient pieces."""
        parts: list[torch.Tensor] = []
        weights: list[float] = []
        if self.zero is None:  # grads: the parameters that have one, in order
            with_grad = [p for p in self._params if p.grad is not None]
            for p, g in zip(with_grad, grads, strict=True):
                parts.append(g)
                weights.append(_weight(p))
        else:  # grads: one flat (shard_numel,) shard per ZeRO unit
            for slot, g in zip(self.slots, grads, strict=True):
                for i, start, end in slot.unit.local_segments():
                    parts.append(g[start:end])
                    weights.append(_weight(slot.unit.params[i]))
        device = self.zero.device if self.zero is not None else torch.device("cpu")
        if not parts:
            return torch.zeros(1, dtype=torch.float64, device=device)
        norms = torch._foreach_norm(parts)  # per-piece L2 norms
        sq = torch.stack([n.to(device, torch.float64) for n in norms]).pow(2)  # (k,)
        return sq * torch.tensor(weights, dtype=torch.float64, device=device)

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm over every element of the model, each counted once (dp shards, tp)."""
        sq = self._local_square_norms(grads).sum().reshape(1)  # (1,)
        if self.zero is not None and self.zero.shard_group.size > 1:
            comm.all_reduce(sq, self.zero.shard_group, op="sum")  # ZeRO shards of the replica
        if self.tp_group.size > 1:
            comm.all_reduce(sq, self.tp_group, op="sum")  # tensor-parallel pieces
        return float(sq.sqrt().item())
