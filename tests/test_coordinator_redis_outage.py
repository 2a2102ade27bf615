"""The coordinator while Redis is away: a restart shorter than the retry window only delays a
stream; a longer outage is UNAVAILABLE with a message that says what to do, and nothing is lost:
the cut stream resumes once Redis is back and its output equals plain decoding, and another
session is intact. The client library resumes such a stream by itself. A write that Redis applied
but whose reply was lost with the connection is sent again by the client's retry and recognised as
applied (before, the version fence refused it and the stream ended with ABORTED).

Redis here is a real redis-server of this module's own (append-only file on, as the chart runs it),
stopped with SHUTDOWN SAVE and started again on the same port and directory.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import grpc
import grpc.aio
import pytest
import redis

from coordinator_harness import Reference, read_some, request, running_coordinator, tokens_of
from coordinator_harness import expected as harness_expected
from service_procs import launch, stop_all, wait_all
from specdec.client import AsyncClient, Client
from specdec.rpc import coordinator_pb2 as pb
from specdec.store import find_redis_server
from specdec.store.client import BACKOFF_BASE_S, BACKOFF_CAP_S, connect, retries_within

CONTEXT = 512
PROMPT = "Tell me a story."
TOKENS = 100


class RestartableRedis:
    """A redis-server on a fixed port whose data survives stop() and start()."""

    def __init__(self, directory):
        self.directory = directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.5, retry=None)
        deadline = time.monotonic() + 10
        while True:
            try:
                if probe.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """SHUTDOWN SAVE: every acknowledged write is on disk, every connection dropped."""
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(b"SHUTDOWN SAVE\r\n")
            sock.recv(64)  # the server closes the connection once it has saved
        self.process.wait(timeout=10)


@pytest.fixture
def store_server(tmp_path):
    server = RestartableRedis(tmp_path)
    server.start()
    yield server
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait(timeout=10)


@pytest.fixture(scope="module")
def dirs(models):
    target, random_draft = models
    return {"target": target, "random": random_draft}


@pytest.fixture(scope="module")
def services(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("redis-outage-logs")
    # 20 ms a forward and a draft that is mostly wrong: a stream of 100 tokens takes over a second,
    # so the outage lands while most of it is still to come.
    procs = {
        "target": launch("target_service", ["--model", str(dirs["target"]), "--max-context", str(CONTEXT),
                                            "--test-delay-ms", "20", "--plaintext"], log_dir=logs),
        "draft": launch("draft_service", ["--model", str(dirs["random"]), "--plaintext"], log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def reference(dirs):
    return Reference(dirs["target"], CONTEXT)


def expected(reference: Reference, n: int) -> list[int]:
    return harness_expected(reference, reference.prompt_ids(PROMPT), n)


def test_the_retry_window_counts_backoff_waits():
    assert retries_within(0) == 0
    # waits of 0.1, 0.2, 0.4, then the cap: 0.1 + 0.2 + 0.4 + 0.5 = 1.2 s fits in 1.2, not in 1.1
    assert BACKOFF_BASE_S == 0.05 and BACKOFF_CAP_S == 0.5
    assert retries_within(1.1) == 3 and retries_within(1.2) == 4
    client = connect("redis://127.0.0.1:1/0", timeout_s=1.0, retry_s=1.2)
    retry = client.get_connection_kwargs()["retry"]
    assert retry.get_retries() == 4
    # A timed-out command may be running on the server: only lost connections are retried.
    assert retry._supported_errors == (redis.ConnectionError,)


async def test_a_redis_restart_mid_stream_only_delays_it(store_server, dirs, services, reference):
    async with running_coordinator(store_server.url, dirs["target"], [services["target"].address],
                                   [services["draft"].address], redis_retry_s=10.0) as c:
        call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=TOKENS))
        got = await read_some(call, 3)
        store_server.stop()
        await asyncio.sleep(0.5)
        store_server.start()
        got += [m async for m in call]
        session_id = got[0].session_id
        recorded = await c.tokens(session_id)
    assert tokens_of(got) == expected(reference, TOKENS)
    assert recorded == reference.prompt_ids(PROMPT) + tokens_of(got)


async def test_redis_away_past_the_retry_window_is_unavailable_and_nothing_is_lost(
    store_server, dirs, services, reference
):
    async with running_coordinator(store_server.url, dirs["target"], [services["target"].address],
                                   [services["draft"].address], redis_retry_s=0.5, owner_lease_s=1.0) as c:
        other = await c.generate(prompt="Another session.", max_new_tokens=10)
        other_id, other_tokens = other[0].session_id, await c.tokens(other[0].session_id)

        call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=TOKENS))
        got = await read_some(call, 3)
        store_server.stop()
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            got += [m async for m in call]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.generate(prompt="A new session while Redis is away.", max_new_tokens=5)
        with pytest.raises(grpc.aio.AioRpcError) as unread:
            await c.session(other_id)
        for error in (cut.value, refused.value, unread.value):
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "session store (Redis) did not answer" in error.details()
            assert "ResumeStream" in error.details()

        store_server.start()
        session_id, position = got[-1].session_id, got[-1].position
        rest = [m async for m in c.stub.Generate(request(session_id=session_id, resume=position))]
        assert tokens_of(got + rest) == expected(reference, TOKENS)
        assert await c.tokens(session_id) == reference.prompt_ids(PROMPT) + tokens_of(got + rest)

        # The other session is as it was, and takes its next turn.
        assert await c.tokens(other_id) == other_tokens
        assert (await c.session(other_id)).position == len(other_tokens)
        more = await c.generate(session_id=other_id, prompt=" go on", raw=True, max_new_tokens=5)
        assert more[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        after = await c.tokens(other_id)
        assert after[:len(other_tokens)] == other_tokens and len(after) > len(other_tokens) + len(more)


@pytest.mark.parametrize("flavour", ["asyncio", "blocking"])
async def test_the_client_library_resumes_a_cut_stream_by_itself(store_server, dirs, services, reference, flavour):
    async with running_coordinator(store_server.url, dirs["target"], [services["target"].address],
                                   [services["draft"].address], redis_retry_s=0.3, owner_lease_s=1.0) as c:
        address, options = f"127.0.0.1:{c.host.port}", {"plaintext": True, "resume_backoff_s": 0.5}

        async def outage():
            store_server.stop()
            await asyncio.sleep(1.5)
            store_server.start()

        if flavour == "asyncio":
            chunks, restart = [], None
            async with AsyncClient(address, **options) as client:
                async for chunk in client.stream(PROMPT, max_new_tokens=TOKENS):
                    chunks.append(chunk)
                    if len(chunks) == 3:
                        restart = asyncio.create_task(outage())
            await restart
        else:
            loop = asyncio.get_running_loop()

            def consume():
                got = []
                with Client(address, **options) as client:
                    for chunk in client.stream(PROMPT, max_new_tokens=TOKENS):
                        got.append(chunk)
                        if len(got) == 3:
                            asyncio.run_coroutine_threadsafe(outage(), loop)
                return got

            chunks = await asyncio.to_thread(consume)
        session_ids = {chunk.session_id for chunk in chunks}
        assert len(session_ids) == 1 and chunks[-1].finish_reason in ("length", "eos")
        assert [t for chunk in chunks for t in chunk.token_ids] == expected(reference, TOKENS)
        assert await c.tokens(session_ids.pop()) == reference.prompt_ids(PROMPT) + expected(reference, TOKENS)


async def test_the_client_library_gives_up_past_its_attempts(store_server, dirs, services):
    async with running_coordinator(store_server.url, dirs["target"], [services["target"].address],
                                   [services["draft"].address], redis_retry_s=0.3) as c:
        async with AsyncClient(f"127.0.0.1:{c.host.port}", plaintext=True, resume_attempts=2,
                               resume_backoff_s=0.1) as client:
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                async for chunk in client.stream(PROMPT, max_new_tokens=TOKENS):
                    chunks.append(chunk)
                    if len(chunks) == 3:
                        store_server.stop()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and len(chunks) >= 3


class ReplyDroppingProxy:
    """A TCP proxy to Redis that, once armed, lets the next script call (EVALSHA) through, swallows
    its reply and cuts that connection: Redis applied the write, the client never heard so."""

    def __init__(self, port: int):
        self.port, self.armed, self.dropped = port, False, 0
        self.server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _serve(self, client_reader, client_writer) -> None:
        redis_reader, redis_writer = await asyncio.open_connection("127.0.0.1", self.port)
        script_sent = asyncio.Event()

        async def upstream():
            while data := await client_reader.read(65536):
                if self.armed and b"EVALSHA" in data.upper():
                    self.armed = False
                    script_sent.set()
                redis_writer.write(data)
                await redis_writer.drain()

        async def downstream():
            while data := await redis_reader.read(65536):
                if script_sent.is_set():  # the script's reply: lose it with the connection
                    self.dropped += 1
                    break
                client_writer.write(data)
                await client_writer.drain()

        up = asyncio.ensure_future(upstream())
        try:
            await downstream()
        finally:
            up.cancel()
            for writer in (client_writer, redis_writer):
                writer.close()

    async def close(self) -> None:
        self.server.close()


async def test_a_write_whose_reply_was_lost_is_not_applied_twice_and_the_stream_goes_on(
    store_server, dirs, services, reference
):
    proxy = ReplyDroppingProxy(store_server.port)
    await proxy.start()
    try:
        async with running_coordinator(proxy.url, dirs["target"], [services["target"].address],
                                       [services["draft"].address]) as c:
            call = c.stub.Generate(request(prompt=PROMPT, max_new_tokens=TOKENS))
            got = await read_some(call, 3)
            proxy.armed = True  # the turn's next append (or heartbeat) is applied, its reply lost
            got += [m async for m in call]
            recorded = await c.tokens(got[0].session_id)
    finally:
        await proxy.close()
    assert proxy.dropped == 1
    assert got[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
    assert tokens_of(got) == expected(reference, TOKENS)
    assert recorded == reference.prompt_ids(PROMPT) + tokens_of(got)
