"""The coordinator's flags and its one frozen settings object (built in main, passed down).

Precedence is flag > SPECDEC_* environment variable > default, as for every service.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.server.settings import (
    ClientSettings,
    ConfigError,
    ServerSettings,
    add_client_arguments,
    add_server_arguments,
    client_settings_from_args,
    server_settings_from_args,
)

from coordinator.canary_settings import CanarySettings, add_canary_arguments, canary_settings_from_args
from coordinator.requests import Limits, Pool

LOCAL_NGRAM = "local:ngram"  # --draft: prompt lookup inside the coordinator (coordinator/local_draft.py)
# --draft: drafts made inside the target's decode stream (specdec.engine.inner_draft), by prompt lookup
# or by the draft model the target hosts (target service --inner-draft)
INNER_DRAFTS = {"target:ngram": "ngram", "target:model": "model"}


def is_local(endpoint: str) -> bool:
    return endpoint == LOCAL_NGRAM


SERVICE = "coordinator"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9101
# --pipelining auto: a session pipelines while at least this share of its blocks is accepted whole. On
# shared CPU cores a miss's speculative draft slows the verify (BENCHMARKS.md, "Pipelined drafting":
# 3-4% whole blocks cost 10-25%, 65% gained); a guess, not a tuned optimum. auto is the default since
# it measured as good as sequential on the CPU pair and within 5% of always-on on two GPUs at alpha 0.9
# (BENCHMARKS.md, "Pipelining by default").
AUTO_MIN_FULL_ACCEPT = 0.2
DRAFT_TIMEOUT_S = 5.0  # a slow draft only costs speed: give up on it soon and decode plainly


@dataclass(frozen=True)
class CoordinatorSettings:
    server: ServerSettings
    target_client: ClientSettings
    draft_client: ClientSettings
    tokenizer: str  # the target model's tokenizer: registry name, hub id or directory
    redis_url: str
    targets: tuple[str, ...] = ()  # static endpoints; empty: discover them in Redis
    drafts: tuple[str, ...] = ()
    baseline_targets: tuple[str, ...] = ()  # static baseline pool; empty: --targets serve it too
    redis_prefix: str = "specdec"
    default_pool: Pool = Pool.SPECULATIVE
    num_draft_tokens: int = 4
    adaptive_draft_length: bool = True
    # An adaptive length starts from what earlier turns on its route measured (shared_estimates.py).
    adaptive_warm_start: bool = True
    # The longest draft the adaptive policy may choose. 8: a verify of 8 drafted tokens is the longest
    # the target's CUDA graphs cover (specdec/models/cuda_graphs.py); longer ones run eagerly.
    max_adaptive_draft_tokens: int = 8
    retry_draft_after: int = 8
    # Draft the next block while the target verifies (requests may override). The flag's default is
    # auto (True with the gate below); built in code, settings are sequential unless told.
    pipelining: bool = False
    pipelining_min_full_accept: float = 0.0  # --pipelining auto: only while blocks are accepted whole this often
    # --pipelining auto: only while a session's speculative drafts save more than they slow the verify
    # beside them (specdec.generation.pipeline_price: a draft on the target's device slows it)
    pipelining_priced: bool = False
    pipeline_branches: int = 1  # branches per speculative draft (specdec.engine.alternatives)
    plain_streaming: bool = True  # --plain-decoding stream: a run of plain steps is one DecodeStream
    feed_draft_every: int = 0  # --feed-draft-every (specdec.generation.draft_feed); 0: off
    limits: Limits = Limits()
    session_ttl_s: float = 3600.0
    owner_lease_s: float = 10.0
    failover_timeout_s: float = 30.0
    redis_timeout_s: float = 5.0  # deadline of every Redis command
    redis_retry_s: float = 5.0  # how long a command reconnects to a restarting Redis (specdec.store.client)
    model_name: str = ""  # gen_ai.request.model; default: the tokenizer's name
    ready_file: Path | None = None
    canary: CanarySettings | None = None  # None: no canary controller (--canary)

    @property
    def inner_draft(self) -> str:
        """--draft target:ngram / target:model: speculative sessions draft inside the target's decode
        stream ("ngram" or "model"; no draft replica is used, nor discovered); "" otherwise."""
        return next((INNER_DRAFTS[d] for d in self.drafts if d in INNER_DRAFTS), "")

    @property
    def draft_replicas(self) -> tuple[str, ...]:
        return tuple(d for d in self.drafts if d not in INNER_DRAFTS)

    def __post_init__(self) -> None:
        if self.inner_draft and len(self.drafts) > 1:
            raise ConfigError(f"--draft {' / '.join(INNER_DRAFTS)} drafts inside the target and takes no other "
                              f"--draft, got {', '.join(self.drafts)}")
        if not self.redis_url:
            raise ConfigError("--redis-url is required: sessions live in Redis (the launcher passes an embedded one)")
        if self.max_adaptive_draft_tokens < 1:
            raise ConfigError(f"--max-adaptive-draft-tokens must be >= 1, got {self.max_adaptive_draft_tokens}")
        if not 1 <= self.num_draft_tokens <= self.limits.max_draft_tokens:
            raise ConfigError(f"--num-draft-tokens must be in [1, --max-draft-tokens], got {self.num_draft_tokens}")
        if not 1 <= self.limits.default_max_new_tokens <= self.limits.max_new_tokens_limit:
            raise ConfigError("--max-new-tokens must be in [1, --max-new-tokens-limit]")
        if not 0.0 <= self.pipelining_min_full_accept <= 1.0:
            raise ConfigError(f"--pipelining-min-full-accept must be in [0, 1], got {self.pipelining_min_full_accept}")
        if not 1 <= self.pipeline_branches <= 3:
            raise ConfigError(f"--pipeline-branches must be 1, 2 or 3, got {self.pipeline_branches}")
        if self.feed_draft_every < 0:
            raise ConfigError(f"--feed-draft-every must be >= 0 (0: off), got {self.feed_draft_every}")
        if self.retry_draft_after < 0:
            raise ConfigError(f"--retry-draft-after must be >= 0, got {self.retry_draft_after}")
        for name in ("session_ttl_s", "owner_lease_s", "failover_timeout_s", "redis_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name[:-2].replace('_', '-')} must be > 0 seconds")
        if self.redis_retry_s < 0:
            raise ConfigError(f"--redis-retry must be >= 0 seconds (0: no retries), got {self.redis_retry_s}")
        for endpoint in (*self.targets, *(d for d in self.draft_replicas if not is_local(d)), *self.baseline_targets):
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"an endpoint is host:port (a draft may also be {LOCAL_NGRAM}, "
                                  f"{' or '.join(INNER_DRAFTS)}), got {endpoint!r}")


def add_arguments(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    env = environ.get
    g = parser.add_argument_group("coordinator")
    g.add_argument("--tokenizer", default=env("SPECDEC_TOKENIZER", "smollm2-135m-instruct"),
                   help="the target model's tokenizer: registry name, hub id or directory (only the tokenizer "
                        "is loaded) (default: %(default)s)")
    g.add_argument("--target", action="append", default=[], metavar="HOST:PORT",
                   help="a target replica (repeatable); none: discover replicas in Redis")
    g.add_argument("--draft", action="append", default=[], metavar="HOST:PORT",
                   help="a draft replica (repeatable); local:ngram for prompt lookup inside the coordinator "
                        "(no draft service; one round trip per speculative cycle); target:ngram for prompt lookup "
                        "inside the target's decode stream, target:model for the draft model the target hosts "
                        "(its --inner-draft) (no draft service, no round trip per cycle; alone); "
                        "none: discover replicas in Redis")
    g.add_argument("--baseline-target", action="append", default=[], metavar="HOST:PORT",
                   help="a target replica of the baseline pool (repeatable); none: --target replicas serve "
                        "both pools (or the registry's baseline pool)")
    g.add_argument("--redis-url", default=env("SPECDEC_REDIS_URL", ""),
                   help="Redis for session state and replica discovery (redis:// or rediss://, password in "
                        "the URL); required")
    g.add_argument("--redis-prefix", default=env("SPECDEC_REDIS_PREFIX", "specdec"))
    g.add_argument("--redis-timeout", type=float, default=5.0, help="deadline in seconds of every Redis command")
    g.add_argument("--redis-retry", type=float, default=5.0,
                   help="seconds a Redis command keeps reconnecting after a lost or refused connection (a "
                        "restart, a failover): a shorter outage only delays streams; past it, UNAVAILABLE")
    g.add_argument("--default-pool", choices=[p.value for p in Pool], default=env("SPECDEC_DEFAULT_POOL", "speculative"),
                   help="pool of a new session whose request names none")
    g.add_argument("--num-draft-tokens", type=int, default=4,
                   help="draft length when a request names none (the starting length when adaptive)")
    g.add_argument("--draft-length", choices=["adaptive", "fixed"], default="adaptive",
                   help="adaptive: per session, from measured acceptance and costs (requests naming "
                        "num_draft_tokens get that fixed length); fixed: --num-draft-tokens")
    g.add_argument("--max-draft-tokens", type=int, default=16, help="largest draft length a request may ask for")
    g.add_argument("--pipelining", choices=["on", "off", "auto"], default="auto",
                   help="on: the draft drafts the next block while the target verifies the current one "
                        "(hides the draft's time on a hit; lossless either way); off: sequential cycles; "
                        "auto (default): on per session while its recent share of wholly accepted blocks "
                        "(which bounds the hit rate) is at least --pipelining-min-full-accept and its "
                        "speculative drafts save more than they slow the verify beside them (a draft on "
                        "the target's GPU does). A request's "
                        "speculation.pipelined overrides it (true: on)")
    g.add_argument("--pipelining-min-full-accept", type=float, default=AUTO_MIN_FULL_ACCEPT,
                   help="the share of wholly accepted blocks below which --pipelining auto drafts sequentially")
    g.add_argument("--pipeline-branches", type=int, choices=[1, 2, 3], default=1,
                   help="pipelined cycles: branches the draft drafts per speculative block, for that many "
                        "verify outcomes: 1 all accepted with the draft's own bonus guess; 2 also a second "
                        "bonus guess; 3 also all but the last token accepted (docs/PIPELINING.md)")
    g.add_argument("--adaptive-warm-start", choices=["on", "off"], default="on",
                   help="on: a turn's adaptive draft length starts from what earlier turns to the same target and "
                        "draft measured (costs, acceptance per position, confidence calibration), adapting from "
                        "its first cycle; off: every turn starts at --num-draft-tokens and learns from nothing")
    g.add_argument("--max-adaptive-draft-tokens", type=int, default=8,
                   help="the longest draft the adaptive draft length may choose (capped by --max-draft-tokens); 8 "
                        "keeps every verify inside the target's CUDA graphs, which cover 8 drafted tokens")
    g.add_argument("--plain-decoding", choices=["stream", "calls"], default="stream",
                   help="stream: a run of plain decoding steps (the baseline pool, speculation switched off or "
                        "failed) is one streamed call, the target starting each step while the last token "
                        "travels; calls: one Decode call per token (targets older than DecodeStream are "
                        "detected and get calls anyway)")
    g.add_argument("--feed-draft-every", type=int, default=0,
                   help="while a session's adaptive draft length has switched speculation off, hand the draft "
                        "the plainly decoded tokens in the background every this many tokens (e.g. 8), so that the "
                        "probe ending the plain run does not prefill them first (0, the default: off; "
                        "docs/DEPLOYMENT.md)")
    g.add_argument("--retry-draft-after", type=int, default=8,
                   help="plain decoding steps after a draft failure before speculation is tried again")
    g.add_argument("--max-new-tokens", type=int, default=256, help="a turn's budget when the request sets none")
    g.add_argument("--max-new-tokens-limit", type=int, default=4096, help="largest budget a request may ask for")
    g.add_argument("--session-ttl", type=float, default=3600.0, help="seconds an unused session is kept in Redis")
    g.add_argument("--owner-lease", type=float, default=10.0,
                   help="seconds without a write after which a generating turn counts as abandoned")
    g.add_argument("--failover-timeout", type=float, default=30.0,
                   help="seconds a call may spend rebuilding a session on other target replicas")
    g.add_argument("--model-name", default=env("SPECDEC_MODEL_NAME", ""),
                   help="gen_ai.request.model on spans (default: --tokenizer)")
    g.add_argument("--ready-file", type=Path, default=None,
                   help="write the bound ports as JSON here once serving (launchers and tests)")
    add_server_arguments(parser, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT, environ=environ)
    add_client_arguments(parser, "target", environ=environ)
    add_client_arguments(parser, "draft", environ=environ)
    if "SPECDEC_DRAFT_TIMEOUT_S" not in environ:
        parser.set_defaults(draft_timeout=DRAFT_TIMEOUT_S)
    add_canary_arguments(parser, environ=environ)


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    server = server_settings_from_args(args, service=SERVICE)
    return CoordinatorSettings(
        server=server,
        target_client=client_settings_from_args(args, "target", max_message_bytes=server.max_message_bytes),
        draft_client=client_settings_from_args(args, "draft", max_message_bytes=server.max_message_bytes),
        tokenizer=args.tokenizer, redis_url=args.redis_url, targets=tuple(args.target), drafts=tuple(args.draft),
        redis_prefix=args.redis_prefix, default_pool=Pool(args.default_pool),
        num_draft_tokens=args.num_draft_tokens, adaptive_draft_length=args.draft_length == "adaptive",
        adaptive_warm_start=args.adaptive_warm_start == "on",
        max_adaptive_draft_tokens=args.max_adaptive_draft_tokens,
        retry_draft_after=args.retry_draft_after, pipelining=args.pipelining != "off",
        pipelining_min_full_accept=args.pipelining_min_full_accept if args.pipelining == "auto" else 0.0,
        pipelining_priced=args.pipelining == "auto",
        pipeline_branches=args.pipeline_branches, plain_streaming=args.plain_decoding == "stream",
        feed_draft_every=args.feed_draft_every,
        limits=Limits(args.max_new_tokens, args.max_new_tokens_limit, args.max_draft_tokens),
        session_ttl_s=args.session_ttl, owner_lease_s=args.owner_lease, failover_timeout_s=args.failover_timeout,
        redis_timeout_s=args.redis_timeout, redis_retry_s=args.redis_retry,
        model_name=args.model_name, ready_file=args.ready_file,
        baseline_targets=tuple(args.baseline_target), canary=canary_settings_from_args(args),
    )
