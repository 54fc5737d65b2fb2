"""A faster event name for torch's elastic rendezvous (the same names, without
``inspect.stack()``).

torch's dynamic rendezvous (the ``c10d`` backend that ``torchrun --standalone`` and
:func:`plait.launch.local.launch_local` use) records an event at each of its steps and
names it after the calling method with ``inspect.stack()[depth].function``, called twice
per event. ``inspect.stack`` builds the frame info of the whole stack, reading source
files and resolving each frame's module by a walk over ``sys.modules`` (CPython issue
#92041), so one launch of two ranks spends about 2.4 s of CPU there in a process that
has torch and plait imported (measured with cProfile, 18 calls), more in a process with
more modules loaded. :func:`speed_up_event_names` replaces that helper with a walk up the
frames that returns the same name.
"""

from __future__ import annotations

import sys


def method_name(depth: int = 2) -> str:
    """What ``inspect.stack()[depth].function`` names, seen from the caller of this
    function (depth 0 is this function's own frame), or ``"no_method_name"`` when the
    stack is not that deep: torch's ``get_method_name``, in constant time per frame."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def speed_up_event_names() -> None:
    """Use :func:`method_name` in torch's dynamic rendezvous (idempotent; a torch without
    that helper is left alone)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = method_name
