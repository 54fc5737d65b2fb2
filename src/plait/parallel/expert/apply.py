"""The parallelize hook of expert parallelism: split the experts, install the dispatch.

:func:`apply_expert_parallel` runs inside :func:`~plait.parallel.parallelize.parallelize`
right after tensor parallelism, on the one-device names. For every
:class:`~plait.model.moe.MoE` module of the model it

* keeps this rank's ``E/ep`` experts of each stacked weight ``(E, ...)`` -> ``(E/ep, ...)``
  (on a meta-built model: allocated on the mesh's device with the one-device initial
  values of that slice, so every layout starts from the same weights);
* marks the kept weights (:func:`expert_split`), so the data-parallel wrapper leaves them
  to :class:`~plait.parallel.expert.grads.ExpertGradSync`, the optimizer's global norm
  counts each expert once and checkpoints describe them as a block of the one-device
  tensor along dim 0 (resharding between ep degrees is the tensor-parallel block
  arithmetic of :class:`~plait.pieces.TPSplit`);
* replaces the dispatcher with :class:`~plait.parallel.expert.dispatch.ExpertParallelDispatch`
  (also at ep = 1 under data parallelism: the load-balancing loss sums the expert counts
  over the data ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait import comm
from plait.comm import AxisGroup
from plait.mesh import Mesh
from plait.model.init import InitialValues
from plait.model.moe import MoE, MoEStats
from plait.parallel.expert.dispatch import ExpertParallelDispatch
from plait.parallel.expert.grads import ExpertGradSync
from plait.parallel.tensor.sequence import register_grad_sums
from plait.pieces import LocalPiece, TPSplit

_ATTR = "plait_expert_split"


@dataclass(frozen=True)
class ExpertSplit:
    """Experts ``index·block .. (index+1)·block - 1`` of ``full`` along dim 0."""

    full: int
    shards: int
    index: int

    @property
    def block(self) -> int:
        """Experts per rank."""
        return self.full // self.shards


def expert_split(p: torch.Tensor) -> ExpertSplit | None:
    """The experts a weight holds (None: not an expert weight)."""
    return getattr(p, _ATTR, None)


@dataclass
class ExpertLayout:
    """What parallelize keeps of expert parallelism for the step and the optimizer."""

    moes: list[MoE]
    params: list[nn.Parameter]
    ep_group: AxisGroup
    replica_group: AxisGroup
    sync: ExpertGradSync | None = None
    tokens: AxisGroup | None = None
    """The ranks a layer's tokens are split over, when more than the data ranks
    (sequence parallelism: dp x cp x tp); None: the data ranks."""
    seq_split: int = 1
    """The ranks one sequence's tokens are routed from (sequence parallelism: tp)."""
    device: torch.device | None = None
    """The mesh's device (for the figures' collectives on a stage without MoE layers)."""
    stages: AxisGroup | None = None
    """The pipeline stages (pp > 1), over which :meth:`summary` also reduces: each
    stage holds its own MoE layers; None: no pipeline."""

    @property
    def ep(self) -> int:
        """The expert-parallel degree."""
        return self.ep_group.size

    def keep_only(self, module: nn.Module) -> None:
        """Forget the MoE layers and expert weights that are not in ``module`` (this
        rank's pipeline pieces)."""
        held = {id(p) for p in module.parameters()}
        mods = {id(m) for m in module.modules()}
        self.params = [p for p in self.params if id(p) in held]
        self.moes = [m for m in self.moes if id(m) in mods]

    def set_grad_scale(self, scale: float) -> None:
        """The factor the training loss is multiplied by (the aux losses get it too).
        Under sequence parallelism each tp rank's aux losses are of its sequence shard,
        and the global batch's are their mean: each gets ``1/seq_split`` of it."""
        for m in self.moes:
            m.grad_scale = scale / self.seq_split

    def stats(self) -> list[MoEStats]:
        """The last call's statistics of every MoE layer on this rank, in order."""
        return [m.stats for m in self.moes if m.stats is not None]

    def summary(self, data_group: AxisGroup) -> dict[str, float]:
        """The step's router figures for the metrics (a collective over ``data_group``
        and the pipeline stages: every rank calls it): ``moe_aux_loss`` and
        ``moe_z_loss`` (mean over every MoE layer of the model, of all stages, of the data
        ranks' mean, i.e. of the global batch's), ``moe_load_min`` and ``moe_load_max``
        (fewest and most assignments of one expert in one layer, over the data ranks and
        stages) and ``moe_dropped`` (assignments dropped by the capacity factor, summed
        over layers and data ranks). Of the last micro-batch of the step."""
        stats = self.stats()
        if not stats and self.stages is None:
            return {}
        if self.tokens is not None:  # sequence parallelism: each tp rank's shard too
            data_group = self.tokens
        dev = stats[0].aux_loss.device if stats else self.device
        v = torch.tensor(
            [
                sum(float(s.aux_loss) for s in stats),
                sum(float(s.z_loss) for s in stats),
                float(sum(s.dropped for s in stats)) * data_group.size,
                float(len(stats)),
            ],
            dtype=torch.float64,
            device=dev,
        )
        comm.all_reduce(v, data_group, op="avg")  # the layer count: the same on each
        inf = float("inf")
        lo = torch.tensor(
            [min((float(s.load.min()) for s in stats), default=inf)],
            dtype=torch.float64,
            device=dev,
        )
        hi = torch.tensor(
            [max((float(s.load.max()) for s in stats), default=-inf)],
            dtype=torch.float64,
            device=dev,
        )
        if self.stages is not None:  # every stage's layers
            comm.all_reduce(v, self.stages, op="sum")
            comm.all_reduce(lo, self.stages, op="min")
            comm.all_reduce(hi, self.stages, op="max")
        layers = float(v[3])
        if layers == 0:
            return {}
        return {
            "moe_aux_loss": float(v[0]) / layers,
            "moe_z_loss": float(v[1]) / layers,
            "moe_load_min": float(lo[0]),
            "moe_load_max": float(hi[0]),
            "moe_dropped": float(v[2]),
        }

    def pieces(self, names: dict[int, str], tp_index: int) -> list[LocalPiece]:
        """The expert weights (ep > 1) as checkpoint pieces: a block along dim 0 of the
        one-device tensor, written by the first rank of the replica group (tp rank 0)."""
        out = []
        write = self.replica_group.index == 0 and tp_index == 0
        for p in self.params:
            flat = p.detach().reshape(-1)
            whole = LocalPiece(
                names[id(p)], list(p.shape), None, 0, p.numel(), flat, p, p.dtype, write
            )
            out.append(self.refine(whole))
        return out

    @staticmethod
    def refine(piece: LocalPiece) -> LocalPiece:
        """``piece`` of a local expert weight ``(E/ep, ...)`` (a ZeRO shard segment or the
        whole tensor) in one-device terms: the shape ``(E, ...)`` and the block along
        dim 0 this ep rank holds; any other piece unchanged."""
        s = expert_split(piece.key)
        if s is None or s.shards == 1:
            return piece
        tp = TPSplit(0, s.full, s.shards, 1, s.block, s.index)
        return piece.but(shape=[s.full, *piece.shape[1:]], tp=tp)


