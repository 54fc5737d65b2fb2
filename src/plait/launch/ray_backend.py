"""``plait train --ray``: every rank a Ray actor, restarted from the last checkpoint.

The ranks are plain Ray actors (one CPU, plus one GPU with ``launch.device = cuda``)
placed in one placement group with the PACK strategy, so the ranks of a node sit
together; ranks are numbered node by node, so the mesh's inner axes (tp fastest) stay
inside a node. Rank 0's actor names its own address and a free port; every rank joins
the world there over TCP (``plait.comm.init_world``) and runs exactly what a rank of
``plait train --nproc`` runs (:func:`plait.launch.worker.run_rank`): the mesh and every
parallelism are unchanged. Rank 0 prints the progress lines; Ray forwards them to the
driver.

Faults: when a rank dies (its process is killed, the actor crashes) or fails (an
exception; a hung peer is cut by ``parallel.timeout_s`` and raises on the survivors),
every actor of the attempt is killed. With restarts left (``launch.max_restarts``) a
new set of actors starts in the same placement group and resumes from the checkpoint
that ``train.checkpoint_dir``'s ``latest`` names — one written since the launch; before
any, the restart starts the way the first attempt did — so the losses after a resume
equal an uninterrupted run's, as under ``torchrun --max-restarts``. Without restarts
left, :class:`~plait.launch.local.LaunchError` names each failed rank and its error (a
rank that died is named as such). A bad input found by a rank is not retried.

Why not Ray Train's ``TorchTrainer``: on this project's 2-core reference machine a
TorchTrainer (Ray Train v2: controller, state and watcher actors around the worker
group) took ~35 s from ``fit()`` to the end of a 2-worker function that does nothing,
against ~5 s for this actor group to join a gloo world; restarts pay that again. The
worker group here is what TorchTrainer's is (actors in a PACK placement group, the
process group formed at rank 0's address, restart on failure up to a limit), with
plait's own timeouts, error messages and resume rule. See docs/ray.md.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.errors import ConfigError
from plait.launch.local import LaunchError, RankEnv
from plait.launch.ray_session import ray_session
from plait.parallel.checks import carry_validation

Say = Callable[[str], None]


def latest_checkpoint(cfg: Config) -> str | None:
    """What ``train.checkpoint_dir``'s ``latest`` names now (None: no checkpoint)."""
    if not cfg.train.checkpoint_dir:
        return None
    from plait.checkpoint import read_latest

    try:
        p = read_latest(Path(cfg.train.checkpoint_dir))
    except OSError:
        return None
    return str(p) if p is not None else None


def restart_config(cfg: Config, before: str | None) -> Config:
    """The config of a restarted attempt: resume from ``latest`` when the job wrote a
    checkpoint since the launch (``before``: what ``latest`` named then); otherwise start
    the way the first attempt did."""
    now = latest_checkpoint(cfg)
    if now is None or (now == before and cfg.train.resume is None):
        return cfg
    train = dataclasses.replace(cfg.train, resume="latest", init_from=None)
    return carry_validation(cfg, dataclasses.replace(cfg, train=train))


def absolute_paths(cfg: Config, cwd: Path | None = None) -> Config:
    """``cfg`` with its relative file and folder paths made absolute against the driver's
    working directory (``cwd``; default: this process's): a Ray actor runs in a folder of
    Ray's choosing, where a relative ``ck`` would name another place."""
    base = Path.cwd() if cwd is None else cwd

    def fix(value: str | None, keep: tuple[str, ...] = ()) -> str | None:
        if value is None or value in keep or Path(value).is_absolute():
            return value
        return str(base / value)

    t, log, data = cfg.train, cfg.log, cfg.data
    train = dataclasses.replace(
        t,
        checkpoint_dir=fix(t.checkpoint_dir),
        resume=fix(t.resume, ("latest", "auto")),
        init_from=fix(t.init_from),
    )
    log = dataclasses.replace(log, metrics=fix(log.metrics), timeline=fix(log.timeline))
    source = data.source
    if source != "stdlib" and (base / source).exists():
        source = str(base / source)
    fixed = dataclasses.replace(
        cfg, train=train, log=log, data=dataclasses.replace(data, source=source)
    )
    return carry_validation(cfg, fixed)  # the ranks need not validate it again


class RankActor:
    """One rank (wrapped with ``ray.remote`` when launched; Ray imports this module in the
    actor's process)."""

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP address, a free TCP port on it)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), port

    def run(self, cfg: Config, env: RankEnv, init_method: str) -> dict[str, Any]:
        """Train as rank ``env.rank``; the run's summary."""
        from plait.launch.worker import run_rank

        return run_rank(cfg, env, show_progress=env.rank == 0, init_method=init_method)


def _failure_text(err: BaseException) -> tuple[str, bool]:
    """(one line about a rank's failure, whether it is bad input that must not be retried)."""
    import ray.exceptions as rex

    if isinstance(err, rex.RayTaskError):
        cause = err.cause
        if cause is not None:
            text = str(cause).strip().splitlines()
            return f"{type(cause).__name__}: {text[0] if text else ''}", isinstance(
                cause, ConfigError
            )
    if isinstance(err, rex.ActorDiedError | rex.RayActorError | rex.WorkerCrashedError):
        return "died: its Ray actor's process exited (killed or crashed)", False
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}", False


