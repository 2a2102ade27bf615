"""Draft and target services as Ray actors on different GPU nodes, and a coordinator in front of them.

    ray.init(address="auto")
    deployment = launch(RayLaunchSettings(redis_url="redis://:pw@10.0.0.5:6379/0",
                                          target_args=("--model", "smollm2-135m-instruct", "--device", "cuda"),
                                          draft_args=("--proposer", "ngram", "--tokenizer", "smollm2-135m-instruct"),
                                          plaintext=True))
    print(deployment.coordinator["endpoint"])   # the public API
    deployment.shutdown()                        # drain, deregister, stop

1. A placement group of two bundles ({GPU: n, CPU: m} each) with the STRICT_SPREAD strategy: Ray puts
   the bundles on two different nodes, or on none. The target actor takes bundle 0, the draft bundle 1.
2. Each actor runs its service as a child process (`python -m target_service ...`, dying with the actor),
   bound to --bind-host, and reports where it listens: the node's IP and the port the service chose.
   Ray's CUDA_VISIBLE_DEVICES reaches the child, so `--device cuda` means the actor's own GPU.
3. Inside the actor a registrar thread (specdec.registrar) publishes the endpoint in Redis
   (ReplicaRegistry, under a lease, pool "speculative"; extra baseline targets in pool "baseline").
4. A coordinator actor (no GPU) starts against the same Redis, without --target/--draft flags: it
   discovers the replicas in the registry, so replicas added or replaced later are found too.

Ray is an optional extra (`pip install specdec[ray]`); nothing here imports it at module load. Ray's
control plane exchanges pickles and its dashboard has no authentication: run it on a private network
only (docs/DEPLOYMENT.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("specdec.ray")

SPECULATIVE, BASELINE = "speculative", "baseline"


@dataclass(frozen=True)
class ServiceSpec:
    """One service process: its module, flags, and (model services) how it is registered."""

    module: str  # "target_service" | "draft_service" | "coordinator"
    args: tuple[str, ...] = ()
    kind: str | None = None  # "target" | "draft": registered in Redis; None: not registered
    pool: str = SPECULATIVE
    model: str = ""
    capacity: int = 0  # the service's --num-slots, reported with its registration
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RayLaunchSettings:
    redis_url: str
    target_args: tuple[str, ...] = ()  # target_service flags: --model, --device, --dtype, ...
    draft_args: tuple[str, ...] = ()  # draft_service flags: --proposer, --model, ...
    coordinator_args: tuple[str, ...] = ()  # coordinator flags beyond --redis-url (and --plaintext)
    redis_prefix: str = "specdec"
    plaintext: bool = False  # explicit opt-in (private network); otherwise pass TLS flags in the args
    bind_host: str = "0.0.0.0"  # the coordinator on another node must reach the model services
    advertise_host: str | None = None  # what the coordinator dials; None: the node's IP as Ray knows it
    coordinator_port: int = 50051
    num_gpus: float = 1.0  # per model replica
    num_cpus: float = 1.0  # per model replica
    baseline_targets: int = 0  # plain-decoding target replicas (pool "baseline"), anywhere with a GPU
    ready_timeout_s: float = 600.0  # model download and loading included
    env: tuple[tuple[str, str], ...] = ()  # extra environment of every service process

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("a Redis URL reachable from every node is required (--redis-url)")
        if self.num_gpus < 0 or self.num_cpus < 0 or self.baseline_targets < 0:
            raise ValueError("GPUs, CPUs and baseline targets must be >= 0")


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGTERMs the service when the actor's thread that started it dies,
    so a killed actor (ray.kill, a lost node) never leaves a service behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def start_process(module: str, args: list[str], env: dict[str, str], log_dir: Path):
    """`python -m module args` on free ports (unless args set them), wrapped in a ServiceProcess."""
    from specdec.processes import SOURCE_ROOT, ServiceProcess

    stem = f"{module}-{time.monotonic_ns()}"
    ready_file, log_path = log_dir / f"{stem}.ready.json", log_dir / f"{stem}.log"
    extra = ["--ready-file", str(ready_file)]
    for flag in ("--port", "--metrics-port", "--health-port"):
        if flag not in args:
            extra += [flag, "0"]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), child_env.get("PYTHONPATH")]))
    with open(log_path, "wb") as log_file:
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        proc = subprocess.Popen([sys.executable, "-m", module, *args, *extra], env=child_env, stdout=log_file,
                                stderr=subprocess.STDOUT, preexec_fn=preexec)
    return ServiceProcess(module, proc, log_path, ready_file)


class ServiceActor:
    """A Ray actor holding one service process (and its registrar thread)."""

    def __init__(self, spec: ServiceSpec, redis_url: str, redis_prefix: str, bind_host: str,
                 advertise_host: str | None = None):
        self.spec, self.redis_url, self.redis_prefix = spec, redis_url, redis_prefix
        self.bind_host, self.advertise_host = bind_host, advertise_host
        self.proc = None
        self._registrar: threading.Thread | None = None
        self._stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def start(self, timeout_s: float) -> dict:
        import ray

        from specdec.registrar import host_port

        log_dir = Path(tempfile.mkdtemp(prefix=f"specdec-ray-{self.spec.module}-"))
        args = [*self.spec.args, "--host", self.bind_host]
        self.proc = start_process(self.spec.module, args, dict(self.spec.env), log_dir)
        self.proc.wait_ready(timeout_s)  # raises with the log tail if the service fails to start
        node_ip = ray.util.get_node_ip_address()
        info = {
            "module": self.spec.module, "kind": self.spec.kind, "pool": self.spec.pool,
            "endpoint": host_port(self.advertise_host or node_ip, self.proc.port),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": node_ip, "pid": self.proc.pid, "health_port": self.proc.health_port,
            "metrics_port": self.proc.metrics_port, "log": str(self.proc.log_path),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }
        if self.spec.kind is not None:
            self._start_registrar(info)
        return info

    def _start_registrar(self, info: dict) -> None:
        from specdec.registrar import RegistrarSettings, host_port, run_registrar

        settings = RegistrarSettings(
            redis_url=self.redis_url, redis_prefix=self.redis_prefix, kind=self.spec.kind, pool=self.spec.pool,
            replica_id=f"ray-{self.spec.kind}-{info['node_id'][:12]}-{self.proc.pid}", endpoint=info["endpoint"],
            health_address=host_port("127.0.0.1", self.proc.health_port or self.proc.port),
            metrics_url=f"http://127.0.0.1:{self.proc.metrics_port}/metrics" if self.proc.metrics_port else None,
            model=self.spec.model, capacity=self.spec.capacity, drain_timeout_s=5.0,
        )
        started = threading.Event()

        def main() -> None:
            async def body() -> None:
                self._stop = (asyncio.get_running_loop(), asyncio.Event())
                started.set()
                await run_registrar(settings, self._stop[1])

            asyncio.run(body())

        self._registrar = threading.Thread(target=main, name="specdec-registrar", daemon=True)
        self._registrar.start()
        started.wait(10.0)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Graceful: the registrar marks the replica draining, the service gets one SIGTERM (a second
        one would cut its drain short) and exits, then the registrar removes the registration."""
        if self._stop is not None:
            loop, event = self._stop
            loop.call_soon_threadsafe(event.set)
        code = self.proc.stop(timeout_s) if self.proc is not None else None
        if self._registrar is not None:
            self._registrar.join(timeout_s)
        return code


