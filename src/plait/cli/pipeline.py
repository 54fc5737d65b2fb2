"""``plait pipeline draw | show``: look at a pipeline schedule before anything runs.

``plait pipeline draw --schedule 1f1b --stages 4 --microbatches 8 [--chunks 2] [--out
1f1b.png]`` simulates the schedule and writes its Gantt chart (ranks as rows, forward /
backward / weight-gradient colours, bubbles white, the bubble fraction in the title).
``plait pipeline show ...`` prints every rank's actions (compute and communication, one
batch of adjacent communication actions in brackets) and the simulated makespan, bubble
and peak in-flight micro-batches next to the textbook figure. Costs: ``--forward``,
``--backward`` (zero-bubble splits it evenly into I and W) and ``--comm`` per batch.
``--placement lockstep`` places the communication for unbuffered sends and
``--rendezvous`` checks and simulates with them (see ``schedules.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from fractions import Fraction

from plait.cli.common import check_output_path
from plait.errors import ConfigError
from plait.parallel.pipeline.actions import Schedule
from plait.parallel.pipeline.schedules import PLACEMENTS, SCHEDULES, build_schedule, comm_steps
from plait.parallel.pipeline.simulate import Costs, SimResult, simulate
from plait.parallel.pipeline.validate import validate

MAX_ACTIONS = 200_000
"""Most compute actions (p·m·v forward + backward) the CLI builds and simulates (about
half a minute on a loaded 2-core machine; validation and simulation are linear in it)."""
MAX_DRAWN = 20_000
"""Most compute actions ``pipeline draw`` puts in a chart (bounds the drawing's time)."""


def _cost(text: str) -> Fraction:
    """A cost such as ``2`` or ``3/2``; a bad one is argparse's exit-2 error."""
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError) as e:
        raise argparse.ArgumentTypeError(f"not a cost: {text!r} ({e})") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plait pipeline", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name, text in (
        ("draw", "write the schedule's Gantt chart (PNG)"),
        ("show", "print every rank's actions and the simulated bubble"),
    ):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
        s.add_argument("--stages", type=int, default=4, help="pipeline ranks p (default 4)")
        s.add_argument("--microbatches", type=int, default=8, help="micro-batches m (default 8)")
        s.add_argument("--chunks", type=int, default=1, help="chunks per rank v (interleaved)")
        s.add_argument("--forward", type=_cost, default=Fraction(1), help="forward cost")
        s.add_argument(
            "--backward",
            type=_cost,
            default=Fraction(2),
            help="backward cost (I = W = half of it for zb)",
        )
        s.add_argument("--comm", type=_cost, default=Fraction(0), help="cost per comm batch")
        s.add_argument(
            "--placement",
            choices=PLACEMENTS,
            default="adjacent",
            help="where the send/receive actions go (default adjacent)",
        )
        s.add_argument(
            "--rendezvous",
            action="store_true",
            help="sends block until received (validate and simulate so)",
        )
        if name == "draw":
            s.add_argument("--out", help="PNG path (default <schedule>.png)")
    return p


def _build(ns: argparse.Namespace) -> tuple[Schedule, SimResult]:
    if ns.forward < 0 or ns.backward < 0 or ns.comm < 0:
        raise ConfigError(
            f"costs must be >= 0, got --forward {ns.forward} --backward {ns.backward} "
            f"--comm {ns.comm}"
        )
    n = 2 * ns.stages * ns.microbatches * ns.chunks
    if n > MAX_ACTIONS:
        raise ConfigError(
            f"--stages {ns.stages} x --microbatches {ns.microbatches} x --chunks {ns.chunks} "
            f"is {n} forward/backward actions, more than the {MAX_ACTIONS} this command "
            "simulates; use fewer micro-batches (the bubble fraction settles after a few "
            "times the stage count)"
        )
    if ns.what == "draw" and n > MAX_DRAWN:
        raise ConfigError(
            f"--stages {ns.stages} x --microbatches {ns.microbatches} x --chunks {ns.chunks} "
            f"is {n} forward/backward actions, more than the {MAX_DRAWN} a chart shows; draw "
            "fewer micro-batches, or use `plait pipeline show` for the numbers"
        )
    if ns.what == "draw":
        check_output_path(ns.out or f"{ns.schedule}.png", "--out")
    sched = build_schedule(ns.schedule, ns.stages, ns.microbatches, ns.chunks, ns.placement)
    validate(sched, rendezvous=ns.rendezvous)
    costs = Costs(
        forward=ns.forward,
        backward=ns.backward,
        backward_input=ns.backward / 2,
        backward_weight=ns.backward / 2,
        comm=ns.comm,
    )
    return sched, simulate(sched, costs, ns.rendezvous)


def _textbook(s: Schedule) -> str:
    p, m, v = s.stages, s.microbatches, s.chunks
    if s.name in ("gpipe", "1f1b"):
        return f"textbook (p-1)/(m+p-1) = {float(Fraction(p - 1, m + p - 1)):.4f}"
    if s.name == "interleaved":
        of_1f1b = float(Fraction(p - 1, v * (m + p - 1)))
        own = float(Fraction(p - 1, v * m + p - 1))
        return (
            f"textbook: idle = (1/v)(p-1)/(m+p-1) = {of_1f1b:.4f} of the 1F1B step, "
            f"(p-1)/(vm+p-1) = {own:.4f} of its own"
        )
    if s.name == "naive":
        return f"textbook (p-1)/p = {float(Fraction(p - 1, p)):.4f}"
    return "ZB-H1 at F = I = W: (p-1)/(3m+p-1) = " + f"{float(Fraction(p - 1, 3 * m + p - 1)):.4f}"


def pipeline_main(argv: Sequence[str]) -> int:
    """``plait pipeline``; returns the exit code."""
    ns = _parser().parse_args(argv)
    sched, sim = _build(ns)
    if ns.what == "draw":
        from plait.viz import draw_timeline

        out = ns.out or f"{ns.schedule}.png"
        v = f" v={sched.chunks}" if sched.chunks > 1 else ""
        title = f"{sched.name} p={sched.stages} m={sched.microbatches}{v}"
        draw_timeline(sim.timeline, out, title, ranks=sched.stages, chunks=sched.chunks)
        print(f"wrote {out}: {title}, simulated bubble {float(sim.bubble):.4f}")
        return 0
    for r, acts in enumerate(sched.actions):
        steps = [
            " ".join(map(str, st)) if st[0].op.is_compute else "[" + " ".join(map(str, st)) + "]"
            for st in comm_steps(acts)
        ]
        print(f"rank {r}: {' '.join(steps)}")
    print(
        f"makespan {float(sim.makespan):g}, bubble {float(sim.bubble):.4f} "
        f"({_textbook(sched)}), peak in-flight per rank {list(sim.peak_inflight)}"
    )
    return 0
