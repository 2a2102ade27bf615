"""The distributed system under test, started as `specdec launch` starts it: a real Redis, the target
service, one draft service per proposer and one coordinator per proposer (a coordinator picks its
draft replica itself, so each proposer gets its own), all separate processes talking real gRPC.

Plain decoding goes through the same coordinator and target: the baseline pool (no draft).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.methods import IN_PROCESS_PROPOSERS, TARGET_MODEL_PROPOSER
from specdec.bench.netdelay import LoopbackNetwork
from specdec.processes import ServiceProcess, stop_all


@dataclass(frozen=True)
class ServiceOptions:
    target_dir: Path
    draft_dir: Path | None = None
    backend: str = "native"
    dtype: str = "float32"
    target_device: str = "cpu"
    draft_device: str = "cpu"
    threads: int = 2
    cuda_graphs: bool | None = None  # None: the services' default (on for a CUDA device)
    num_slots: int = 8
    num_draft_tokens: int = 4
    max_context: int | None = None
    replay_references: Path | None = None  # replay proposers (model-scale runs): references file
    replay_seed: int = 0
    replay_alpha_spread: float = 0.0  # each prompt's alpha over alpha +- this (proposers/replay.py)
    replay_target_alpha: float | None = None  # the target hosts a replay draft (bench/replay_target.py)
    extra_env: dict = field(default_factory=dict)
    target_args: tuple[str, ...] = ()  # extra flags for the target service
    draft_args: tuple[str, ...] = ()  # extra flags for every draft service
    coordinator_args: tuple[str, ...] = ()  # extra flags for every coordinator
    # Extra coordinators "<proposer>@branches<N>" with --pipeline-branches N (multi-outcome methods).
    branch_coordinators: tuple[str, ...] = ()
    plain_calls: bool = False  # a coordinator with --plain-decoding calls (method plain-calls)


def draft_specs(options: ServiceOptions, proposers: list[str]) -> dict[str, tuple[str, list[str]]]:
    """proposer name -> (module, args) of its draft service. Names: "ngram", "draft-model",
    "replay-<alpha>" (the draft model's forward passes, the target's token with probability alpha)."""
    specs = {}
    model = ["--backend", options.backend, "--device", options.draft_device, "--dtype", options.dtype,
             "--num-slots", str(options.num_slots)]
    if options.max_context:
        model += ["--max-context", str(options.max_context)]
    model += cuda_graphs_args(options)
    common = ["--plaintext", "--num-draft-tokens", str(options.num_draft_tokens)]
    for name in proposers:
        if name in IN_PROCESS_PROPOSERS:
            continue  # inside its coordinator or the target (add_coordinators)
        if name == "ngram":
            specs[name] = ("draft_service", common + ["--proposer", "ngram", "--tokenizer", str(options.target_dir)])
        elif name == "draft-model":
            specs[name] = ("draft_service", common + ["--proposer", "draft-model", "--model",
                                                      str(options.draft_dir), *model])
        elif name.startswith("replay-"):
            specs[name] = ("specdec.bench.replay_service", common + [
                "--proposer", "draft-model", "--model", str(options.draft_dir), *model,
                "--tokenizer", str(options.target_dir), "--replay-alpha", name.split("-", 1)[1],
                "--replay-references", str(options.replay_references), "--replay-seed", str(options.replay_seed),
                "--replay-alpha-spread", f"{options.replay_alpha_spread:g}"])
        else:
            raise ValueError(f"unknown proposer {name!r}")
    return specs


def cuda_graphs_args(options: ServiceOptions) -> list[str]:
    return [] if options.cuda_graphs is None else ["--cuda-graphs", "on" if options.cuda_graphs else "off"]


class Deployment:
    def __init__(self, options: ServiceOptions, network: LoopbackNetwork):
        self.options, self.network = options, network
        self.env = {"OMP_NUM_THREADS": str(options.threads), **options.extra_env}
        self.stack = contextlib.ExitStack()
        self.redis_url = ""
        self.target: ServiceProcess | None = None
        self.drafts: dict[str, ServiceProcess] = {}
        self.proposers: list[str] = []
        self.coordinators: dict[str, str] = {}  # proposer (or "baseline") -> address for clients
        self.processes: list[ServiceProcess] = []

    def start(self, proposers: list[str], timeout_s: float = 600.0) -> "Deployment":
        from specdec.store import EmbeddedRedis

        try:
            redis = self.stack.enter_context(EmbeddedRedis(unix_socket=self.network.redis_unix_socket()))
            self.redis_url = redis.url
            self.stack.callback(self._stop)
            o = self.options
            target_args = ["--host", self.network.host("target"), "--plaintext", "--model", str(o.target_dir),
                           "--backend", o.backend, "--device", o.target_device, "--dtype", o.dtype,
                           "--num-slots", str(o.num_slots)]
            if o.max_context:
                target_args += ["--max-context", str(o.max_context)]
            target_args += cuda_graphs_args(o) + list(o.target_args)
            module = "target_service"
            if TARGET_MODEL_PROPOSER in proposers:  # the target hosts the draft model, on its own device
                target_args += ["--inner-draft", str(o.draft_dir)]
                if o.replay_target_alpha is not None:  # ... as a replay draft (model-scale runs)
                    module = "specdec.bench.replay_target"
                    target_args += ["--replay-alpha", f"{o.replay_target_alpha:g}", "--replay-references",
                                    str(o.replay_references), "--replay-seed", str(o.replay_seed),
                                    "--replay-alpha-spread", f"{o.replay_alpha_spread:g}"]
            self.proposers = list(proposers)
            self.target = self._spawn("target", module, target_args)
            for name, (module, args) in draft_specs(o, proposers).items():
                self.drafts[name] = self._spawn("draft", module, ["--host", self.network.host("draft"), *args,
                                                                  *o.draft_args])
            for role, proc in [("target", self.target), *[("draft", p) for p in self.drafts.values()]]:
                self.network.wait(role, proc, timeout_s)
            self.coordinators = self.add_coordinators(self.network)
            return self
        except BaseException:
            self.close()
            raise

    def add_coordinators(self, network: LoopbackNetwork) -> dict[str, str]:
        """One coordinator per proposer (plus one for plain decoding when there is none), dialing
        the services through `network` (a delay network reuses the running services)."""
        target = network.route("target", self.target.address)
        plans = {name: ["--draft", network.route("draft", proc.address)] for name, proc in self.drafts.items()}
        for name, draft in IN_PROCESS_PROPOSERS.items():
            if name in self.proposers:
                plans[name] = ["--draft", draft]
        for variant in self.options.branch_coordinators:
            proposer, _, branches = variant.partition("@branches")
            if proposer in plans:
                plans[variant] = [*plans[proposer], "--pipeline-branches", branches]
        if not plans:
            plans = {"baseline": ["--default-pool", "baseline"]}
        if self.options.plain_calls:
            plans["baseline-calls"] = ["--default-pool", "baseline", "--plain-decoding", "calls"]
        started = {}
        for name, extra in plans.items():
            args = ["--host", "127.0.0.1", "--plaintext", "--tokenizer", str(self.options.target_dir),
                    "--redis-url", self.redis_url, "--target", target, "--target-plaintext",
                    "--draft-plaintext", "--num-draft-tokens", str(self.options.num_draft_tokens),
                    # Sequential methods are sequential unless --coordinator-arg says otherwise (the last
                    # --pipelining given wins); pipelined methods ask for it in their requests.
                    "--pipelining", "off", *extra, *self.options.coordinator_args]
            started[name] = self._spawn("coordinator", "coordinator", args)
        addresses = {}
        for name, proc in started.items():
            self.network.wait("coordinator", proc, 120)
            addresses[name] = self.network.client_address(proc)
        addresses.setdefault("baseline", next(iter(addresses.values())))
        return addresses

    def _spawn(self, role: str, module: str, args: list[str]) -> ServiceProcess:
        proc = self.network.spawn(role, module, args, self.env)
        self.processes.append(proc)
        return proc

    def _stop(self) -> None:
        stop_all(*reversed(self.processes))  # coordinators first, then drafts and the target

    def close(self) -> None:
        self.stack.close()

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
