"""Cut the built-in transformer into pipeline pieces of contiguous blocks.

The full one-device :class:`~plait.model.Transformer` (built from one seed, possibly
already tensor-parallel) is cut into ``p·v`` *virtual stages*: piece ``k`` holds blocks
``boundaries[k] .. boundaries[k+1] - 1``; piece 0 also holds the token embedding, the
last piece the final norm and the output head (the loss is applied by the runtime).
Piece ``k`` lives on pipeline rank ``k % p`` as its local chunk ``k // p`` (round-robin,
as interleaved 1F1B needs; see :mod:`plait.parallel.pipeline.actions`). Each rank keeps
only its own pieces, so its weights are exactly the single-device model's weights.

Tied embeddings: when the head shares the embedding matrix and the first and last
pieces sit on different ranks, the last piece gets its own copy of the matrix (equal at
start); :meth:`PipelineStages.sync_tied_grads` swaps the two copies' gradients between
those two ranks after the backward passes (one batched send/receive on the pp axis; no
extra process group, whose creation by only two ranks would desynchronise torch's
group naming on the others) and adds them, so both copies receive the same full
gradient (``a + b`` on one rank, ``b + a`` on the other: equal bits) and stay equal
under any element-wise optimizer.

Parameter names inside a piece are the model's own (``layers.3.attention.wq.weight``),
so a piece's ``state_dict`` keys match the one-device model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from plait import comm
from plait.comm import P2P, AxisGroup
from plait.config import ModelConfig
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.model.transformer import TokenPositions, cap_logits, embed, rope_for


def equal_boundaries(n_blocks: int, pieces: int) -> list[int]:
    """Boundaries of the equal-count split: ``pieces`` runs of blocks whose sizes differ
    by at most one (the first ``n_blocks % pieces`` runs get the extra block)."""
    check_split(n_blocks, pieces)
    base, extra = divmod(n_blocks, pieces)
    out = [0]
    for k in range(pieces):
        out.append(out[-1] + base + (1 if k < extra else 0))
    return out


def check_split(n_blocks: int, pieces: int, stages: int | None = None) -> None:
    """Refuse fewer blocks than pieces (every piece needs at least one block)."""
    if pieces < 1:
        raise ConfigError(f"a pipeline needs at least one piece, got {pieces}")
    if n_blocks < pieces:
        how = f" (pp {stages} x chunks {pieces // stages})" if stages else ""
        raise ConfigError(
            f"the model has {n_blocks} transformer block(s) but the pipeline needs "
            f"{pieces} pieces{how}, each with at least one block; use at least {pieces} "
            f"layers (model.n_layers), or fewer stages or chunks so that "
            f"pp x chunks <= {n_blocks}."
        )


def check_boundaries(boundaries: Sequence[int], n_blocks: int, pieces: int) -> list[int]:
    """Validate explicit boundaries (``pieces + 1`` increasing ints from 0 to n_blocks)."""
    b = list(boundaries)
    ok = (
        len(b) == pieces + 1
        and b[0] == 0
        and b[-1] == n_blocks
        and all(b[i] < b[i + 1] for i in range(pieces))
    )
    if not ok:
        raise ConfigError(
            f"pipeline boundaries {b} are not {pieces + 1} strictly increasing block indices "
            f"from 0 to {n_blocks} (one run of at least one block per piece)."
        )
    return b


class StagePiece(nn.Module):
    """One virtual stage: optional embedding, a run of blocks, optional norm + head.

    ``forward`` maps token ids ``(micro, seq)`` (first piece) or hidden states
    ``(micro, seq, dim)`` to hidden states ``(micro, seq, dim)`` (``seq / tp`` under
    sequence parallelism, ``seq_factor`` = tp), or, for the last
    piece, to logits ``(micro, seq, vocab)`` (vocabulary-sharded under tensor
    parallelism). ``cfg`` (the model's): Gemma's embedding scale and final-logit
    soft-cap (:func:`~plait.model.transformer.embed`, :func:`~plait.model.transformer.
    cap_logits`) where it turns them on.
    """

    def __init__(
        self,
        stage: int,
        blocks: dict[int, nn.Module],
        rope: tuple[torch.Tensor, torch.Tensor],
        embedding: nn.Module | None = None,
        norm: nn.Module | None = None,
        head: nn.Module | None = None,
        seq_factor: int = 1,
        positions: nn.Module | None = None,
        cfg: ModelConfig | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        self.positions = positions if positions is not None else TokenPositions()
        self.seq_factor = seq_factor  # hidden states hold seq / seq_factor positions (SP)
        self.tok_embeddings = embedding
        self.layers = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        self.norm = norm
        self.output = head
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", rope[0], persistent=False)  # (max_seq, head_dim/2)
        self.register_buffer("rope_sin", rope[1], persistent=False)

    @property
    def is_first(self) -> bool:
        """Whether this piece embeds the tokens."""
        return self.tok_embeddings is not None

    @property
    def is_last(self) -> bool:
        """Whether this piece produces the logits."""
        return self.output is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(micro, seq)`` or hidden ``(micro, seq, dim)`` -> hidden or logits."""
        if self.tok_embeddings is not None:
            seq = x.shape[1]
            h = (  # (micro, seq / seq_factor, dim)
                self.tok_embeddings(x)
                if self.cfg is None
                else embed(self.tok_embeddings, x, self.cfg)
            )
        else:
            seq, h = x.shape[1] * self.seq_factor, x
        cos, sin = rope_for(  # (seq, head_dim // 2): the tokens' global positions
            self.rope_cos, self.rope_sin, self.positions, seq, self.rope_cos.shape[0]
        )
        for block in self.layers.values():
            h = block(h, cos, sin)  # (micro, seq, dim)
        if self.output is not None:
            assert self.norm is not None
            h = self.output(self.norm(h))  # (micro, seq, vocab)
            if self.cfg is not None:
                h = cap_logits(h, self.cfg)
        return h


class PipelineStages(nn.Module):
    """This rank's pieces (``chunks[c]`` is virtual stage ``pp_index + c·p``).

    ``tied`` is this rank's copy of a tied embedding/head matrix when the first and last
    pieces are on different ranks (else None); ``pp_group`` the pipeline axis, on which
    the other copy lives at index ``tied_peer``.
    """

    def __init__(
        self,
        chunks: Sequence[StagePiece],
        stages: int,
        pp_index: int,
        boundaries: Sequence[int],
        tied: nn.Parameter | None = None,
        pp_group: AxisGroup | None = None,
    ) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stages = stages
        self.pp_index = pp_index
        self.boundaries = list(boundaries)
        self.tied = tied
        self.pp_group = pp_group
        self.tied_peer = stages - 1 if pp_index == 0 else 0

    @property
    def virtual_stages(self) -> int:
        """p · v, the number of pieces of the whole model."""
        return len(self.boundaries) - 1

    def piece(self, stage: int) -> StagePiece:
        """The local piece of virtual stage ``stage`` (which must live on this rank)."""
        if stage % self.stages != self.pp_index:
            raise ValueError(
                f"virtual stage {stage} lives on pipeline rank {stage % self.stages}, "
                f"not on {self.pp_index}"
            )
        piece = self.chunks[stage // self.stages]
        assert isinstance(piece, StagePiece)
        return piece

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the two copies of a tied matrix (first and last piece)."""
        if self.tied is None or self.pp_group is None:
            return
        if self.tied.grad is None:
            self.tied.grad = torch.zeros_like(self.tied)
        grad = self.tied.grad  # (vocab, dim) (vocabulary shard under tp)
        other = torch.empty_like(grad)
        ops = [P2P("send", grad, self.tied_peer), P2P("recv", other, self.tied_peer)]
        for h in comm.batch_isend_irecv(ops, self.pp_group):
            h.wait()
        grad.add_(other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every local piece in order (only meaningful with one pipeline rank)."""
        if self.stages != 1:
            raise RuntimeError("a pipeline stage runs through PipelineRuntime, not forward()")
        for piece in self.chunks:
            x = piece(x)
        return x


def check_splittable(model: nn.Module) -> None:
    """Refuse, naming what is missing, a model the split cannot cut: it needs plait's
    Transformer structure (token embedding, a list of blocks, final norm, output head,
    rotary tables)."""
    for attr in ("tok_embeddings", "layers", "norm", "output", "rope_cos", "rope_sin"):
        if not hasattr(model, attr):
            raise ConfigError(
                f"pipeline split: the model has no '{attr}'; the pipeline split supports "
                f"plait's built-in Transformer (embedding, layers, norm, output), not "
                f"{type(model).__name__}. Use dp / ZeRO / tp for this model, or pp = 1."
            )


def split_transformer(
    model: nn.Module,
    mesh: Mesh,
    chunks: int = 1,
    boundaries: Sequence[int] | None = None,
    seq_factor: int = 1,
) -> PipelineStages:
    """Keep this rank's pieces of the full ``model`` (a :class:`plait.model.Transformer`,
    possibly tensor-parallel already) for a pipeline of ``mesh.size("pp")`` ranks with
    ``chunks`` pieces each; ``boundaries`` defaults to the equal-count split;
    ``seq_factor`` is tp under sequence parallelism (hidden states between pieces hold a
    1/tp slice of the sequence), else 1.

    The pieces reuse the model's own modules (no copy); the modules of other ranks'
    pieces are replaced by ``nn.Identity`` in ``model`` (freed). Raises
    :class:`ConfigError` for fewer blocks than pieces or bad boundaries.
    """
    check_splittable(model)
    p = mesh.size("pp")
    pieces = p * chunks
    layers = list(model.layers)  # type: ignore[arg-type]
    check_split(len(layers), pieces, p)
    b = (
        equal_boundaries(len(layers), pieces)
        if boundaries is None
        else check_boundaries(boundaries, len(layers), pieces)
    )
    me = mesh.index("pp")
    emb, head, norm = model.tok_embeddings, model.output, model.norm
    assert isinstance(emb, nn.Module) and isinstance(head, nn.Module)
    assert isinstance(norm, nn.Module)
    tied_param = emb.weight if head.weight is emb.weight else None
    assert tied_param is None or isinstance(tied_param, nn.Parameter)
    rope = (model.rope_cos, model.rope_sin)
    local: list[StagePiece] = []
    for stage in range(me, pieces, p):
        local.append(
            StagePiece(
                stage,
                {i: layers[i] for i in range(b[stage], b[stage + 1])},
                rope,  # type: ignore[arg-type]
                embedding=emb if stage == 0 else None,
                norm=norm if stage == pieces - 1 else None,
                head=head if stage == pieces - 1 else None,
                seq_factor=seq_factor,
                positions=getattr(model, "positions", None),
                cfg=cfg if isinstance(cfg := getattr(model, "cfg", None), ModelConfig) else None,
            )
        )
    tied: nn.Parameter | None = None
    if tied_param is not None and p > 1:
        if me == p - 1:  # the head gets its own copy, equal to the embedding at start
            copy = nn.Parameter(tied_param.detach().clone())
            copy.__dict__.update(  # keep attributes such as tensor-parallel shard info
                {k: v for k, v in tied_param.__dict__.items() if not k.startswith("_")}
            )
            head.weight = copy
            tied = copy
        elif me == 0:
            tied = tied_param
    _release_foreign(model, local, pieces)
    return PipelineStages(local, p, me, b, tied, mesh.axis("pp"))


def _release_foreign(model: nn.Module, local: Sequence[StagePiece], pieces: int) -> None:
    """Replace the modules of other ranks' pieces in ``model`` by ``nn.Identity`` so
    their memory is freed (the full model is consumed by the split)."""
    keep = {int(i) for piece in local for i in piece.layers}
    stages = {piece.stage for piece in local}
    layers = model.layers
    assert isinstance(layers, nn.ModuleList)
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = nn.Identity()
    if 0 not in stages:
        model.tok_embeddings = nn.Identity()
    if pieces - 1 not in stages:
        model.norm = nn.Identity()
        model.output = nn.Identity()
