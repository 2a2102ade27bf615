"""The methods a benchmark compares, and one RequestResult per request they serve.

Every method generates greedily from the same prompt ids (the target's chat template) with the same
budget. Timing starts when the request is sent and ends when its last token arrives, so a method
pays whatever it really costs (RPC, Redis, host work) except model loading and service startup.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from specdec.bench.prompts import Prompt

# name -> what it is. The order is the order of tables and plots.
CATALOG: dict[str, str] = {
    "plain": "target alone through the services: the coordinator's baseline pool (gRPC, Redis)",
    "plain-calls": "plain, one Decode call per token (--plain-decoding calls; the default streams each run)",
    "plain-again": "plain again, in a rotation slot of its own: an A/A control (how far identical pools differ)",
    "plain-inproc": "target alone, the same engine in the benchmark's process (no RPC)",
    "hf-greedy": "Hugging Face generate, greedy, transformers eager, the run's device and dtype (the peers' baseline)",
    "hf-assisted": "Hugging Face generate(assistant_model=draft), the same pair in one process",
    "hf-pld": "Hugging Face generate(prompt_lookup_num_tokens=k)",
    "specdec-ngram": "this system distributed, n-gram proposer, sequential cycles",
    "specdec-draft": "this system distributed, draft model, sequential cycles",
    "specdec-ngram-local": "n-gram proposer inside the coordinator (--draft local:ngram): no draft service, one round trip a cycle",
    "specdec-ngram-target": "n-gram proposer inside the target's decode stream (--draft target:ngram): no round trip a cycle",
    "specdec-draft-target": "draft model hosted by the target (--inner-draft, --draft target:model): no round trip a cycle",
    "specdec-ngram-pipelined": "this system distributed, n-gram proposer, pipelined cycles",
    "specdec-draft-pipelined": "this system distributed, draft model, pipelined cycles",
    "specdec-ngram-pipelined3": "pipelined, n-gram, 3 branches per speculative draft (--pipeline-branches 3)",
    "specdec-draft-pipelined2": "pipelined, draft model, 2 branches: own and second bonus guess",
    "specdec-draft-pipelined3": "pipelined, draft model, 3 branches: also all but the last token accepted",
}
NOT_BUILT: dict[str, str] = {}
# run when named
OPT_IN = ("plain-calls", "plain-again", "specdec-ngram-local", "specdec-ngram-target", "specdec-draft-target")
NEEDS_DRAFT = ("hf-assisted", "specdec-draft", "specdec-draft-target", "specdec-draft-pipelined",
               "specdec-draft-pipelined2", "specdec-draft-pipelined3")
PLAIN_SERVICE_METHODS = ("plain", "plain-calls", "plain-again")
SERVICE_METHODS = (*PLAIN_SERVICE_METHODS, "specdec-ngram", "specdec-draft", "specdec-ngram-local", "specdec-ngram-target",
                   "specdec-draft-target", "specdec-ngram-pipelined",
                   "specdec-draft-pipelined",
                   "specdec-ngram-pipelined3", "specdec-draft-pipelined2", "specdec-draft-pipelined3")
SPECULATIVE = ("hf-assisted", "hf-pld", *SERVICE_METHODS[len(PLAIN_SERVICE_METHODS):])
PIPELINED_SUFFIX = "-pipelined"  # the same coordinator as the sequential method; requests ask to pipeline
# + a number of branches > 1: a coordinator of its own with --pipeline-branches N
_PIPELINED = re.compile(r"-pipelined(?P<branches>[23])?$")
LOCAL_PROPOSER = "ngram-local"  # a coordinator with --draft local:ngram and no draft service
TARGET_PROPOSER = "ngram-target"  # a coordinator with --draft target:ngram and no draft service
TARGET_MODEL_PROPOSER = "draft-model-target"  # --draft target:model: the target hosts the draft (--inner-draft)
IN_PROCESS_PROPOSERS = {LOCAL_PROPOSER: "local:ngram", TARGET_PROPOSER: "target:ngram",
                        TARGET_MODEL_PROPOSER: "target:model"}  # -> the coordinator's --draft
REPLAY_PREFIX = "specdec-replay-"  # + alpha: the draft model's passes, the target's token with probability alpha
# + alpha: the same, drafted inside the target (bench/replay_target.py, --draft target:model); one alpha a run
REPLAY_TARGET_PREFIX = "specdec-replay-target-"


def replay_method(alpha: float) -> str:
    return f"{REPLAY_PREFIX}{alpha:g}"


SERVER_POLICY = "@server"  # suffix: the same method with the coordinator's own draft-length policy
FIXED_K_PREFIX = "@k"  # suffix @k<N>: the same method with every request naming draft length N


def base_name(name: str) -> str:
    return name.split("@", 1)[0]


def fixed_k_of(name: str, default: int | None) -> int | None:
    """The draft length a method's requests name: N for ...@k<N>, None for ...@server (the
    coordinator chooses), else `default`."""
    if name.endswith(SERVER_POLICY):
        return None
    _, _, suffix = name.partition(FIXED_K_PREFIX)
    return int(suffix) if suffix else default


def parse_k_policy(text: str, default_k: int) -> tuple[list[int], bool]:
    """--k-policy: (fixed draft lengths to run, whether to run the coordinator's policy too).

    "fixed" = [default_k]; "server"; "fixed,server"; "fixed:1,2,4,server" (bare numbers after a
    fixed: list are more fixed lengths)."""
    ks: list[int] = []
    server = False
    for item in (part.strip() for part in text.split(",")):
        if item == "server":
            server = True
        elif item == "fixed":
            ks.append(default_k)
        elif item.startswith("fixed:") or item.isdigit():
            value = item.removeprefix("fixed:")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--k-policy: a fixed draft length is an integer >= 1, got {item!r}")
            ks.append(int(value))
        else:
            raise ValueError(f"--k-policy: items are fixed, fixed:<k>, <k> or server; got {item!r} in {text!r}")
    if not ks and not server:
        raise ValueError(f"--k-policy names no policy: {text!r}")
    return list(dict.fromkeys(ks)), server


def policy_variants(method: str, ks: list[int], server: bool, default_k: int) -> list[str]:
    """The names a speculative service method runs under: itself at default_k (when fixed lengths
    are run), ...@k<N> for each other fixed length, ...@server for the coordinator's policy."""
    names = [method if k == default_k else f"{method}{FIXED_K_PREFIX}{k}" for k in ks]
    if ks and default_k not in ks:
        names.insert(0, method)
    return names + ([method + SERVER_POLICY] if server else [])


def is_service(name: str) -> bool:
    return base_name(name) in SERVICE_METHODS or name.startswith(REPLAY_PREFIX)


def is_pipelined(name: str) -> bool:
    return _PIPELINED.search(base_name(name)) is not None


def without_pipelining(name: str) -> str:
    return _PIPELINED.sub("", name)


def pipeline_branches_of(name: str) -> int:
    match = _PIPELINED.search(base_name(name))
    return int(match["branches"]) if match and match["branches"] else 1


def coordinator_of(name: str) -> str | None:
    """The coordinator a service method talks to: its proposer's, or a variant with more branches."""
    proposer, branches = proposer_of(name), pipeline_branches_of(name)
    return proposer if proposer is None or branches == 1 else f"{proposer}@branches{branches}"


def is_speculative(name: str) -> bool:
    return base_name(name) in SPECULATIVE or name.startswith(REPLAY_PREFIX)


def proposer_of(name: str) -> str | None:
    """The proposer a service method's coordinator drafts with (draft service name)."""
    name = without_pipelining(base_name(name))
    if name.startswith(REPLAY_TARGET_PREFIX):
        return TARGET_MODEL_PROPOSER
    if name.startswith(REPLAY_PREFIX):
        return "replay-" + name[len(REPLAY_PREFIX):]
    return {"specdec-ngram": "ngram", "specdec-draft": "draft-model", "specdec-ngram-local": LOCAL_PROPOSER,
            "specdec-ngram-target": TARGET_PROPOSER, "specdec-draft-target": TARGET_MODEL_PROPOSER}.get(name)
# The reference each method's speedup and losslessness are measured against.
REFERENCE = {"hf-assisted": "hf-greedy", "hf-pld": "hf-greedy"}
DEFAULT_REFERENCE = "plain"


@dataclass
class RequestResult:
    method: str
    question_id: str
    category: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float  # request sent -> first generated token received
    e2e_s: float  # request sent -> last token received
    start_s: float = 0.0  # perf_counter at send (concurrency: wall-clock span of a round)
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)  # SpeculationStats fields as the coordinator reports them
    phase: str = "batch1"  # "batch1" | "concurrency" | "netem" | "arrival"
    concurrency: int = 1
    delay_ms: float | None = None  # network delay of a netem phase
    round: int = 0
    order: int = 0  # place of this method in its prompt's rotation
    rate: float | None = None  # requests per second of an arrival phase (arrivals.py)
    client_wait_s: float = 0.0  # arrival phase: time queued in the client for a free session (in ttft, e2e)
    # bf16 / fp16: where the output parts from plain decoding's at batch 1, the target's logit gap
    # between the two tokens at the first divergence (ties.py); None: not re-scored
    logit_gap: float | None = None
    tie_threshold: float | None = None  # the gap within which that divergence is a numerical tie (its dtype's)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token of this request: (e2e - ttft) / (n - 1), not between chunks."""
        n = self.num_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        out["num_tokens"] = self.num_tokens
        out["tpot_s"] = self.tpot_s
        return out


