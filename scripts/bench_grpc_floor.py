"""The floor under a call's overhead: a bare grpc.aio unary round trip between two processes.

    python scripts/bench_grpc_floor.py [--rounds 4] [--calls 50] [--step-ms 37]

A server process answers grpc.health.v1 Check with no interceptors and no work ('' below), after a
hop to a worker thread and back ('thread'), or after 37 ms in a worker thread ('sleep': about a
plain step of the default target on one CPU thread, so that both processes go idle between request
and response as they do around a model forward; --step-ms sets it, e.g. 7 for an 8B step on a GPU).
Clients: grpc.aio and sync, over TCP on localhost and over a Unix domain socket, in alternating
rounds; and 'stream': the same exchanges as messages of one open bidirectional stream (write one,
read its answer), which pays no per-call setup (HTTP/2 stream, metadata, status). Printed per case:
the round trip minus the server's own handler time (sent back in the trailing metadata, or in the
streamed answer), p50 and mean, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

STEP_S = 0.037
HANDLER_KEY = "handler-s"
PING_PONG = "/floor.Floor/PingPong"  # bidirectional, raw bytes: the case's name in, handler seconds out


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self):
        self.pool = ThreadPoolExecutor(1)

    async def Check(self, request, context):
        started = time.perf_counter()
        await self.work(request.service)
        context.set_trailing_metadata(((HANDLER_KEY, str(time.perf_counter() - started)),))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def work(self, case: str) -> None:
        loop = asyncio.get_running_loop()
        if case == "thread":
            await loop.run_in_executor(self.pool, lambda: None)
        elif case == "sleep":
            await loop.run_in_executor(self.pool, time.sleep, STEP_S)

    async def ping_pong(self, requests, context):
        async for case in requests:
            started = time.perf_counter()
            await self.work(case.decode())
            yield str(time.perf_counter() - started).encode()


async def serve(addresses: list[str]) -> None:
    server = grpc.aio.server()
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor.Floor", {"PingPong": grpc.stream_stream_rpc_method_handler(health.ping_pong)}),))
    for address in addresses:
        server.add_insecure_port(address)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def aio_calls(address: str, case: str, calls: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub, request, out = health_pb2_grpc.HealthStub(channel), health_pb2.HealthCheckRequest(service=case), []
        await stub.Check(request, timeout=10)  # connect
        for _ in range(calls):
            started = time.perf_counter()
            call = stub.Check(request, timeout=10)
            await call
            elapsed = time.perf_counter() - started
            out.append(elapsed - float(dict(await call.trailing_metadata())[HANDLER_KEY]))
        return out


async def stream_calls(address: str, case: str, calls: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        call, out = channel.stream_stream(PING_PONG)(timeout=60), []
        await call.write(case.encode())  # connect
        await call.read()
        for _ in range(calls):
            started = time.perf_counter()
            await call.write(case.encode())
            handler_s = float(await call.read())
            out.append(time.perf_counter() - started - handler_s)
        await call.done_writing()
        return out


def sync_calls(address: str, case: str, calls: int) -> list[float]:
    with grpc.insecure_channel(address) as channel:
        stub, request, out = health_pb2_grpc.HealthStub(channel), health_pb2.HealthCheckRequest(service=case), []
        stub.Check(request, timeout=10)
        for _ in range(calls):
            started = time.perf_counter()
            _, call = stub.Check.with_call(request, timeout=10)
            elapsed = time.perf_counter() - started
            out.append(elapsed - float(dict(call.trailing_metadata())[HANDLER_KEY]))
        return out


def main() -> None:
    global STEP_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=50, help="calls per case and round")
    parser.add_argument("--step-ms", type=float, default=STEP_S * 1e3, help="the 'sleep' case's work")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)  # the server process's
    args = parser.parse_args()
    STEP_S = args.step_ms / 1e3
    if args.serve:
        return asyncio.run(serve(args.serve))
    sock = os.path.join(tempfile.mkdtemp(prefix="grpc-floor-"), "s.sock")
    addresses = {"tcp": "127.0.0.1:0", "uds": f"unix:{sock}"}
    with socket_port() as port:
        addresses["tcp"] = f"127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, __file__, "--step-ms", str(args.step_ms), "--serve",
                               *addresses.values()], stdout=subprocess.PIPE)
    load = os.getloadavg()[0]
    rows: dict[tuple[str, str, str], list[float]] = {}
    try:
        server.stdout.readline()
        for round_ in range(args.rounds):
            for transport, address in (addresses.items() if round_ % 2 == 0 else list(addresses.items())[::-1]):
                for case in ("", "thread", "sleep"):
                    rows.setdefault(("aio", transport, case), []).extend(
                        asyncio.run(aio_calls(address, case, args.calls)))
                    rows.setdefault(("sync", transport, case), []).extend(sync_calls(address, case, args.calls))
                    rows.setdefault(("stream", transport, case), []).extend(
                        asyncio.run(stream_calls(address, case, args.calls)))
    finally:
        server.terminate()
        server.wait()
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; round trip minus handler:")
    for (client, transport, case), values in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        print(f"{case or 'bare':>6} {transport} {client:>6}: p50 {statistics.median(values) * 1e3:.3f} ms, "
              f"mean {statistics.fmean(values) * 1e3:.3f} ms")


class socket_port:
    """A free TCP port on localhost (closed again before the server binds it)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return self._sock.getsockname()[1]

    def __exit__(self, *exc_info) -> None:
        self._sock.close()


if __name__ == "__main__":
    main()
