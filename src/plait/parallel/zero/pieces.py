"""The local pieces of a ZeRO-wrapped module: this rank's segments of the flat shards.

Each unit's shard ``[lo, hi)`` of the flattened, padded parameters covers runs of
elements of one or more parameters; each run is one :class:`~plait.pieces.LocalPiece`
(``start:end`` within its parameter, padding left out). Replicas of a shard (hybrid
sharding) are identical after the step, so only the first replicate rank writes.
"""

from __future__ import annotations

from plait.parallel.zero.wrapper import ZeroDataParallel
from plait.pieces import LocalPiece


def zero_local_pieces(zero: ZeroDataParallel) -> list[LocalPiece]:
    """The pieces of ``zero``'s shards, named as in ``zero.module``."""
    names = {id(p): n for n, p in zero.module.named_parameters()}
    first = zero.replicate_group.index == 0
    out: list[LocalPiece] = []
    for u in zero.units:
        shard = zero.param_shard(u)  # (shard_numel,) model dtype
        for i, a, b in u.local_segments():
            p = u.params[i]
            at = u.lo + a - u.offsets[i]  # first element of the run within the parameter
            out.append(
                LocalPiece(
                    names[id(p)],
                    list(u.shapes[i]),
                    None,
                    at,
                    at + (b - a),
                    shard[a:b],
                    p,
                    zero.param_dtype,
                    first,
                )
            )
    return out
