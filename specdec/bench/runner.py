"""One benchmark run: every method on every prompt, interleaved, on one machine (phases.py).

Setup order: the in-process engines and peers first (they also produce the replay references a
model-scale run needs before its draft services start), then the services, then the phases.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench import arrivals, meta, phases, ties
from specdec.bench.methods import (CATALOG, PLAIN_SERVICE_METHODS, REPLAY_PREFIX, REPLAY_TARGET_PREFIX, SERVER_POLICY,
                                   InProcessPlain,
                                   RequestResult, ServiceMethod, base_name, choose_methods, coordinator_of,
                                   fixed_k_of, is_pipelined, is_service, parse_k_policy, policy_variants,
                                   proposer_of)
from specdec.bench.prompts import load_prompts, select_prompts
from specdec.bench.services import Deployment, ServiceOptions
from specdec.bench.timing import EngineTimer, StepTimes
from specdec.generation.equality import EXACT_DTYPES, TIE_ULPS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    target: str  # registry name, directory, or random:<preset> (gpu.py)
    draft: str | None = None  # the same kinds; None: no draft model
    prompts_file: str | None = None  # None: the project's own set
    categories: tuple[str, ...] = ()
    per_category: int | None = None
    limit: int | None = None
    max_new_tokens: int = 128
    num_draft_tokens: int = 4
    k_policy: str = "fixed"  # fixed | server | fixed,server | fixed:1,2,4,server (methods.parse_k_policy)
    methods: tuple[str, ...] = ()  # empty: every method
    replay_alphas: tuple[float, ...] = ()  # one replay method per alpha (model-scale runs)
    replay_seed: int = 0
    replay_alpha_spread: float = 0.0  # each prompt's alpha over alpha +- this (proposers/replay.py)
    ignore_eos: bool = False  # random-weight models: always generate max_new_tokens
    tie_units: float = TIE_ULPS  # bf16 / fp16: a divergence within this many units in the last place is a tie
    runs: int = 1
    concurrency: tuple[int, ...] = (1,)
    concurrency_prompts: int = 16
    concurrency_rounds: int = 1
    arrival_rates: tuple[float, ...] = ()  # open-loop phase (arrivals.py): requests per second, each a level
    arrival_requests: int = 32  # requests per method, rate and round
    arrival_rounds: int = 1
    arrival_max_sessions: int = 16  # in flight at once; later arrivals wait in the client (counted)
    netem_ms: tuple[float, ...] = ()
    netem_mode: str = "auto"  # auto | netns | proxy
    netem_prompts: int = 6
    threads: int = 2
    backend: str = "native"
    dtype: str = "float32"
    cuda_graphs: bool | None = None  # native backend: None = on for a CUDA device (models/cuda_graphs.py)
    max_context: int | None = None  # tokens per session, services and in process (None: the models' default)
    device: str = "cpu"
    draft_device: str | None = None  # None: the target's device
    floor: bool = False  # also measure the memory-bandwidth floor of a target step
    pld_tokens: int | None = None  # None: num_draft_tokens
    timing_repeats: int = 3
    seed: int = 0
    log_dir: Path | None = None
    extra_env: dict = field(default_factory=dict)
    target_args: tuple[str, ...] = ()  # extra flags for the target service (--target-arg)
    draft_args: tuple[str, ...] = ()  # extra flags for every draft service (--draft-arg)
    coordinator_args: tuple[str, ...] = ()  # extra flags for every coordinator (--coordinator-arg)

    @property
    def target_flags(self):
        """The --target-arg flags as the target service itself parses them (the rest left alone)."""
        from target_service.main import build_parser

        return build_parser().parse_known_args(list(self.target_args))[0]

    @property
    def batch_invariant_target(self) -> bool:
        """--target-arg=--batch-invariant: the target computes every row as alone (no near-ties)."""
        return self.target_flags.batch_invariant

    @property
    def batch_invariant_rows(self) -> int | None:
        """--target-arg=--batch-invariant-rows=N: the mode's product chunk (None: the device's default)."""
        return self.target_flags.batch_invariant_rows

    def target_step_threads(self):
        """The target service's intra-op threads by forward width (--target-arg=--wide-step-threads /
        --wide-step-tokens, as it parses them), for the in-process target that times its steps; call
        with the process's threads set to --threads, as the service starts with."""
        from specdec.models.step_threads import policy_for

        flags = self.target_flags
        return policy_for(self.device, flags.wide_step_threads, flags.wide_step_tokens, flags.batch_invariant)


