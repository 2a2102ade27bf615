"""Prometheus metric families, one class per service, each registered on an explicit registry.

Each service's main builds `registry = new_registry()`, `metrics = TargetMetrics(registry)`, passes
`metrics` down to the code that observes and `registry` to serve(), which exposes it on
--metrics-port. Nothing is registered on prometheus_client's global REGISTRY, so tests and several
services in one process never collide.

Labels: `pool` is "speculative" or "baseline"; `proposer` names the draft source ("draft_model",
"ngram", "none" for plain decoding); `step` is the kind of forward pass. Keep label values bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    gc_collector,
    platform_collector,
    process_collector,
    start_http_server,
)

NAMESPACE = "specdec"

# Time to first token includes prefill of the prompt: tens of ms (short prompt, GPU) to tens of s.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
# Time per output token: speculation aims below the target's own step time (~10-50 ms on GPU).
TPOT_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)
# One forward pass (prefill, verify, decode, propose) on CPU or GPU.
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Per-cycle overhead (time outside the model forwards): sub-millisecond to a slow network's tens of ms.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                    0.1, 0.25)
OVERHEAD_FRACTION_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

POOL_LABELS = ("pool", "proposer")


def new_registry(process: bool = True) -> CollectorRegistry:
    """A registry with the usual process / platform / GC collectors (the global registry has them)."""
    registry = CollectorRegistry()
    if process:
        process_collector.ProcessCollector(registry=registry)
        platform_collector.PlatformCollector(registry=registry)
        gc_collector.GCCollector(registry=registry)
    return registry


class CoordinatorMetrics:
    """Request latency and speculation statistics, labelled by pool and proposer."""

    def __init__(self, registry: CollectorRegistry):
        common = {"namespace": NAMESPACE, "subsystem": "coordinator", "registry": registry}
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds",
            "Request start to the first streamed token.",
            POOL_LABELS,
            buckets=TTFT_BUCKETS,
            **common,
        )
        self.time_per_output_token = Histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            POOL_LABELS,
            buckets=TPOT_BUCKETS,
            **common,
        )
        self.e2e_latency = Histogram(
            "e2e_request_latency_seconds",
            "Request start to its last streamed message.",
            POOL_LABELS,
            buckets=E2E_BUCKETS,
            **common,
        )
        self.requests = Counter(
            "requests",
            "Finished Generate requests by gRPC status code name.",
            (*POOL_LABELS, "status"),
            **common,
        )
        self.output_tokens = Counter("output_tokens", "Tokens streamed to clients.", POOL_LABELS, **common)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens prefilled.", POOL_LABELS, **common)
        self.draft_tokens = Counter(
            "draft_tokens", "Draft tokens sent for verification.", POOL_LABELS, **common
        )
        self.accepted_tokens = Counter(
            "accepted_tokens", "Draft tokens the target accepted.", POOL_LABELS, **common
        )
        self.accepted_by_position = Counter(
            "accepted_tokens_by_position",
            "Accepted draft tokens by their index in the draft (0-based).",
            (*POOL_LABELS, "position"),
            **common,
        )
        self.cycles = Counter("cycles", "Speculative cycles (propose + verify).", POOL_LABELS, **common)
        self.fallbacks = Counter(
            "fallbacks",
            "Switches from speculation to plain target decoding, by reason.",
            (*POOL_LABELS, "reason"),
            **common,
        )
        self.draft_feeds = Counter(
            "draft_feeds",
            "Plainly decoded tokens handed to the draft in the background while speculation was switched off "
            "(feeds, each up to --feed-draft-every tokens), so that the next probe does not prefill them first.",
            POOL_LABELS, **common,
        )
        self.pipeline_hits = Counter(
            "pipeline_hits", "Pipelined drafts confirmed by the verify outcome.", POOL_LABELS, **common
        )
        self.pipeline_branch_hits = Counter(
            "pipeline_branch_hits",
            "Pipelined hits by the branch that hit: main, second_guess or rejected_last (multi-outcome drafting).",
            (*POOL_LABELS, "branch"), **common,
        )
        self.pipeline_misses = Counter(
            "pipeline_misses", "Pipelined drafts discarded by the verify outcome.", POOL_LABELS, **common
        )
        self.cycle_overhead = Histogram(
            "cycle_overhead_seconds",
            "Per cycle: wall time outside the draft and target model forwards (RPC, batching, "
            "conversions, coordination) as the services report their model time.",
            POOL_LABELS,
            buckets=OVERHEAD_BUCKETS,
            **common,
        )
        self.cycle_overhead_fraction = Histogram(
            "cycle_overhead_fraction",
            "Per cycle: the overhead as a fraction of the cycle's wall time.",
            POOL_LABELS,
            buckets=OVERHEAD_FRACTION_BUCKETS,
            **common,
        )
        self.active_requests = Gauge(
            "active_requests", "Generate streams in progress.", POOL_LABELS, **common
        )

    def observe_cycle(self, pool: str, proposer: str, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft: drafted, accepted, and accepted per draft position."""
        self.cycles.labels(pool, proposer).inc()
        self.draft_tokens.labels(pool, proposer).inc(num_draft_tokens)
        self.accepted_tokens.labels(pool, proposer).inc(num_accepted)
        for index in range(num_accepted):  # accepted tokens are always a prefix of the draft
            self.accepted_by_position.labels(pool, proposer, str(index)).inc()


