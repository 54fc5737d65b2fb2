"""``plait train``: the training run, on one machine or under torchrun.

Configuration comes from a TOML file (``--config run.toml``), then dotted overrides
(``--train.steps 50``, ``--parallel.dp=2``) and short aliases (``--nproc --dp --tp --pp
--cp --zero --steps`` ...). Everything is validated before any process starts (the
config, the parallel layer's checks, the checkpoint sources, the planner's memory
verdict, the dataset); a bad input prints one paragraph and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.config.choices import AUTO
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.config import Config


def _parser() -> argparse.ArgumentParser:
    t = argparse.ArgumentParser(
        prog="plait train",
        description=(
            "Train the built-in transformer, a Hugging Face Llama (--model.family "
            "hf-llama) or your own model (--model.factory pkg.module:function; see "
            "docs/models.md). Any config field can be set with a dotted "
            "flag (--train.steps 50); short aliases: --nproc --dp --tp --pp --cp --zero "
            "--steps --global-batch --micro-batch --seq-len --lr --seed --data --metrics "
            "--device --progress --init-from, and plait plan's --microbatches --chunks "
            "--schedule --zero-shard-size --recompute. See --help-config for every field."
        ),
    )
    t.add_argument("--config", metavar="PATH", help="TOML file with the run's configuration")
    t.add_argument("--help-config", action="store_true", help="print every config field and exit")
    t.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH",
        help="continue from train.checkpoint_dir's latest checkpoint, or from PATH (sets "
        "train.resume; 'auto': latest if any, else start fresh)",
    )
    t.add_argument(
        "--layout",
        choices=AUTO,
        help="'auto': dp/tp/pp/cp, ZeRO stage, recomputation and micro-batch from the "
        "planner's search for this world size, device and model (docs/planner.md)",
    )
    t.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="with --layout auto: a hardware preset or a profile from `plait bench calibrate`",
    )
    t.add_argument(
        "--ray",
        action="store_true",
        help="run the ranks as Ray actors (same as --launch.backend ray; see docs/ray.md)",
    )
    return t


def _train(rest: Sequence[str], argv: Sequence[str]) -> int:
    """Validate everything, then start ``nproc`` local ranks that each run ``python -m
    plait <argv>``, or (one process, or a rank under torchrun) train in this process."""
    from plait.cli.common import parse_run_flags
    from plait.cli.model_source import checkpoint_defaults
    from plait.config.coerce import config_from_dict
    from plait.config.help_text import format_field_docs
    from plait.config.toml_io import load_config_data
    from plait.launch.local import launch_local, torchrun_env

    overrides, ns = parse_run_flags(_parser(), rest)
    if ns.help_config:
        print(format_field_docs())
        return 0
    if ns.resume:
        overrides.append(f"train.resume={ns.resume}")
    if ns.ray:
        overrides.append("launch.backend=ray")
    data = load_config_data(ns.config, overrides)
    notes = run_defaults(data)
    notes += checkpoint_defaults(data)  # --init-from / --resume a plait checkpoint: its model
    notes += pretrained_defaults(data)
    cfg = config_from_dict(data)
    env = torchrun_env()
    world = env.world_size if env is not None else cfg.launch.nproc
    _check_device(cfg)
    choose: Callable[[int], tuple[list[str], list[str]]] | None = None
    if ns.layout == "auto":  # the planner's search picks the layout (plait.cli.layout_auto)
        from plait.cli.layout_auto import resolve_auto_layout

        def build(sets: list[str]) -> Config:
            d = load_config_data(ns.config, [*overrides, *sets])
            run_defaults(d)
            checkpoint_defaults(d)
            pretrained_defaults(d)
            return config_from_dict(d)

        per_host = env.local_world_size if env is not None else world
        asked, given, cuda = cfg, list(argv), _cuda_device()

        def choose(n: int) -> tuple[list[str], list[str]]:
            """The planner's layout for an elastic world of ``n`` ranks (its settings,
            and the ranks' argument list)."""
            return resolve_auto_layout(
                build, asked, n, ns.hardware, overrides, given, n, cuda, say=False
            )

        sets, argv = resolve_auto_layout(
            build, cfg, world, ns.hardware, overrides, argv, per_host, cuda,
            say=env is None or env.rank == 0,
        )  # fmt: skip
        cfg = build(sets)
    elif ns.hardware is not None:
        raise ConfigError("--hardware is read by --layout auto only; add --layout auto.")
    from plait.train.profile import check_memory_snapshot

    check_memory_snapshot(cfg.log.memory_snapshot, cfg.launch.device)
    if cfg.launch.backend == "ray" and env is None:  # one line and exit 2, before any work
        from plait.launch.ray_session import check_address, import_ray

        import_ray()
        if cfg.launch.ray_address:
            check_address(cfg.launch.ray_address)
    if env is None:  # the launching process (or the only one) says it once
        for note in notes:
            print(f"plait: {note}", flush=True)
    from plait.parallel.checks import validate_run

    validate_run(cfg, world)
    _check_elastic(cfg, world, launching=env is None)
    from plait.checkpoint import check_start, finished_step

    # sources exist; the folder is free, writable and roomy; a resume keeps seed and batch
    check_start(cfg, probe_lock=env is None or env.rank == 0)
    done = finished_step(cfg)
    if done is not None:  # a finished run re-submitted with --resume
        if env is None or env.rank == 0:
            print(
                f"plait: the run is already complete: the checkpoint in "
                f"{cfg.train.checkpoint_dir} is at step {done} and train.steps is "
                f"{cfg.train.steps}; nothing to train"
            )
        return 0
    _check_outputs(cfg)
    # the planner's memory verdict, before any process starts (it knows the built-in
    # transformer's shapes, which model.family 'hf-llama' shares; not a factory model's)
    if cfg.launch.check_memory and cfg.model.factory is None:
        from plait.plan.fit import refuse_unless_fits

        per_host = env.local_world_size if env is not None else world
        refuse_unless_fits(cfg, world, per_host, _cuda_device())
        if cfg.parallel.offload != "none":  # offload: the host's RAM holds the state
            from plait.launch.oom import host_memory_limit
            from plait.plan.offload_check import refuse_host_overflow

            gb = cfg.launch.host_memory_gb
            ram = host_memory_limit(None if gb is None else int(gb * 2**30))
            refuse_host_overflow(cfg, world, per_host, ram)
    if cfg.parallel.offload_dir is not None and cfg.model.factory is None:  # the NVMe tier
        from plait.plan.offload_check import refuse_bad_offload_dir

        refuse_bad_offload_dir(cfg, world, env.local_world_size if env is not None else world)
    if cfg.launch.backend != "local" and env is None:
        _check_data(cfg)
        return _launch_backend(cfg, world)
    if env is None and world > 1:
        _check_data(cfg)  # fail here, once, before starting any process
        gb = cfg.launch.host_memory_gb
        limit = None if gb is None else int(gb * 2**30)
        if cfg.launch.min_ranks is not None:  # --nproc MIN:MAX: shrink to the survivors
            from plait.launch.elastic import launch_elastic

            return launch_elastic(cfg, list(argv), limit, choose)
        return launch_local(world, list(argv), cfg.train.checkpoint_dir, limit)
    from plait.launch.worker import run_rank

    run_rank(cfg, env)
    if env is not None:  # a torchrun child: leave without gloo's exit-time abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def run_defaults(data: dict[str, Any]) -> list[str]:
    """Fill the defaults that depend on the run's output folder ``log.dir`` into the raw
    config ``data``: the metrics JSONL (``<log.dir>/metrics.jsonl``) and, when
    checkpointing or resuming is asked for without ``train.checkpoint_dir``, the folder
    ``<log.dir>/checkpoints``. Returns what was chosen, in words, for the console."""
    from plait.config import LogConfig

    log = data.setdefault("log", {})
    train = data.setdefault("train", {})
    out = Path(str(log.get("dir") or LogConfig.dir))
    notes = []
    if "metrics" not in log:  # an explicit none turns them off
        log["metrics"] = str(out / "metrics.jsonl")
    every = train.get("checkpoint_every") or 0
    wants = every == "auto" or int(every) > 0 or train.get("resume") in (
        "latest",
        "auto",
    )
    if wants and not train.get("checkpoint_dir"):
        train["checkpoint_dir"] = str(out / "checkpoints")
        notes.append(
            f"train.checkpoint_dir not set: checkpoints go to {train['checkpoint_dir']} "
            "(under log.dir)"
        )
    return notes