@dataclass
class RayDeployment:
    coordinator: dict
    targets: list[dict]
    drafts: list[dict]
    actors: list = field(repr=False)
    placement_group: object = field(repr=False)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the coordinator first, then the model services; free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        coordinator, *models = self.actors
        for group in ([coordinator], models):
            try:
                ray.get([actor.stop.remote(timeout_s) for actor in group], timeout=timeout_s + 15)
            except Exception as exc:  # an actor already gone: nothing left to stop there
                log.warning("stopping actors: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)


def service_specs(settings: RayLaunchSettings) -> tuple[ServiceSpec, ServiceSpec, list[ServiceSpec], ServiceSpec]:
    """What each actor runs: target, draft, baseline targets, coordinator."""
    secure = ("--plaintext",) if settings.plaintext else ()
    env = settings.env
    target = ServiceSpec("target_service", (*settings.target_args, *secure), "target", SPECULATIVE,
                         _flag(settings.target_args, "--model"), int(_flag(settings.target_args, "--num-slots") or 8),
                         env)
    draft = ServiceSpec("draft_service", (*settings.draft_args, *secure), "draft", SPECULATIVE,
                        _flag(settings.draft_args, "--model") or _flag(settings.draft_args, "--proposer"),
                        int(_flag(settings.draft_args, "--num-slots") or 8), env)
    baseline = [ServiceSpec(target.module, target.args, "target", BASELINE, target.model, target.capacity, env)
                for _ in range(settings.baseline_targets)]
    client_secure = ("--plaintext", "--target-plaintext", "--draft-plaintext") if settings.plaintext else ()
    # The Redis URL may hold a password: the environment, unlike flags, does not show in `ps`.
    coordinator = ServiceSpec("coordinator", (
        "--redis-prefix", settings.redis_prefix, "--port", str(settings.coordinator_port),
        *settings.coordinator_args, *client_secure), env=(*env, ("SPECDEC_REDIS_URL", settings.redis_url)))
    return target, draft, baseline, coordinator


def _flag(args: tuple[str, ...], name: str) -> str:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return ""


def launch(settings: RayLaunchSettings) -> RayDeployment:
    """Place and start everything on the Ray cluster this process is connected to (ray.init first)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    target, draft, baseline, coordinator = service_specs(settings)
    bundle = {"CPU": settings.num_cpus, **({"GPU": settings.num_gpus} if settings.num_gpus else {})}
    group = placement_group([dict(bundle), dict(bundle)], strategy="STRICT_SPREAD", name="specdec-draft-target")
    try:
        ray.get(group.ready(), timeout=settings.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"no two different nodes offer {bundle} each within {settings.ready_timeout_s:.0f} s: the draft and "
            "the target must run on different nodes (STRICT_SPREAD)") from None
    remote = ray.remote(ServiceActor)
    common = (settings.redis_url, settings.redis_prefix, settings.bind_host, settings.advertise_host)

    def on_bundle(spec: ServiceSpec, index: int):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
        return remote.options(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus,
                              scheduling_strategy=strategy, name=None).remote(spec, *common)

    models = [on_bundle(target, 0), on_bundle(draft, 1)]
    models += [remote.options(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus).remote(spec, *common)
               for spec in baseline]
    front = remote.options(num_cpus=0).remote(coordinator, *common)
    actors = [front, *models]
    try:
        infos = ray.get([actor.start.remote(settings.ready_timeout_s) for actor in models])
        coordinator_info = ray.get(front.start.remote(settings.ready_timeout_s))
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise
    targets = [infos[0], *infos[2:]]
    return RayDeployment(coordinator_info, targets, [infos[1]], actors, group)
