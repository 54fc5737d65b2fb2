"""plait.launch.rendezvous_events: the same event names as torch's helper, at every depth."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from plait.launch.rendezvous_events import method_name, speed_up_event_names

TORCHS = dynamic_rendezvous.get_method_name  # captured before any launch replaces it


class Handler:
    def _record(self, depth: int) -> tuple[str, str]:
        return TORCHS(depth), method_name(depth)

    def join_rendezvous(self, depth: int) -> tuple[str, str]:
        return self._record(depth)


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4, 10_000])
def test_the_name_is_torchs_at_every_depth(depth: int) -> None:
    if TORCHS is method_name:
        pytest.skip("torch's helper was replaced before this module was imported")
    theirs, ours = Handler().join_rendezvous(depth)
    if depth == 0:  # each names its own frame
        assert (theirs, ours) == ("get_method_name", "method_name")
    else:
        assert ours == theirs
    assert Handler().join_rendezvous(2) == ("join_rendezvous", "join_rendezvous")


def test_speed_up_installs_it_once() -> None:
    speed_up_event_names()
    speed_up_event_names()
    assert dynamic_rendezvous.get_method_name is method_name
