"""Metric families per service on explicit registries, scraped over HTTP from a running ServiceHost."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import REGISTRY

from specdec.observability.metrics import (
    CoordinatorMetrics,
    DraftMetrics,
    TargetMetrics,
    new_registry,
    start_metrics_server,
)
from specdec.server.bootstrap import ServiceHost
from specdec.server.settings import ServerSettings


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


async def test_metrics_endpoint_serves_the_service_registry():
    registry = new_registry()
    metrics = CoordinatorMetrics(registry)
    labels = ("speculative", "draft_model")
    metrics.time_to_first_token.labels(*labels).observe(0.12)
    metrics.time_per_output_token.labels(*labels).observe(0.018)
    metrics.e2e_latency.labels(*labels).observe(3.4)
    metrics.observe_cycle(*labels, num_draft_tokens=4, num_accepted=2)
    metrics.fallbacks.labels(*labels, "draft_unavailable").inc()
    metrics.pipeline_hits.labels(*labels).inc()
    metrics.draft_feeds.labels(*labels).inc()
    metrics.requests.labels(*labels, "OK").inc()

    settings = ServerSettings(port=0, metrics_port=0, plaintext=True, grace_period_s=0.0)
    host = ServiceHost(settings, lambda server: [], registry=registry)
    await host.start()
    text = await asyncio.to_thread(scrape, host.metrics_port)
    await host.shutdown()

    for name in (
        "specdec_coordinator_time_to_first_token_seconds_bucket",
        "specdec_coordinator_time_per_output_token_seconds_bucket",
        "specdec_coordinator_e2e_request_latency_seconds_bucket",
        "specdec_coordinator_draft_tokens_total",
        "specdec_coordinator_accepted_tokens_total",
        "specdec_coordinator_cycles_total",
        "specdec_coordinator_fallbacks_total",
        "specdec_coordinator_pipeline_hits_total",
        "specdec_coordinator_draft_feeds_total",
        "specdec_coordinator_requests_total",
        "process_cpu_seconds_total",
    ):
        assert name in text, name
    assert 'position="1"' in text and 'position="2"' not in text  # only accepted positions count
    pool = {"pool": "speculative", "proposer": "draft_model"}
    by_position = "specdec_coordinator_accepted_tokens_by_position_total"
    assert registry.get_sample_value(by_position, {**pool, "position": "1"}) == 1.0
    assert registry.get_sample_value("specdec_coordinator_draft_tokens_total", pool) == 4.0


def test_target_and_draft_families_and_no_global_registration():
    registry = new_registry(process=False)
    target, draft = TargetMetrics(registry), DraftMetrics(registry)
    target.step_latency.labels("verify").observe(0.02)
    target.batch_size.labels("decode").observe(8)
    target.tokens.labels("prefill").inc(128)
    target.kv_cache_slots_used.set(300)
    target.kv_cache_slots_total.set(4096)
    target.sessions.set(3)
    target.evictions.inc()
    draft.step_latency.labels("ngram", "propose").observe(0.001)
    draft.proposed_tokens.labels("ngram").inc(5)
    draft.kv_cache_slots_used.set(10)

    server = start_metrics_server(registry, 0, addr="127.0.0.1")
    try:
        text = scrape(server.port)
    finally:
        server.close()
    for name in (
        "specdec_target_step_seconds_bucket",
        "specdec_target_batch_size_bucket",
        "specdec_target_tokens_total",
        "specdec_target_kv_cache_slots_used",
        "specdec_target_kv_cache_slots_total",
        "specdec_target_sessions",
        "specdec_target_evictions_total",
        "specdec_draft_step_seconds_bucket",
        "specdec_draft_proposed_tokens_total",
        "specdec_draft_kv_cache_slots_used",
    ):
        assert name in text, name
    assert REGISTRY.get_sample_value("specdec_target_sessions") is None
    # A second service in the same process gets its own registry without name clashes.
    TargetMetrics(new_registry(process=False))