@dataclass
class Collected:
    results: list[RequestResult] = field(default_factory=list)
    times: list[StepTimes] = field(default_factory=list)
    notes: dict = field(default_factory=dict)


def resolve(name: str, config: BenchConfig) -> Path:
    from specdec.bench.gpu import model_dir

    return model_dir(name, config.dtype, config.seed)


class Bench:
    def __init__(self, config: BenchConfig, progress=None):
        from specdec.models.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

        self.config = c = config
        self.prompts = select_prompts(load_prompts(c.prompts_file), c.categories, c.per_category, c.limit)
        self.target_dir = resolve(c.target, c)
        self.draft_dir = resolve(c.draft, c) if c.draft else None
        self.methods, self.skipped = choose_methods(list(c.methods), self.draft_dir is not None, c.replay_alphas)
        if c.replay_alpha_spread and not c.replay_alphas:
            raise ValueError("--replay-alpha-spread spreads the replay methods' alpha: give --replay-alpha too")
        self.fixed_ks, self.server_policy = parse_k_policy(c.k_policy, c.num_draft_tokens)
        self.server_only = not self.fixed_ks  # every speculative request lets the coordinator choose
        if not self.server_only:  # other lengths and the coordinator's policy, as methods of their own
            self.methods = [v for m in self.methods for v in (
                policy_variants(m, self.fixed_ks, self.server_policy, c.num_draft_tokens)
                if is_service(m) and proposer_of(m) else [m])]
        tokenizer = load_tokenizer(self.target_dir)
        self.eos = set() if c.ignore_eos else eos_token_ids(tokenizer, self.target_dir)
        self.prompt_ids = {p.question_id: encode_prompt(tokenizer, p.text) for p in self.prompts}
        self.progress = progress
        self.rng = random.Random(c.seed)
        self.collected = Collected()
        self.runners: dict[str, object] = {}
        self.log_dir = Path(c.log_dir or tempfile.mkdtemp(prefix="specdec-bench-"))
        self.references: Path | None = None

    def tick(self, label: str) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(label[:40], refresh=False)
            self.progress.update(1)

    # ---- setup -----------------------------------------------------------------------------

    def proposers(self) -> list[str]:
        return list(dict.fromkeys(proposer_of(m) for m in self.methods if is_service(m) and proposer_of(m)))

    def service_options(self) -> ServiceOptions:
        c = self.config
        in_flight = c.arrival_max_sessions if c.arrival_rates else 0
        return ServiceOptions(self.target_dir, self.draft_dir, c.backend, c.dtype, c.device, c.draft_device or c.device,
                              c.threads, num_slots=max(8, max(c.concurrency) + 4, in_flight + 4),
                              cuda_graphs=c.cuda_graphs,
                              max_context=c.max_context,
                              num_draft_tokens=c.num_draft_tokens, replay_references=self.references,
                              replay_seed=c.replay_seed, replay_alpha_spread=c.replay_alpha_spread,
                              extra_env=dict(c.extra_env), target_args=tuple(c.target_args),
                              draft_args=tuple(c.draft_args),
                              replay_target_alpha=next((float(m[len(REPLAY_TARGET_PREFIX):]) for m in self.methods
                                                        if m.startswith(REPLAY_TARGET_PREFIX)), None),
                              coordinator_args=tuple(c.coordinator_args),
                              plain_calls="plain-calls" in self.methods,
                              branch_coordinators=tuple(dict.fromkeys(
                                  coordinator_of(m) for m in self.methods
                                  if is_service(m) and proposer_of(m) and "@" in coordinator_of(m))))

    def service_methods(self, coordinators: dict[str, str]) -> dict[str, ServiceMethod]:
        c = self.config
        out = {}
        for name in self.methods:
            k = 0 if self.server_only else (fixed_k_of(name, c.num_draft_tokens) or 0)  # 0: the coordinator chooses
            if name in PLAIN_SERVICE_METHODS:
                coordinator = coordinators["baseline-calls" if name == "plain-calls" else "baseline"]
                out[name] = ServiceMethod(name, coordinator, "baseline", 0, c.ignore_eos)
            elif is_service(name):
                # A sequential method's requests leave pipelining to the coordinator (its default,
                # or --coordinator-arg=--pipelining=auto); a pipelined one asks for it.
                out[name] = ServiceMethod(name, coordinators[coordinator_of(name)], None, k, c.ignore_eos,
                                          pipelined=True if is_pipelined(name) else None)
        return out

    def in_process(self) -> EngineTimer:
        import torch

        from specdec.engine.draft import DraftEngine
        from specdec.engine.target import TargetEngine
        from specdec.models.loader import load_model
        from specdec.proposers.copy_guess import CopyRule
        from specdec.proposers.draft_model import DraftModelProposer
        from specdec.proposers.ngram import NgramProposer

        c = self.config
        torch.set_num_threads(c.threads)
        load = lambda d, device, **kw: load_model(d, backend=c.backend, device=device, dtype=c.dtype,  # noqa: E731
                                                  num_slots=2, cuda_graphs=c.cuda_graphs, max_context=c.max_context,
                                                  **kw)
        # The in-process target (references, the replay proposer's greedy tokens, timings) computes as
        # the target service does: with --target-arg=--batch-invariant its bf16 tokens are those.
        step_threads = c.target_step_threads()
        self.collected.notes["target_step_threads"] = None if step_threads is None else {
            "narrow": step_threads.narrow, "wide": step_threads.wide, "wide_from_tokens": step_threads.wide_from_tokens}
        self.inproc_models = {"target": load(self.target_dir, c.device,
                                             batch_invariant=c.batch_invariant_target,
                                             batch_invariant_rows=c.batch_invariant_rows,
                                             step_threads=step_threads)}
        target = TargetEngine(self.inproc_models["target"])
        drafts = {"ngram": DraftEngine(NgramProposer())}
        if self.draft_dir is not None:
            # The draft service's default head ("auto": reduced on CPU), so t_draft is what it pays.
            self.inproc_models["draft"] = load(self.draft_dir, c.draft_device or c.device, head_vocab="auto",
                                                   fused_decode=True)
            drafts["draft-model"] = DraftEngine(DraftModelProposer(self.inproc_models["draft"], top_m=0,
                                                                     copy=CopyRule()))
        plain = InProcessPlain(target, self.eos)
        if "plain-inproc" in self.methods:
            self.runners["plain-inproc"] = plain
        if any(m.startswith(REPLAY_PREFIX) for m in self.methods):
            self.references = self.log_dir / "replay_references.json"
            self.write_references(plain)
        if any(m.startswith("hf-") for m in self.methods):
            from specdec.bench.hf import HFPeers

            pld = c.pld_tokens or c.num_draft_tokens
            peers = HFPeers(self.target_dir, self.draft_dir if "hf-assisted" in self.methods else None, self.eos, pld,
                            c.device, c.dtype)
            self.collected.notes["hf"] = peers.settings()
            self.runners.update({m: peers.method(m) for m in self.methods if m.startswith("hf-")})
        max_verify = max(c.num_draft_tokens, *self.fixed_ks, 8 if self.server_policy else 0) + 1
        return EngineTimer(target, drafts, max_verify, c.max_new_tokens // 2, c.timing_repeats)

    def write_references(self, plain: InProcessPlain) -> None:
        """The target's plain greedy outputs, which the replay proposers replay (proposers/replay.py)."""
        import asyncio

        references = []
        for prompt in self.prompts:
            ids = self.prompt_ids[prompt.question_id]
            result = asyncio.run(plain.run(prompt, ids, self.config.max_new_tokens))
            references.append(ids + result.token_ids)
        self.references.write_text(json.dumps({"references": references}))

    # ---- the whole run ----------------------------------------------------------------------

    def total_steps(self) -> int:
        c = self.config
        service = [m for m in self.methods if is_service(m)]
        batch = c.runs * len(self.prompts) * (len(self.methods) + 1)
        conc = sum(c.concurrency_rounds * c.concurrency_prompts * len(service) for lv in c.concurrency if lv > 1)
        net = (len(c.netem_ms) + 1) * min(c.netem_prompts, len(self.prompts)) * len(service) if c.netem_ms else 0
        arrivals = len(c.arrival_rates) * c.arrival_rounds * c.arrival_requests * len(service)
        return batch + conc + net + arrivals

    def run(self) -> Collected:
        """Synchronous setup (models, references), then the asynchronous phases."""
        import asyncio

        c = self.config
        self.log_dir.mkdir(parents=True, exist_ok=True)
        notes = self.collected.notes
        notes.update(machine=meta.machine(), code=meta.commit(), log_dir=str(self.log_dir),
                     models={"target": meta.model_facts(self.target_dir), "draft": meta.model_facts(self.draft_dir)})
        timer = self.in_process()
        asyncio.run(self._phases(timer))
        models = getattr(self, "inproc_models", {})
        notes["cuda_graphs"] = {role: vars(model.graphs.stats) for role, model in models.items()
                                if getattr(model, "graphs", None) is not None}
        if c.floor:
            from specdec.bench.gpu import bandwidth_floor
            from specdec.bench.timing import summarize

            notes["floor"] = bandwidth_floor(self.target_dir, c.device, summarize(self.collected.times).get("t_step"))
            if self.draft_dir is not None:
                notes["floor_draft"] = bandwidth_floor(self.draft_dir, c.draft_device or c.device)
        notes["machine"]["load_average_end"] = list(os.getloadavg())
        return self.collected

    async def _phases(self, timer: EngineTimer) -> None:
        async with contextlib.AsyncExitStack() as stack:
            deployment = None
            if any(is_service(m) for m in self.methods):
                network = _loopback(self.log_dir)
                deployment = stack.enter_context(Deployment(self.service_options(), network).start(self.proposers()))
                service_runners = self.service_methods(deployment.coordinators)
                stack.push_async_callback(phases.close_all, service_runners)
                self.runners.update(service_runners)
            started = time.perf_counter()
            await phases.warm_up(self, self.runners)
            self.collected.notes["warmup_s"] = time.perf_counter() - started
            await phases.batch1(self, timer)
            if deployment is not None:
                service_runners = {k: v for k, v in self.runners.items() if is_service(k)}
                await phases.concurrency(self, service_runners, deployment.target)
                if self.config.arrival_rates:
                    await arrivals.phase(self, service_runners, deployment.target)
                if self.config.netem_ms:
                    await phases.netem(self, stack, deployment)
                if self.config.dtype not in EXACT_DTYPES:  # near-ties may flip: the target re-scores
                    try:
                        exact = self.config.batch_invariant_target
                        scored = await ties.rescore(self.collected.results, self.prompt_ids, deployment.target.address,
                                                    self.config.dtype, self.config.tie_units, exact=exact)
                        self.collected.notes["batch_invariant_target"] = exact
                        self.collected.notes["rescored_divergences"] = scored
                    except Exception as exc:  # noqa: BLE001 - the run's numbers stand without it
                        log.warning("could not re-score the outputs that part from plain decoding: %r", exc)

    def describe_methods(self) -> dict:
        out = {}
        catalog = {**CATALOG, **{m: "this system distributed, replay proposer: the draft model's forward passes, "
                                    "the target's greedy token with probability alpha" for m in self.methods
                                 if m.startswith(REPLAY_PREFIX)},
                   **{m: f"{CATALOG.get(base_name(m), m)}; the coordinator's own draft-length policy"
                      for m in self.methods if m.endswith(SERVER_POLICY)},
                   **{m: f"{CATALOG.get(base_name(m), m)}; every request drafts k = {fixed_k_of(m, None)}"
                      for m in self.methods if "@k" in m}}
        for name, text in catalog.items():
            status = "run" if name in self.methods else ("skipped" if name in self.skipped else "not requested")
            out[name] = {"description": text, "status": status, **({"why": self.skipped[name]}
                                                                     if name in self.skipped else {})}
        return out


def _loopback(log_dir: Path):
    from specdec.bench.netdelay import LoopbackNetwork

    return LoopbackNetwork(log_dir)
