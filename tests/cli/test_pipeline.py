"""``plait pipeline draw | show``."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.cli import EXIT_BAD_INPUT, main


def test_draw_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "1f1b.png"
    args = ["pipeline", "draw", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]
    assert main([*args, "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert "simulated bubble 0.2727" in capsys.readouterr().out
    out2 = tmp_path / "il.png"
    assert main(["pipeline", "draw", "--schedule", "interleaved", "--stages", "4",
                 "--microbatches", "8", "--chunks", "2", "--out", str(out2)]) == 0
    assert out2.stat().st_size > 10_000


def test_show_prints_actions_and_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "show", "--schedule", "1f1b", "--stages", "2",
                 "--microbatches", "3"]) == 0
    text = capsys.readouterr().out
    assert "rank 0: F0@s0 [SEND_F0@s0] F1@s0 [SEND_F1@s0 RECV_B0@s0] B0@s0" in text
    assert "rank 1: [RECV_F0@s1] F0@s1 B0@s1 [SEND_B0@s1 RECV_F1@s1]" in text
    assert "makespan 12, bubble 0.2500 (textbook (p-1)/(m+p-1) = 0.2500)" in text
    assert "peak in-flight per rank [2, 1]" in text
    assert main(["pipeline", "show", "--schedule", "zb", "--stages", "4",
                 "--microbatches", "8"]) == 0
    assert "bubble 0.1111 (ZB-H1 at F = I = W: (p-1)/(3m+p-1) = 0.1111)" in (
        capsys.readouterr().out
    )


def test_bad_input_exits_2_naming_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["pipeline", "show", "--schedule", "interleaved", "--stages", "4",
                 "--microbatches", "6", "--chunks", "2"])
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "got 6 micro-batches for 4 stages; use 4 or 8 micro-batches" in err
    assert main(["pipeline", "draw", "--backward", "-2"]) == EXIT_BAD_INPUT
    assert "--backward -2" in capsys.readouterr().err
    # the adjacent placement of interleaved 1F1B is not safe with unbuffered sends
    il = ["pipeline", "show", "--schedule", "interleaved", "--stages", "2",
          "--microbatches", "4", "--chunks", "2", "--rendezvous"]
    assert main(il) == EXIT_BAD_INPUT
    assert "deadlock: rank 0 waits in batch" in capsys.readouterr().err
    assert main([*il, "--placement", "lockstep"]) == 0


def test_cost_or_size_out_of_range_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A zero-denominator cost is argparse's exit 2 (no ZeroDivisionError traceback); a
    schedule too large to simulate is refused up front (no hang building it)."""
    with pytest.raises(SystemExit) as e:
        main(["pipeline", "show", "--forward", "1/0"])
    assert e.value.code == EXIT_BAD_INPUT
    assert "not a cost: '1/0'" in capsys.readouterr().err
    assert main(["pipeline", "show", "--microbatches", "1000000000"]) == EXIT_BAD_INPUT
    assert "8000000000 forward/backward actions" in capsys.readouterr().err
