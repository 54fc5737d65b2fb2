"""`plait train` refuses an elastic run it could not carry out, before any work: exit 2
and one line."""

from __future__ import annotations

import pytest

from plait.cli import main
from tests.tiny import tiny_args


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nproc", "4:2"], "MIN > MAX (4:2)"),
        (["--nproc", "3:4", "--tp", "2"], "no allowed layout (tp2xdp1 with any dp) for 3 ranks"),
        (["--nproc", "2:4", "--launch.layouts", "dp4,dp3"], "for 2 ranks divides"),
        (["--nproc", "1", "--train.memory_checkpoint_every", "2"], "this run has one rank"),
        (["--nproc", "2", "--train.memory_checkpoint_every", "2"], "needs an elastic run"),
        (["--nproc", "2:4", "--ray"], "supported by the local launcher"),
        (["--nproc", "2:4", "--launch.start_ranks", "2"], "set train.checkpoint_dir"),
    ],
)
def test_bad_elastic_input_exits_2_with_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", *tiny_args(), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("plait: error: ") and err.count("\n") == 1, err
    assert says in err