def pretrained_defaults(data: dict[str, Any]) -> list[str]:
    """When ``train.init_from`` is a Hugging Face model folder, fill the model section of
    the raw config ``data`` from its ``config.json`` (flags that contradict it are
    refused) and check its weight files' headers (every shard there, every tensor of the
    right shape), before any process starts. Returns what was done, in words."""
    init_from = data.get("train", {}).get("init_from")
    if not init_from:
        return []
    from plait.checkpoint.hf_read import is_hf_folder

    if not is_hf_folder(init_from):
        return []
    from plait.checkpoint.hf import model_fields, read_hf_config
    from plait.checkpoint.hf_read import open_hf
    from plait.config.rules.model import check_pretrained_model

    fixed = model_fields(read_hf_config(init_from), str(init_from))
    model = data.setdefault("model", {})
    check_pretrained_model(model, fixed, str(init_from))
    model.update({k: v for k, v in fixed.items() if k not in model})
    open_hf(init_from, str(model.get("family", "plait"))).close()
    arch = "the built-in transformer" if model.get("family", "plait") == "plait" else "hf"
    notes = [
        f"model from {init_from}/config.json: {fixed['n_layers']} layers, dim {fixed['dim']}, "
        f"{fixed['n_heads']} heads ({fixed['n_kv_heads']} key/value), vocabulary "
        f"{fixed['vocab_size']}; loaded into {arch}"
    ]
    from plait.data.tokenizers import hf_tokenizer_file

    section = data.setdefault("data", {})
    if "tokenizer" not in section and hf_tokenizer_file(init_from) is not None:
        section["tokenizer"] = f"hf:{init_from}"  # a pretrained model reads its own tokens
        notes.append(f"data.tokenizer not set: hf:{init_from} (the model folder's tokenizer)")
    return notes


