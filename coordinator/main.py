"""`python -m coordinator` / `specdec serve coordinator`: serve CoordinatorService.

main() parses flags into one frozen CoordinatorSettings, loads the target's tokenizer (not its
weights), connects to Redis and serves until SIGTERM. Shutdown is graceful: health turns
NOT_SERVING, running turns get half the grace period to finish, then stop at a cycle boundary
and their streams end with UNAVAILABLE, resumable by session id.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass

from specdec.server import service

from coordinator.settings import CoordinatorSettings, add_arguments, settings_from_args

log = logging.getLogger(__name__)

HELP = "serve the coordinator (CoordinatorService: Generate, Cancel, GetSession, EndSession)"
DESCRIPTION = (
    "Serve the public generation API: runs speculative decoding against draft and target replicas, "
    "keeps session state in Redis, streams tokens. Health, reflection and Prometheus /metrics included."
)


@dataclass
class Coordinator:
    """The assembled service: what the servicer needs, and what to close at shutdown."""

    sessions: object  # SessionManager
    router: object  # Router
    redis: object  # redis.asyncio.Redis
    servicer: object  # CoordinatorServicer
    canary: object = None  # CanaryController with --canary

    async def aclose(self) -> None:
        if self.canary is not None:
            await self.canary.aclose()
        await self.router.aclose()
        await self.redis.aclose()


def build(settings: CoordinatorSettings, *, tracer_provider=None, registry=None, prompts=None) -> Coordinator:
    """Everything but the gRPC server (tests host the servicer themselves)."""
    from opentelemetry import trace

    from coordinator.local_draft import LocalNgramDraft
    from coordinator.prompts import PromptEncoder
    from coordinator.routing import Router
    from coordinator.servicer import CoordinatorServicer, status_name
    from coordinator.sessions import SessionConfig, SessionManager
    from coordinator.settings import is_local
    from coordinator.telemetry import Telemetry
    from coordinator.turn import TurnSettings
    from draft_service.client import connect as connect_draft
    from specdec.observability.metrics import CoordinatorMetrics, new_registry
    from specdec.observability.spans import CycleSpanSampler
    from specdec.store import ReplicaRegistry, SessionStore
    from specdec.store import connect as connect_redis
    from target_service.client import connect as connect_target

    client = connect_redis(settings.redis_url, timeout_s=settings.redis_timeout_s, retry_s=settings.redis_retry_s)
    store = SessionStore(client, settings.session_ttl_s, prefix=settings.redis_prefix)
    # Flags name the replicas of a kind; without them, replicas of that kind are found in Redis.
    discovery = ReplicaRegistry(client, settings.redis_prefix)

    def draft_client(endpoint: str):
        if is_local(endpoint):  # --draft local:ngram: prompt lookup in this process
            return LocalNgramDraft(settings.session_ttl_s, settings.limits.max_draft_tokens)
        return connect_draft(endpoint, settings.draft_client, tracer_provider=tracer_provider)

    router = Router(
        lambda e: connect_target(e, settings.target_client, tracer_provider=tracer_provider),
        draft_client,
        targets=settings.targets, drafts=settings.draft_replicas, baseline_targets=settings.baseline_targets,
        registry=discovery, use_drafts=not settings.inner_draft,
    )
    prompts = prompts or PromptEncoder.load(settings.tokenizer)
    provider = tracer_provider or trace.get_tracer_provider()
    registry = registry if registry is not None else new_registry(process=False)
    telemetry = Telemetry(
        tracer=provider.get_tracer("coordinator"),
        metrics=CoordinatorMetrics(registry),
        cycle_sampler=CycleSpanSampler(every=settings.server.tracing.cycle_span_every),
        model=settings.model_name or settings.tokenizer,
    )
    config = SessionConfig(
        default_pool=settings.default_pool, owner_lease_s=settings.owner_lease_s,
        turn=TurnSettings(settings.num_draft_tokens, settings.retry_draft_after, settings.owner_lease_s / 3,
                          settings.failover_timeout_s, settings.adaptive_draft_length,
                          min(settings.max_adaptive_draft_tokens, settings.limits.max_draft_tokens),
                          settings.pipelining,
                          settings.pipelining_min_full_accept, pipelining_priced=settings.pipelining_priced,
                          pipeline_branches=settings.pipeline_branches,
                          plain_streaming=settings.plain_streaming, inner_draft=settings.inner_draft,
                          adaptive_warm_start=settings.adaptive_warm_start,
                          feed_draft_every=settings.feed_draft_every),
    )
    sessions = SessionManager(store, router, prompts, telemetry, settings.limits, config, status_name)
    canary = None
    if settings.canary is not None:
        from coordinator.canary import build_canary

        canary = build_canary(settings.canary, client, settings.redis_prefix, sessions, router, telemetry, registry)
    return Coordinator(sessions, router, client, CoordinatorServicer(sessions, canary), canary)


async def serve_coordinator(settings: CoordinatorSettings, tracer_provider=None) -> None:
    """Serve until SIGTERM / SIGINT; returns after the graceful shutdown."""
    from specdec.observability.metrics import new_registry
    from specdec.rpc import coordinator_pb2_grpc
    from specdec.server.bootstrap import ServiceHost

    from coordinator.servicer import ERROR_CODES, SERVICE_NAME

    registry = new_registry()
    coordinator = build(settings, tracer_provider=tracer_provider, registry=registry)

    def register(server):
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(coordinator.servicer, server)
        return [SERVICE_NAME]

    host = ServiceHost(settings.server, register, on_shutdown=[coordinator.aclose], tracer_provider=tracer_provider,
                       registry=registry, error_codes=ERROR_CODES)
    await host.start()
    if settings.ready_file is not None:
        service.write_ready_file(settings.ready_file, host)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(check_static_replicas(coordinator, settings))]
    if coordinator.canary is not None:
        coordinator.canary.start()  # stopped by coordinator.aclose

    def on_signal(signum: int) -> None:
        if host.stopping:  # a second signal: cancel what still runs
            loop.create_task(host.stop_now())
            return
        log.info("%s: graceful shutdown", signal.Signals(signum).name)
        # The drain must start before the server stops taking calls: ServiceHost's own hooks run after.
        tasks.append(loop.create_task(coordinator.sessions.drain(settings.server.grace_period_s)))
        host.begin_shutdown()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await host.wait()
    finally:
        for task in tasks:
            task.cancel()


async def check_static_replicas(coordinator: Coordinator, settings: CoordinatorSettings) -> None:
    """At startup, say early (in the log) which configured drafts the targets refuse to pair with."""
    from coordinator.routing import TARGET

    for target in settings.targets:
        try:
            fingerprint = (await coordinator.router.describe(TARGET, target)).vocab_fingerprint
        except Exception as exc:  # noqa: BLE001 - not up yet: checked again at first use
            log.info("target %s not reachable yet: %s", target, exc)
            continue
        for draft in settings.drafts:
            await coordinator.router.draft_compatible(draft, fingerprint)
        return


def run(settings: CoordinatorSettings) -> int:
    return service.run_traced(settings.server, lambda provider: serve_coordinator(settings, provider))


def build_parser() -> argparse.ArgumentParser:
    return service.build_parser("python -m coordinator", DESCRIPTION, add_arguments, allow_abbrev=False)


def run_from_args(args: argparse.Namespace) -> int:
    return service.run_from_args(args, "coordinator", settings_from_args, run)


def main(argv: list[str] | None = None) -> int:
    return service.main(build_parser(), run_from_args, argv)