class Method(Protocol):
    name: str

    async def run(self, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int) -> RequestResult: ...


class ServiceMethod:
    """A request to a coordinator, streamed through the client library, as a backend sends it."""

    def __init__(self, name: str, address: str, pool: str | None, num_draft_tokens: int, ignore_eos: bool = False,
                 pipelined: bool | None = None):
        from specdec.client import AsyncClient

        self.name, self.address, self.pool, self.num_draft_tokens = name, address, pool, num_draft_tokens
        self.ignore_eos = ignore_eos
        self.pipelined = pipelined  # None: the coordinator's default (the baseline pool)
        self.client = AsyncClient(address, plaintext=True, resume_attempts=0)  # a failure counts, not hidden

    async def run(self, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int) -> RequestResult:
        tokens: list[int] = []
        last = None
        first_at = None
        started = time.perf_counter()
        async for chunk in self.client.stream(prompt.text, max_new_tokens=max_new_tokens, temperature=0.0,
                                              pool=self.pool, num_draft_tokens=self.num_draft_tokens,
                                              ignore_eos=self.ignore_eos, pipelined=self.pipelined):
            if chunk.token_ids and first_at is None:
                first_at = time.perf_counter()
            tokens += chunk.token_ids
            last = chunk
        ended = time.perf_counter()
        await self.client.end_session(last.session_id)  # untimed: frees the caches and the record
        return RequestResult(
            self.name, prompt.question_id, prompt.category, tokens,
            int(last.usage.get("prompt_tokens", 0)), (first_at or ended) - started, ended - started,
            started, last.finish_reason, dict(last.stats),
        )

    async def close(self) -> None:
        await self.client.close()


