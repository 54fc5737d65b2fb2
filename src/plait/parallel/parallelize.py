"""Apply parallelism to a model written for one device, in one fixed order.

The order (as in DESIGN.md): tensor/sequence parallel -> context parallel -> pipeline
split -> activation recomputation -> ZeRO/FSDP sharding or data parallel. Each step
replaces or wraps modules from outside; the model file never changes. This version
implements tensor/sequence parallelism (when the mesh's tp axis is wider than 1:
:func:`~plait.parallel.tensor.plan.apply_tensor_parallel` with the built-in transformer's
plan; the model's logits are then vocabulary-sharded, so use
:func:`~plait.parallel.tensor.plan.tensor_parallel_loss`) and the last two steps, which
reduce over the dp axis only; the pipeline split when pp > 1
(:func:`~plait.parallel.pipeline.engine.split_for_pipeline`: the result wraps this
rank's pieces, run by :class:`~plait.parallel.pipeline.engine.PipelineEngine`); context
parallelism is refused by :meth:`plait.config.Config.validate` before any process starts.

The last step picks the wrapper:

* ``parallel.zero`` 1, 2 or 3 -> :class:`~plait.parallel.zero.ZeroDataParallel`;
* ``parallel.zero = 0`` with fp32 parameters and fp32 reduction ->
  :class:`~plait.parallel.data.DataParallel` (bucketed, overlapped all-reduce);
* ``parallel.zero = 0`` with bf16/fp16 parameters (or another reduction dtype) ->
  ``ZeroDataParallel`` at stage 0: everything replicated and all-reduced, but the
  parameters are flattened so the optimizer wrapper can hold their fp32 masters.
"""

from __future__ import annotations

from torch import nn

from plait.config import Config, ParallelConfig, PrecisionConfig
from plait.mesh import Mesh
from plait.parallel.data import DataParallel
from plait.parallel.pipeline.engine import split_for_pipeline
from plait.parallel.precision import PrecisionPolicy
from plait.parallel.recompute import RecomputeMode, apply_recompute
from plait.parallel.tensor.plan import apply_tensor_parallel
from plait.parallel.zero import ZeroDataParallel


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    cfg: ParallelConfig | Config,
    *,
    recompute: RecomputeMode | None = None,
    precision: PrecisionConfig | None = None,
) -> nn.Module:
    """Return ``model`` prepared for ``mesh`` according to ``cfg``.

    ``cfg`` is the parallel section or a whole :class:`Config` (which also supplies
    ``train.recompute`` and the ``precision`` section; explicit keyword arguments win).
    Data parallelism wraps the model even when dp = 1: one rank is the degenerate case
    of the same code path (its collectives are counted no-ops).
    """
    if isinstance(cfg, Config):
        recompute = recompute if recompute is not None else cfg.train.recompute
        precision = precision if precision is not None else cfg.precision
        p = cfg.parallel
    else:
        p = cfg
    precision = precision or PrecisionConfig()
    policy = PrecisionPolicy.from_names(precision.dtype, precision.reduce_dtype)
    # 1. tensor (and sequence) parallelism over the tp axis: the built-in plan.
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=p.sequence_parallel)
    # 2. context parallelism: not in this version.
    # 3. pipeline split (pp > 1): keep this rank's pieces (PipelineEngine runs them).
    if mesh.size("pp") > 1:
        model = split_for_pipeline(model, mesh, cfg)
    # 4. activation recomputation.
    if recompute and recompute != "none":
        apply_recompute(model, recompute)
    # 5. ZeRO sharding or data parallelism.
    plain = (
        p.zero == 0
        and not policy.needs_master_weights
        and policy.grad_reduce_dtype == policy.param_dtype
    )
    if plain:
        return DataParallel(
            model,
            mesh,
            bucket_mb=p.bucket_mb,
            find_unused_parameters=p.find_unused_parameters,
        )
    return ZeroDataParallel(
        model,
        mesh,
        stage=p.zero,
        shard_size=p.zero_shard_size if p.zero > 0 else None,
        reshard_after_forward=p.reshard_after_forward,
        prefetch=p.prefetch,
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.grad_reduce_dtype,
        offload=p.offload,
        find_unused_parameters=p.find_unused_parameters,
    )
