"""The optimizer wrapper of a tensor-parallel model: global-norm clipping over dp and tp.

:class:`~plait.parallel.zero.optim.ZeroOptimizer` clips by the L2 norm of every gradient
element of the data-parallel replica, summed over the ZeRO shard group. Under tensor
parallelism one replica is spread over the tp ranks, so the norm must also be summed
over tp — counting each element once: a sharded parameter's squared norm adds up over
the tp ranks, while a tensor held identically by ``k`` tp ranks (a replicated norm
gain, a key/value head replicated because there are fewer KV heads than tp ranks)
would be counted ``k`` times. Each local squared norm is therefore weighted by
``1/k`` (:attr:`plait.parallel.tensor.layers.TPShard.norm_weight`) before one all-reduce over
tp. Padded vocabulary rows have zero gradients and add nothing.

The weighting and the all-reduces are ``ZeroOptimizer``'s own: it computes this norm
when the wrapped model carries its mesh (``DataParallel`` and ``ZeroDataParallel`` do).
This class only takes the tp group from an explicit mesh instead, so it also serves a
bare tensor-parallel module, and it is the base that
:class:`~plait.parallel.pipeline.engine.PipelineOptimizer` extends to the pp axis.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.comm import AxisGroup
from plait.mesh import Mesh
from plait.parallel.zero.optim import ZeroOptimizer


class TensorParallelOptimizer(ZeroOptimizer):
    """A :class:`ZeroOptimizer` whose global gradient norm spans the tp axis of ``mesh``.

    Same arguments as :class:`ZeroOptimizer` plus the mesh; ``model`` is the (dp- or
    ZeRO-wrapped) model whose parameters :func:`~plait.parallel.tensor.plan.
    apply_tensor_parallel` placed (their :func:`~plait.parallel.tensor.layers.shard_info`
    gives the weights).
    """

    def __init__(self, model: nn.Module, optimizer: Any, mesh: Mesh, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.tp_group = mesh.axis("tp")

    def _tp_group(self) -> AxisGroup:
        """The mesh's tp axis, given explicitly (a bare tensor-parallel module has no mesh)."""
        return self.tp_group
