"""``plait tune``: a hyperparameter search on Ray Tune, each trial a multi-rank run.

``plait tune --search train.lr=1e-4,3e-4,1e-3 --search parallel.zero=1,3 --nproc 2
--steps 50`` runs the 3 x 2 grid; ``--search 'train.lr=loguniform(1e-4,1e-2)' --samples
8`` draws 8 configurations. Every other flag is a ``plait train`` flag: the base run
that each trial changes. Each trial is one ``plait train --nproc N`` run reserving N
CPUs; ASHA stops bad trials early (``--scheduler fifo`` runs every trial to the end).
It ends with a table of the trials (config, final loss, tokens/s), best first, and
writes the best trial's whole config as TOML (``--best``, default ``<out>/best.toml``).
See :mod:`plait.launch.ray_tune` and docs/ray.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from plait.cli.common import ConfigErrorParser
from plait.errors import ConfigError, PlaitError


def _parser() -> argparse.ArgumentParser:
    p = ConfigErrorParser(prog="plait tune", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="KEY=SPEC",
        help="a config field and its values: v1,v2,... (grid) or uniform(a,b), "
        "loguniform(a,b), randint(a,b), choice(a,b,...) (sampled); repeatable",
    )
    p.add_argument("--samples", type=int, default=1, help="configurations drawn (x the grid)")
    p.add_argument("--scheduler", choices=("asha", "fifo"), default="asha")
    p.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: "
                   "as many as the CPUs allow)")  # fmt: skip
    p.add_argument("--out", default="plait-tune", help="folder of Tune's results and best.toml")
    p.add_argument("--best", default=None, help="write the best config here (TOML)")
    p.add_argument("--config", metavar="PATH", help="TOML file with the base run")
    return p


def tune_main(argv: Sequence[str]) -> int:
    """``plait tune``; returns the exit code."""
    from plait.config.overrides import parse_override_flags
    from plait.config.toml_io import dump_toml, load_config
    from plait.launch.ray_session import check_address, import_ray, ray_session
    from plait.launch.ray_tune import check_space, format_table, parse_search, run_search

    search = [a for i, a in enumerate(argv) if i > 0 and argv[i - 1] == "--search"]
    rest = [
        a for i, a in enumerate(argv)
        if a != "--search" and not (i > 0 and argv[i - 1] == "--search")
    ]  # fmt: skip
    overrides, remaining = parse_override_flags(rest)
    ns = _parser().parse_args([*remaining, *(x for s in search for x in ("--search", s))])
    if ns.samples < 1:
        raise ConfigError(f"plait tune: --samples must be >= 1, got {ns.samples}.")
    items = [parse_search(s) for s in ns.search]
    base_cfg = load_config(ns.config, overrides)
    import_ray()
    address = base_cfg.launch.ray_address
    if address:
        check_address(address)
    base = [f"--{o.partition('=')[0]}={o.partition('=')[2]}" for o in overrides]
    base = [b for b in base if not b.startswith(("--launch.backend=", "--launch.ray_address="))]
    if ns.config:
        base = ["--config", str(Path(ns.config).resolve()), *base]
    world = base_cfg.launch.nproc
    check_space(items, [o for o in overrides if not o.startswith("launch.")], world)
    out = Path(ns.out)
    with ray_session(address, world):
        rows = run_search(
            items, base, world, base_cfg.train.steps, ns.samples, ns.scheduler, out,
            ns.max_concurrent,
        )  # fmt: skip
    print(format_table(rows), flush=True)
    good = [r for r in rows if r.status != "error"]
    if not good:
        raise PlaitError(f"plait tune: every trial failed; see the trial logs under {out}/tune")
    best = good[0]
    cfg = load_config(ns.config, [*overrides, *(f"{k}={v}" for k, v in best.values.items())])
    path = Path(ns.best) if ns.best else out / "best.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_toml(cfg))
    tmp.replace(path)
    vals = " ".join(f"{k}={v}" for k, v in best.values.items())
    print(f"plait tune: best {vals} (final loss {best.loss:.4f}); config written to {path}")
    return 0