class _CacheMetrics:
    """KV cache and session gauges shared by the target and draft services."""

    def __init__(self, registry: CollectorRegistry, subsystem: str):
        common = {"namespace": NAMESPACE, "subsystem": subsystem, "registry": registry}
        self.kv_cache_slots_used = Gauge("kv_cache_slots_used", "KV cache token slots in use.", **common)
        self.kv_cache_slots_total = Gauge("kv_cache_slots_total", "KV cache token slots allocated.", **common)
        self.sessions = Gauge("sessions", "Sessions with a cache on this replica.", **common)
        self.sessions_in_turn = Gauge(
            "sessions_in_turn", "Sessions in the middle of a turn (a call in flight or in the last second, "
            "and for a target no EndTurn since): the load, where `sessions` also counts the caches kept "
            "between turns until evicted or expired.", **common
        )
        self.evictions = Counter("evictions", "Idle sessions evicted under memory pressure.", **common)


class TargetMetrics(_CacheMetrics):
    """Forward passes of the target model; `step` is prefill, verify, decode or mixed (a batched
    forward with verify and decode rows)."""

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry, "target")
        common = {"namespace": NAMESPACE, "subsystem": "target", "registry": registry}
        self.step_latency = Histogram(
            "step_seconds", "Duration of one batched forward pass.", ("step",), buckets=STEP_BUCKETS, **common
        )
        self.batch_size = Histogram(
            "batch_size",
            "Sessions (rows) in one batched forward pass.",
            ("step",),
            buckets=BATCH_BUCKETS,
            **common,
        )
        self.tokens = Counter("tokens", "Tokens processed by forward passes.", ("step",), **common)
        self.batch_rows = Gauge("batch_rows", "Sessions (rows) in the latest batched forward pass.", **common)
        self.sessions_waiting_for_slot = Gauge(
            "sessions_waiting_for_slot", "New sessions waiting in line for a KV cache slot (StartSession's "
            "slot_wait_ms): a replica that keeps some waiting needs more slots or more replicas.", **common
        )
        self.trimmed_draft_tokens = Counter(
            "trimmed_draft_tokens", "Drafted tokens left unverified because they did not pay under load.", **common
        )
        self.draft_refusals = Counter(
            "draft_refusals", "Sessions told to decode plainly for a while because their cycles, a draft "
            "service's round trip included, committed fewer tokens per second than plain decoding would.", **common
        )
        self.stream_plain_steps = Counter(
            "stream_plain_steps", "Steps of DecodeStreams that draft on this target (prompt lookup or the hosted "
            "draft) which verified no drafted token, by why: the goodput trimming's limit (trimmer), the "
            "stream's own draft-length rule (length_rule), both, no room left in the budget, nothing found "
            "to draft (no_draft), a draft that stopped before its first token, or a failed draft.", ("why",), **common
        )
        self.joint_explorations = Counter(
            "joint_explorations", "Steps in which plain rows that could draft together were told to try one "
            "drafted token each after a plain stretch, so that the step-cost fits learn what drafting costs.", **common
        )


class DraftMetrics(_CacheMetrics):
    """Proposals of the draft service; `step` is prefill or propose."""

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry, "draft")
        common = {"namespace": NAMESPACE, "subsystem": "draft", "registry": registry}
        self.step_latency = Histogram(
            "step_seconds",
            "Duration of one prefill or propose call.",
            ("proposer", "step"),
            buckets=STEP_BUCKETS,
            **common,
        )
        self.proposed_tokens = Counter("proposed_tokens", "Draft tokens proposed.", ("proposer",), **common)
        self.batch_size = Histogram(
            "batch_size", "Propose calls drafted together in one batched step.", ("proposer",),
            buckets=BATCH_BUCKETS, **common,
        )


@dataclass
class MetricsServer:
    """The running /metrics endpoint; `port` is the bound one (useful with port 0)."""

    httpd: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serve `registry` in the Prometheus text format on http://addr:port/metrics (daemon thread)."""
    httpd, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(httpd, thread)
