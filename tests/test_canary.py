"""The canary with real services: targets and drafts as subprocesses on tiny models, coordinators in
process over real gRPC, a real Redis. A good draft (identical to the target) is promoted step by
step by two coordinators of which only one decides, and a restart keeps the state; a random draft
made slow on purpose (--test-delay-ms) is rolled back for latency (the target's forwards cost a flat
10 ms, --test-delay-ms, so that speculation can pay on tiny models); a target with an injected
verification bug (--test-fault wrong-bonus) is caught by the equality check and rolled back.
Operators act through the API and `specdec canary`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import urllib.request

import grpc
import pytest

from coordinator_harness import Code, running_coordinator
from coordinator.canary_policy import CanaryPolicy
from coordinator.canary_settings import CanarySettings
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec import cli
from specdec.rpc import coordinator_pb2 as pb

CONTEXT = 256
TOKENS = 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return {"target": tiny_model_dir(base, "target", seed=0), "random": tiny_model_dir(base, "draft", seed=1)}


@pytest.fixture(scope="module")
def services(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("canary-logs")
    target = ["--model", str(dirs["target"]), "--max-context", str(CONTEXT), "--plaintext"]
    procs = {
        # A flat 10 ms per forward, like a large memory-bound target: the good draft pays (promotion).
        "target": launch("target_service", [*target, "--test-delay-ms", "10"], log_dir=logs),
        "faulty": launch("target_service", [*target, "--test-fault", "wrong-bonus"], log_dir=logs),
        "same": launch("draft_service", ["--model", str(dirs["target"]), "--plaintext"], log_dir=logs),
        "slow": launch("draft_service", ["--model", str(dirs["random"]), "--plaintext", "--test-delay-ms", "40"],
                       log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


def canary_settings(steps, **policy) -> CanarySettings:
    """Small windows and a lenient alpha so that tests decide within seconds."""
    policy = {"step_pause_s": 0.3, "min_samples": 6, "alpha": 0.05, **policy}
    return CanarySettings(CanaryPolicy(steps=steps, **policy), equality_sample=1.0, interval_s=0.25, lease_s=1.5)


@contextlib.asynccontextmanager
async def canary_coordinator(redis_url, dirs, services, *, target="target", draft="same", steps=(30, 60, 100),
                             prefix=None, policy=None, **overrides):
    async with running_coordinator(
        redis_url, dirs["target"], [services[target].address], [services[draft].address], prefix=prefix,
        baseline_targets=(services["target"].address,), canary=canary_settings(steps, **(policy or {})),
        **overrides,
    ) as c:
        c.coordinator.canary.start()
        yield c


async def get_canary(c) -> pb.CoordinatorServiceGetCanaryResponse:
    return await c.stub.GetCanary(pb.CoordinatorServiceGetCanaryRequest(max_decisions=50), timeout=30)


async def drive(coordinators, until, timeout_s: float = 90.0, concurrency: int = 3) -> list[tuple[str, int]]:
    """Unforced new sessions, round robin over the coordinators, until `until()`; -> (session, pool)."""
    deadline, sent, seen = time.monotonic() + timeout_s, 0, []
    while not await until():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {(await get_canary(coordinators[0]))}"
        batch = [coordinators[(sent + j) % len(coordinators)].generate(
            prompt=f"Count to {sent + j}:", raw=True, max_new_tokens=TOKENS, ignore_eos=True)
            for j in range(concurrency)]
        sent += concurrency
        for messages in await asyncio.wait_for(asyncio.gather(*batch), 60):
            seen.append((messages[-1].session_id, messages[-1].stats.pool))
    return seen


def phase_is(c, *phases):
    async def check() -> bool:
        return (await get_canary(c)).state.phase in phases
    return check


def actions(reply) -> list[str]:
    """The decision log, oldest first, as action names."""
    return [pb.CanaryAction.Name(d.action).removeprefix("CANARY_ACTION_").lower() for d in reversed(reply.decisions)]


async def test_a_good_draft_is_promoted_step_by_step_by_one_decider_and_a_restart_keeps_it(
        redis_url, dirs, services):
    prefix = f"canary-good-{time.monotonic_ns()}"
    # Only promotion is under test: a wide TPOT margin and none for TTFT, so that a loaded test
    # machine's noise at alpha 0.05 on a few samples cannot roll it back (CI once saw the first six
    # speculative requests' TTFT at 9x the baseline's: a cold draft, or a wait for a KV slot while the
    # equality replays hold some; TTFT rollback has its own tests). The target's forwards cost a flat 10 ms
    # (--test-delay-ms), as a large model's do, so the identical draft is several times faster than
    # streamed plain decoding (on the bare tiny models speculation's two round trips per cycle lose to
    # the baseline's stream, which has none per token).
    policy = {"regress_margin": 1.0, "ttft_margin": math.inf}
    async with canary_coordinator(redis_url, dirs, services, prefix=prefix, policy=policy) as a, \
            canary_coordinator(redis_url, dirs, services, prefix=prefix, policy=policy) as b:
        seen = await drive([a, b], phase_is(a, pb.CANARY_PHASE_PROMOTED))
        reply = await get_canary(b)
        deciders = {a.coordinator.canary.is_leader, b.coordinator.canary.is_leader}
        # Sticky: a session that started in the baseline pool at 30% continues there at 100%.
        early_baseline = next(s for s, pool in seen[:9] if pool == pb.POOL_BASELINE)
        turn = await asyncio.wait_for(a.generate(session_id=early_baseline, prompt=" more", raw=True,
                                                 max_new_tokens=4), 60)
        late = await drive([a], _once())
        checks = await a.coordinator.canary.store.checks()
    assert actions(reply) == ["start", "step_up", "step_up"]
    steps = [(d.from_weight, d.to_weight) for d in reversed(reply.decisions)]
    assert steps == [(0, 30), (30, 60), (60, 100)]
    automatic = [d for d in reply.decisions if d.action == pb.CANARY_ACTION_STEP_UP]
    assert all(d.cause == "better" and "Mann-Whitney" in d.reason and not d.manual for d in automatic)
    assert deciders == {True, False}  # exactly one of the two holds the lease
    assert {d.decided_by for d in automatic} <= {a.coordinator.canary.replica_id, b.coordinator.canary.replica_id}
    assert reply.state.speculative_weight == 100 and reply.state.baseline_weight == 0
    assert {pool for _, pool in seen} == {pb.POOL_BASELINE, pb.POOL_SPECULATIVE}
    assert turn[-1].stats.pool == pb.POOL_BASELINE
    assert all(pool == pb.POOL_SPECULATIVE for _, pool in late)
    assert checks and {c["result"] for c in checks} == {"equal"}  # lossless: every replay agrees
    # A restarted coordinator (same Redis prefix) continues from the recorded state and log.
    async with canary_coordinator(redis_url, dirs, services, prefix=prefix, policy=policy) as c:
        again = await get_canary(c)
        after_restart = await drive([c], _once())
    assert again.state.phase == pb.CANARY_PHASE_PROMOTED and actions(again) == actions(reply)
    assert all(pool == pb.POOL_SPECULATIVE for _, pool in after_restart)


def _once():
    """An `until` for drive(): exactly one batch."""
    calls = []

    async def until() -> bool:
        calls.append(1)
        return len(calls) > 1
    return until


async def test_a_slow_random_draft_is_rolled_back_and_operators_steer_it(redis_url, dirs, services):
    # The adaptive draft length would switch a costly draft off by itself; here the canary must see it.
    async with canary_coordinator(redis_url, dirs, services, draft="slow", steps=(50, 100),
                                  adaptive_draft_length=False) as c:
        await drive([c], phase_is(c, pb.CANARY_PHASE_ROLLED_BACK))
        rolled = await get_canary(c)
        after = await drive([c], _once())
        address = f"127.0.0.1:{c.host.port}"
        status = json.loads(await _cli(["canary", "status", "--json"], address))
        resumed = await _cli(["canary", "resume", "--reason", "new draft"], address)
        paused = await c.stub.PauseCanary(pb.CoordinatorServicePauseCanaryRequest(reason="hold"), timeout=30)
        promoted = await c.stub.PromoteCanary(pb.CoordinatorServicePromoteCanaryRequest(to_last_step=True),
                                              timeout=30)
        aborted = await _cli(["canary", "abort", "--reason", "incident 42"], address)
        final = await get_canary(c)
    rollback = rolled.decisions[0]
    assert rollback.action == pb.CANARY_ACTION_ROLLBACK and rollback.cause == "latency" and not rollback.manual
    assert "TPOT" in rollback.reason and rollback.to_weight == 0 and rolled.state.reason == rollback.reason
    assert rolled.equality.failed == 0  # slow, not wrong
    assert all(pool == pb.POOL_BASELINE for _, pool in after)
    assert status["state"]["phase"] == "CANARY_PHASE_ROLLED_BACK" and status["state"]["cause"] == "latency"
    assert "phase progressing" in resumed and "speculative 50%" in resumed
    assert paused.state.paused and promoted.state.phase == pb.CANARY_PHASE_PROMOTED
    assert "phase aborted (paused)" in aborted and "speculative 0%" in aborted
    assert actions(final)[-4:] == ["resume", "pause", "promote", "abort"]
    assert final.decisions[0].reason == "manual abort: incident 42" and final.decisions[0].manual


async def _cli(argv: list[str], address: str) -> str:
    """`specdec canary ...` in a thread (its blocking client must not stall this event loop)."""
    import io
    from contextlib import redirect_stdout

    def call() -> str:
        out = io.StringIO()
        with redirect_stdout(out):
            assert cli.main([*argv, "--address", address, "--plaintext"]) == 0
        return out.getvalue()
    return await asyncio.to_thread(call)


async def test_an_injected_verification_bug_is_caught_by_the_equality_check(redis_url, dirs, services):
    async with canary_coordinator(redis_url, dirs, services, target="faulty", steps=(50, 100),
                                  policy={"regress_margin": 1.0, "ttft_margin": math.inf}) as c:  # equality only
        await drive([c], phase_is(c, pb.CANARY_PHASE_ROLLED_BACK))
        reply = await get_canary(c)
        after = await drive([c], _once())
        text = urllib.request.urlopen(f"http://127.0.0.1:{c.host.metrics_port}/metrics", timeout=5).read().decode()
        spans = c.exporter.get_finished_spans()
    rollback = reply.decisions[0]
    assert rollback.action == pb.CANARY_ACTION_ROLLBACK and rollback.cause == "equality"
    assert re.search(r"token \d+: speculative \d+, plain decoding \d+", rollback.reason), rollback.reason
    assert reply.state.phase == pb.CANARY_PHASE_ROLLED_BACK and reply.state.speculative_weight == 0
    assert all(pool == pb.POOL_BASELINE for _, pool in after)
    assert _metric(text, 'specdec_coordinator_canary_equality_checks_total{result="failed"}') >= 1
    assert _metric(text, 'specdec_coordinator_canary_decisions_total{action="rollback",cause="equality"}') == 1
    assert _metric(text, 'specdec_coordinator_canary_weight_percent{pool="speculative"}') == 0
    assert _metric(text, 'specdec_coordinator_canary_leader') == 1
    requests = [s for s in spans if s.name.startswith("text_completion ")]
    assert requests and all(s.attributes["specdec.pool_chosen_by"] == "canary" for s in requests)
    assert {s.attributes["specdec.pool"] for s in requests} == {"speculative", "baseline"}
    checks = [s for s in spans if s.name == "specdec.canary.equality_check"]
    assert "failed" in {s.attributes["specdec.canary.equality"] for s in checks}


def _metric(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in /metrics"
    return float(match.group(1))


async def test_canary_rpcs_need_the_controller(redis_url, dirs, services):
    async with running_coordinator(redis_url, dirs["target"], [services["target"].address]) as c:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await get_canary(c)
    assert refused.value.code() == Code.FAILED_PRECONDITION and "--canary" in refused.value.details()
