"""The coordinator when things break: a draft with another vocabulary, replicas found in Redis,
kill -9 of the coordinator, of the draft service and of one of two target replicas, each in the
middle of a stream, and a target that hangs in the middle of a plain run. The output never changes.
Misconfigurations and dead ends say what to do: TLS to a plaintext target, a lone target that died.

All processes start together, once: two targets, a draft to kill, a random draft, an n-gram draft
with a different tokenizer, and a coordinator subprocess to kill. The kill tests come last.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import time
import urllib.request

import grpc
import grpc.aio
import pytest
import redis.asyncio as redis

from coordinator_harness import Reference, read_some, request, running_coordinator, tokens_of
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec.models.tokenizer import load_tokenizer
from specdec.rpc import coordinator_pb2 as pb
from specdec.rpc import coordinator_pb2_grpc
from specdec.server.settings import ClientSettings
from specdec.store import Replica, ReplicaRegistry
from specdec.testing.certs import make_test_certificates
from specdec.testing.tiny_models import TINY_EOS_ID

CONTEXT = 512
PROMPT = "Tell me a story."
PREFIX = f"killed{time.monotonic_ns()}"  # the coordinator subprocess' Redis key prefix


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    target = tiny_model_dir(base, "target", seed=0)
    other = tmp_path_factory.mktemp("other-tokenizer")
    tokenizer = load_tokenizer(target)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})  # one token more: another vocab
    tokenizer.save_pretrained(other)
    shutil.copy(target / "config.json", other / "config.json")
    return {"target": target, "random": tiny_model_dir(base, "draft", seed=1), "other": other}


@pytest.fixture(scope="module")
def services(dirs, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("failover-logs")
    plain = ["--plaintext"]
    # 5 ms a forward: a tiny target otherwise streams a whole 80-token run into the transport before a
    # test's SIGSTOP lands (seen under CI load), and there is then nothing left to fail over.
    target = ["--model", str(dirs["target"]), "--max-context", str(CONTEXT), "--test-delay-ms", "5", *plain]
    procs = {
        "t1": launch("target_service", target, log_dir=logs),
        "t2": launch("target_service", target, log_dir=logs),
        "victim_draft": launch("draft_service", ["--model", str(dirs["target"]), *plain], log_dir=logs),
        "random": launch("draft_service", ["--model", str(dirs["random"]), *plain], log_dir=logs),
        "other_vocab": launch("draft_service", ["--proposer", "ngram", "--tokenizer", str(dirs["other"]), *plain],
                              log_dir=logs),
    }
    wait_all(*procs.values())
    procs["coordinator"] = launch("coordinator", [
        "--tokenizer", str(dirs["target"]), "--target", procs["t2"].address, "--draft", procs["random"].address,
        "--redis-url", redis_url, "--redis-prefix", PREFIX, "--owner-lease", "1", "--target-plaintext",
        "--draft-plaintext", *plain], log_dir=logs)
    wait_all(procs["coordinator"])
    yield procs
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def reference(dirs):
    return Reference(dirs["target"], CONTEXT)


def expected(reference: Reference, n: int, prompt: str = PROMPT) -> list[int]:
    out = reference.continuation(reference.prompt_ids(prompt), n)
    return out[: out.index(TINY_EOS_ID) + 1] if TINY_EOS_ID in out else out


async def test_a_draft_with_another_vocabulary_is_refused_and_requests_decode_plainly(
    redis_url, dirs, services, reference, caplog
):
    caplog.set_level(logging.ERROR, logger="coordinator.routing")
    bad, good = services["other_vocab"].address, services["random"].address
    async with running_coordinator(redis_url, dirs["target"], [services["t1"].address], [bad]) as c:
        messages = await c.generate(prompt=PROMPT, max_new_tokens=16)
    assert tokens_of(messages) == expected(reference, 16)
    stats = messages[-1].stats
    assert stats.pool == pb.POOL_SPECULATIVE and stats.cycles == 0 and stats.fallbacks == 0 and not stats.proposer
    assert any("refusing draft" in r.getMessage() and bad in r.getMessage() for r in caplog.records)
    async with running_coordinator(redis_url, dirs["target"], [services["t1"].address], [bad, good]) as c:
        messages = await c.generate(prompt=PROMPT, max_new_tokens=16)
        assert (await c.session(messages[-1].session_id)).draft_replica == good
    assert tokens_of(messages) == expected(reference, 16) and messages[-1].stats.cycles > 0


async def test_replicas_are_discovered_in_redis(redis_url, dirs, services, reference):
    prefix = f"registry{time.monotonic_ns()}"
    client = redis.Redis.from_url(redis_url)
    registry = ReplicaRegistry(client, prefix, lease_seconds=60)
    target, draft = services["t2"].address, services["random"].address
    await registry.register(Replica("t2", "target", "speculative", target, capacity=8))
    await registry.register(Replica("d", "draft", "speculative", draft, capacity=8))
    try:
        async with running_coordinator(redis_url, dirs["target"], prefix=prefix) as c:
            spec = await c.generate(prompt=PROMPT, max_new_tokens=16)
            info = await c.session(spec[-1].session_id)
            baseline = await c.generate(prompt=PROMPT, max_new_tokens=16, pool=pb.POOL_BASELINE)
    finally:
        await client.aclose()
    assert (info.target_replica, info.draft_replica) == (target, draft)
    assert tokens_of(spec) == tokens_of(baseline) == expected(reference, 16)
    assert spec[-1].stats.cycles > 0 and baseline[-1].stats.pool == pb.POOL_BASELINE


async def test_tls_to_a_plaintext_target_says_which_flag_to_set(redis_url, dirs, services, tmp_path):
    certs = make_test_certificates(tmp_path)
    client = ClientSettings(tls_ca=certs.ca_cert, timeout_s=2.0)
    async with running_coordinator(redis_url, dirs["target"], [services["t1"].address], target_client=client,
                                   failover_timeout_s=0.5) as c:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.generate(prompt=PROMPT, max_new_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "server that speaks plaintext" in refused.value.details() and "--target-plaintext" in refused.value.details()


async def test_kill_9_of_the_coordinator_mid_stream_and_another_resumes_the_session(
    redis_url, dirs, services, reference
):
    proc = services["coordinator"]
    async with grpc.aio.insecure_channel(proc.address) as channel:
        call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
            request(prompt=PROMPT, max_new_tokens=80))
        got = await read_some(call, 3)
        proc.kill()
        with pytest.raises(grpc.aio.AioRpcError):
            async for m in call:
                got.append(m)
    session_id = got[0].session_id
    async with running_coordinator(redis_url, dirs["target"], [services["t2"].address], [services["random"].address],
                                   prefix=PREFIX, owner_lease_s=1.0) as c:
        await asyncio.sleep(1.2)  # the dead coordinator's lease on the turn runs out
        assert (await c.session(session_id)).state == pb.SESSION_STATE_INTERRUPTED
        rest = await c.generate(session_id=session_id, resume=got[-1].position)
    assert tokens_of(got) + tokens_of(rest) == expected(reference, 80)


async def test_kill_9_of_the_draft_mid_stream_changes_nothing_but_speed(redis_url, dirs, services, reference):
    victim = services["victim_draft"]
    async with running_coordinator(redis_url, dirs["target"], [services["t1"].address], [victim.address],
                                   retry_draft_after=2) as c:
        call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=80))
        got = await read_some(call, 3)
        victim.signal(signal.SIGSTOP)  # the next Propose hangs: the kill lands mid-stream for sure
        await asyncio.sleep(0.2)
        victim.kill()
        got += [m async for m in call]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{c.host.metrics_port}/metrics", timeout=5).read().decode()
    assert tokens_of(got) == expected(reference, 80)
    assert got[-1].stats.fallbacks >= 1 and got[-1].stats.decode_steps > 0 and got[-1].stats.cycles > 0
    assert 'specdec_coordinator_fallbacks_total{pool="speculative",proposer="draft-model",reason="unavailable"}' \
        in metrics


async def test_a_target_that_hangs_mid_way_through_a_plain_run_loses_the_session_to_another(
    redis_url, dirs, services, reference
):
    """Plain decoding is one streamed call per run: a target that stops answering in the middle of it
    is left after the client's per-message deadline, and the run resumes on the other replica from
    the last token read."""
    targets = [services["t1"].address, services["t2"].address]
    async with running_coordinator(redis_url, dirs["target"], targets, [],
                                   target_client=ClientSettings(plaintext=True, timeout_s=1.5)) as c:
        call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=80, pool=pb.POOL_BASELINE))
        got = await read_some(call, 3)
        session_id = got[0].session_id
        before = (await c.session(session_id)).target_replica
        victim = next(p for p in (services["t1"], services["t2"]) if p.address == before)
        victim.signal(signal.SIGSTOP)
        try:
            got += [m async for m in call]
        finally:
            victim.signal(signal.SIGCONT)
        after = (await c.session(session_id)).target_replica
    assert tokens_of(got) == expected(reference, 80)
    assert got[-1].stats.pool == pb.POOL_BASELINE and got[-1].stats.cycles == 0
    assert after in targets and after != before


async def test_kill_9_of_one_of_two_targets_mid_stream_moves_the_session(redis_url, dirs, services, reference):
    targets = [services["t1"].address, services["t2"].address]
    async with running_coordinator(redis_url, dirs["target"], targets, [services["random"].address]) as c:
        call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=80))
        got = await read_some(call, 3)
        session_id = got[0].session_id
        before = (await c.session(session_id)).target_replica
        victim = next(p for p in (services["t1"], services["t2"]) if p.address == before)
        victim.signal(signal.SIGSTOP)  # the next Verify hangs: the kill lands mid-stream for sure
        await asyncio.sleep(0.2)
        victim.kill()
        got += [m async for m in call]
        after = (await c.session(session_id)).target_replica
    assert tokens_of(got) == expected(reference, 80)
    assert got[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
    assert after in targets and after != before


async def test_a_lone_target_that_dies_ends_the_stream_unavailable_saying_what_to_do(
        redis_url, dirs, reference, tmp_path):
    lone = launch("target_service", ["--model", str(dirs["target"]), "--max-context", str(CONTEXT),
                                     "--test-delay-ms", "5", "--plaintext"], log_dir=tmp_path)
    wait_all(lone)
    try:
        async with running_coordinator(redis_url, dirs["target"], [lone.address], failover_timeout_s=1.0) as c:
            call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=80))
            got = await read_some(call, 3)
            lone.kill()
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                async for message in call:
                    got.append(message)
    finally:
        stop_all(lone)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no target replica answered" in cut.value.details() and "within 1 s" in cut.value.details()
    assert "ResumeStream" in cut.value.details()
    assert tokens_of(got) == expected(reference, 80)[:len(tokens_of(got))]

