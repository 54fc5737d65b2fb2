"""plait's communication layer: the only package that calls ``torch.distributed``.

Every operation runs on one mesh axis (an :class:`AxisGroup`) and is counted in
:class:`CommStats` (calls, bus bytes, blocked seconds) per rank and per axis.
"""

from plait.comm.group import (
    AxisGroup,
    Handle,
    destroy_world,
    init_method_tcp,
    init_world,
    join_launched_world,
    launched_world,
    new_axis_group,
    world_backend,
    world_initialized,
    world_rank,
    world_size,
)
from plait.comm.ops import (
    P2P,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    recv_any,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from plait.comm.stats import CommStats, OpStats, bus_bytes

__all__ = [
    "P2P",
    "AxisGroup",
    "CommStats",
    "Handle",
    "OpStats",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "bus_bytes",
    "destroy_world",
    "gather",
    "init_method_tcp",
    "init_world",
    "irecv",
    "isend",
    "join_launched_world",
    "launched_world",
    "new_axis_group",
    "recv",
    "recv_any",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "world_backend",
    "world_initialized",
    "world_rank",
    "world_size",
]