def _check_elastic(cfg: Config, world: int, launching: bool) -> None:
    """Refuse, before any rank starts, memory copies on one rank and an elastic range
    (``--nproc MIN:MAX``) the job could not shrink to (no allowed layout of MIN ranks
    divides the global batch) or that its launcher does not support."""
    from plait.config.rules.elastic import check_memory_checkpoints

    check_memory_checkpoints(cfg.train.memory_checkpoint_every, world)
    low = cfg.launch.min_ranks
    if cfg.train.memory_checkpoint_every != 0 and low is None:
        raise ConfigError(
            "train.memory_checkpoint_every needs an elastic run, --nproc MIN:MAX: plait's "
            "launcher keeps the copies and restores from them (a torchrun or Ray restart "
            "resumes from disk; docs/reliability.md)."
        )
    if low is None or not launching:
        return
    start = cfg.launch.start_ranks
    if start is not None and start < cfg.launch.nproc and not cfg.train.checkpoint_dir:
        raise ConfigError(
            f"launch.start_ranks = {start} < launch.nproc = {cfg.launch.nproc}: growing saves "
            "a checkpoint and restarts from it; set train.checkpoint_dir."
        )
    if cfg.launch.backend != "local":
        raise ConfigError(
            f"--nproc MIN:MAX (launch.min_ranks) is supported by the local launcher; "
            f"launch.backend '{cfg.launch.backend}' restarts at the same size "
            "(launch.max_restarts; see docs/reliability.md)."
        )
    from plait.launch.elastic import degrees_of
    from plait.plan.replan import check_elastic

    degrees = degrees_of(cfg, world)
    micro = cfg.micro_batch(world)
    check_elastic(cfg.train.global_batch, low, degrees, micro, cfg.launch.layouts)


def _check_device(cfg: Config) -> None:
    """Refuse launch.device = 'cuda' where torch sees no CUDA device (before any rank)."""
    if cfg.launch.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ConfigError(
            f"launch.device is 'cuda' but torch ({torch.__version__}, {build}) sees no CUDA "
            "device; use --device cpu (or auto), or install a CUDA build of torch on a "
            "machine with a GPU."
        )


def _launch_backend(cfg: Config, world: int) -> int:
    """``launch.backend`` ray (the ranks as Ray actors) or torchrun (refused outside it)."""
    from plait.errors import ConfigError

    if cfg.launch.backend == "torchrun":
        raise ConfigError(
            "launch.backend is 'torchrun' but this process was not started by torchrun; run "
            "`torchrun --nproc-per-node N -m plait train ...`, or use --launch.backend local."
        )
    from plait.launch.ray_backend import launch_ray

    launch_ray(cfg, world)
    return 0


def _cuda_device() -> tuple[str, float] | None:
    """(name, total memory in bytes) of the first CUDA GPU, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, float(props.total_memory)


def _check_data(cfg: Config) -> None:
    """Refuse a corpus too small for one global batch of training data, or without one
    validation window."""
    from plait.data import check_enough, make_datasets

    train, val = make_datasets(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    check_enough(train, cfg.train.global_batch, "training")
    check_enough(val, 1, "validation")  # any size: a small one is evaluated whole


def _check_outputs(cfg: Config) -> None:
    """The metrics and timeline files can be written (before any process starts)."""
    from plait.cli.common import check_output_path

    check_output_path(cfg.log.metrics, "log.metrics")
    check_output_path(cfg.log.timeline, "log.timeline")


def train_main(rest: Sequence[str]) -> int:
    """``plait train``."""
    from plait.cli.common import run_as_rank

    return run_as_rank(_train, rest, ["train", *rest])