def apply_expert_parallel(
    model: nn.Module,
    mesh: Mesh,
    ep: int,
    data_group: AxisGroup,
    values: InitialValues | None,
    tokens: AxisGroup | None = None,
) -> ExpertLayout | None:
    """Split every MoE layer's experts over ``ep`` ranks (see the module docstring);
    None when the model has no MoE layer. ``tokens``: the ranks a layer's tokens are
    split over when more than ``data_group``'s (sequence parallelism: dp x cp x tp, each
    tp rank routing its own sequence shard)."""
    tokens = tokens if tokens is not None else data_group
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
    if not moes:
        return None
    ep_group, replica = mesh.expert_axes(ep)
    index = ep_group.index
    params: list[nn.Parameter] = []
    for name, moe in moes:
        full = moe.n_experts
        moe.dispatcher = ExpertParallelDispatch(ep_group, tokens, full)
        if ep == 1:  # every expert here: the weights stay as they are
            params += [moe.experts.w1, moe.experts.w3, moe.experts.w2]
            continue
        if full % ep:
            raise ValueError(f"{name}: {full} experts do not divide over ep={ep}")
        block = full // ep
        lo, hi = index * block, (index + 1) * block
        for attr in ("w1", "w3", "w2"):
            old = getattr(moe.experts, attr)
            if old.is_meta:
                if values is None:
                    raise RuntimeError(f"{name}.experts.{attr} is on the meta device")
                value = values.value(f"{name}.experts.{attr}")[lo:hi]
                value = value.to(device=mesh.device, dtype=old.dtype)
            else:
                value = old.detach()[lo:hi].clone()
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            # what tp noted (whole on every tp rank: 1/tp in a global norm; under
            # sequence parallelism its gradient summed over tp) carries over
            new.__dict__.update(old.__dict__)
            register_grad_sums(new)
            setattr(new, _ATTR, ExpertSplit(full, ep, index))
            setattr(moe.experts, attr, new)
            params.append(new)
    split = tokens.size // data_group.size
    stages = mesh.axis("pp") if mesh.size("pp") > 1 else None
    return ExpertLayout(
        [m for _, m in moes], params, ep_group, replica, tokens=tokens, seq_split=split,
        device=mesh.device, stages=stages,
    )  # fmt: skip