class InProcessPlain:
    """Plain decoding on a TargetEngine in this process: the engine's cost without any RPC."""

    name = "plain-inproc"

    def __init__(self, engine, eos_token_ids):
        self.engine, self.eos_token_ids = engine, eos_token_ids

    async def run(self, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int) -> RequestResult:
        from specdec.engine.local import LocalTarget
        from specdec.generation.loop import generate
        from specdec.generation.stopping import StopChecker
        from specdec.sampling.params import SamplingParams

        first_at: list[float] = []

        async def emit(new_tokens: list[int]) -> None:
            if new_tokens and not first_at:
                first_at.append(time.perf_counter())

        session_id = uuid.uuid4().hex
        stop = StopChecker(max_new_tokens, self.eos_token_ids)
        started = time.perf_counter()
        try:
            result = await generate(LocalTarget(self.engine), None, session_id, prompt_ids, SamplingParams(),
                                    stop, emit)
        finally:
            self.engine.end_session(session_id)
        ended = time.perf_counter()
        return RequestResult(self.name, prompt.question_id, prompt.category, list(result.token_ids),
                             len(prompt_ids), (first_at[0] if first_at else ended) - started, ended - started,
                             started, result.finish_reason.value, result.stats.to_dict())

    async def close(self) -> None:
        pass


def choose_methods(requested: list[str] | None, have_draft: bool,
                   replay_alphas: tuple[float, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """(methods to run, {method: why it is not run}). Unknown names raise ValueError. Replay methods
    (one per alpha) come after the catalog's."""
    names = list(requested) if requested else [n for n in CATALOG if n not in OPT_IN]
    replays = [replay_method(a) for a in replay_alphas]
    if "specdec-replay-target" in names:  # the target hosts one replay draft: one alpha
        if len(replay_alphas) != 1:
            raise ValueError("specdec-replay-target replays one alpha (the target hosts one draft): give one --replay-alpha")
        replays.append(f"{REPLAY_TARGET_PREFIX}{replay_alphas[0]:g}")
        names.remove("specdec-replay-target")
    twins = [n for n in names if re.fullmatch(r"specdec-replay-pipelined[23]?", n)]
    replays += [r + twin.removeprefix("specdec-replay") for twin in twins for r in replays
                if not r.startswith(REPLAY_TARGET_PREFIX)]  # pipelined twins
    names = [n for n in names if n != "specdec-replay" and n not in twins]
    unknown = [n for n in names if n not in CATALOG]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {', '.join(CATALOG)}")
    skipped: dict[str, str] = {}
    run = []
    for name in CATALOG:  # catalog order
        if name not in names:
            continue
        if name in NOT_BUILT:
            skipped[name] = NOT_BUILT[name]
        elif name in NEEDS_DRAFT and not have_draft:
            skipped[name] = "no draft model: the packaged default draft is not present and --draft names none"
        else:
            run.append(name)
    if replays and not have_draft:
        raise ValueError("replay methods need a draft model (--draft)")
    return run + replays, skipped