def _devices(ray: Any, cfg: Config, world: int) -> int:
    """GPUs per rank: 1 with launch.device cuda (or auto on a cluster with enough GPUs)."""
    want = cfg.launch.device
    if want == "cpu":
        return 0
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if want == "cuda" and have < world:
        raise ConfigError(
            f"launch.device cuda on Ray: {world} ranks need {world} GPUs, the cluster has {have:g}."
        )
    return 1 if have >= world else 0


class RayJob:
    """The ranks of one run on Ray: placement group, actors, attempts."""

    def __init__(self, ray: Any, cfg: Config, world: int, say: Say) -> None:
        from ray.util.placement_group import placement_group

        self.ray, self.cfg, self.world, self.say = ray, cfg, world, say
        self.gpus = _devices(ray, cfg, world)
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if self.gpus else {})}
        self.pg = placement_group([bundle] * world, strategy="PACK")
        ready = self.pg.ready()
        done, _ = ray.wait([ready], timeout=60.0)
        if not done:
            ray.util.remove_placement_group(self.pg)
            raise ConfigError(
                f"Ray cannot place {world} ranks of {bundle} each within 60 s; the cluster "
                f"has {ray.cluster_resources()}."
            )
        self.actors: list[Any] = []

    def start(self) -> list[tuple[Any, RankEnv]]:
        """New actors, one per bundle, numbered node by node; (actor, its RankEnv)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = self.ray.remote(RankActor)
        actors = [
            cls.options(
                num_cpus=1,
                num_gpus=self.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(self.world)
        ]
        self.actors = actors
        where = self.ray.get([a.where.remote() for a in actors])
        nodes: list[str] = []
        for node, _, _ in where:
            if node not in nodes:
                nodes.append(node)
        order = sorted(range(self.world), key=lambda i: nodes.index(where[i][0]))
        per_node = {n: sum(1 for w in where if w[0] == n) for n in nodes}
        seen: dict[str, int] = {}
        out = []
        for rank, i in enumerate(order):
            node = where[i][0]
            local = seen.get(node, 0)
            seen[node] = local + 1
            # a GPU rank sees only its own device (cuda:0): its device index is 0
            env = RankEnv(rank, self.world, 0 if self.gpus else local, per_node[node])
            out.append((actors[i], env))
        self.address = where[order[0]][1:]
        return out

    def attempt(self, cfg: Config) -> dict[int, tuple[str, bool]]:
        """Run every rank once; {rank: (failure line, bad input)} (empty: success)."""
        from plait.comm import init_method_tcp

        ranks = self.start()
        url = init_method_tcp(*self.address)
        refs = {a.run.remote(cfg, env, url): env.rank for a, env in ranks}
        failures: dict[int, tuple[str, bool]] = {}
        pending = list(refs)
        self.summaries: dict[int, dict[str, Any]] = {}
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            try:
                self.summaries[refs[done[0]]] = self.ray.get(done[0])
            except Exception as e:
                failures[refs[done[0]]] = _failure_text(e)
                # the others fail at once (closed sockets) or after the comm timeout; give
                # them up to 10 s to say why (a killed rank's death can be reported after
                # its peers' errors), then stop them
                more, pending = self.ray.wait(pending, num_returns=len(pending), timeout=10.0)
                for ref in more:
                    try:
                        self.ray.get(ref)
                    except Exception as e2:
                        failures[refs[ref]] = _failure_text(e2)
                break
        self.stop()
        return failures

    def stop(self) -> None:
        """Kill this attempt's actors."""
        for a in self.actors:
            self.ray.kill(a, no_restart=True)
        self.actors = []

    def close(self) -> None:
        self.stop()
        self.ray.util.remove_placement_group(self.pg)


def _describe(failures: dict[int, tuple[str, bool]]) -> str:
    died = [r for r, (t, _) in failures.items() if t.startswith("died")]
    ranks = died or sorted(failures)
    return ", ".join(f"rank {r}" for r in ranks) + (" died" if died else " failed")


def launch_ray(cfg: Config, world: int, say: Say | None = None) -> dict[str, Any]:
    """Run ``cfg`` on ``world`` Ray ranks with up to ``launch.max_restarts`` restarts;
    rank 0's run summary. Raises :class:`LaunchError` (the failed ranks and their errors)
    or :class:`ConfigError` (Ray missing, a bad address, too few resources, bad input)."""
    tell = say or (lambda line: print(line, flush=True))
    cfg = absolute_paths(cfg)
    before = latest_checkpoint(cfg)
    restarts = cfg.launch.max_restarts
    with ray_session(cfg.launch.ray_address, world) as ray:
        job = RayJob(ray, cfg, world, tell)
        try:
            attempt_cfg, n = cfg, 0
            while True:
                failures = job.attempt(attempt_cfg)
                if not failures:
                    return job.summaries.get(0, {})
                bad = [r for r, (_, b) in failures.items() if b]
                if bad:
                    raise ConfigError(f"rank {bad[0]}: {failures[bad[0]][0]}")
                if n >= restarts:
                    raise LaunchError({r: t for r, (t, _) in failures.items()})
                n += 1
                attempt_cfg = restart_config(cfg, before)
                how = (
                    "from the latest checkpoint"
                    if attempt_cfg.train.resume
                    else "from the start (no checkpoint yet)"
                )
                tell(
                    f"plait: {_describe(failures)}; restarting every rank "
                    f"(restart {n} of {restarts}), {how}"
                )
        finally:
            job.close()
