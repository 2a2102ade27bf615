"""Overhead of one target service call (round trip minus model time), two builds side by side.

    git archive <commit> | tar -x -C /tmp/before && (cd /tmp/before && python -m specdec.protogen)
    python scripts/bench_call_overhead.py --before /tmp/before [--model smollm2-135m-instruct] \
        [--rounds 8] [--calls 25]

Starts one target service from each source tree (the other build's code, this worktree's code) on
the same model, and one client process per build with that build's client code (the coordinator's
side: stub, interceptors, channel options), and sends one-token Decode calls in alternating blocks
(A B B A A B ...), so that a neighbour's load hits both alike. Per call: the round trip as the
client measured it and the ServerTiming the service reported (the older build must have it too).
Overhead = round trip - model time, split into transport (round trip - the service's handler: gRPC
on both ends, client interceptors, process wake-ups), queue (before the step: the hop to the model
thread) and service work (the rest of the handler: checks, conversions, the hop back). Prints
medians and means per build.

Without --before it measures this worktree alone; --target-arg passes a flag to the target service,
so the same calls can be measured on a GPU host (docs/BENCHMARKS.md, "Round 20": a unary call cost
~2.2-2.6 ms above its handler there, against 0.4 ms per streamed message):

    python scripts/bench_call_overhead.py --model random:llama3-8b --target-arg=--device=cuda:0 \
        --target-arg=--dtype=bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PROMPT = list(range(10, 130))  # 120 tokens: a context like the benchmark's
PARTS = ("call", "model", "queue", "handler")


def start(root: Path, model: Path, log_dir: Path, extra: list[str]) -> tuple[subprocess.Popen, int]:
    ready = log_dir / f"{root.name}.ready.json"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "OTEL_TRACES_EXPORTER": "none"}
    with open(log_dir / f"{root.name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(model), "--plaintext",
                                 "--max-context", "512", "--port", "0", "--metrics-port", "0",
                                 "--ready-file", str(ready), *extra], cwd=root, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (ready.exists() and ready.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the target service from {root} did not start; see {log_dir}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())["port"]


def client_worker(port: int) -> None:
    """One build's client (imported from the tree on PYTHONPATH): on each line of stdin naming a
    number of calls, that many one-token Decodes from the same context; one JSON line of
    [call, model, queue, handler] seconds per call back. Its tracer provider is the coordinator's
    (setup_tracing; OTEL_TRACES_EXPORTER=none: no exporter)."""
    from specdec.engine.cycle_cost import measure_cycle
    from specdec.observability.tracing import setup_tracing
    from specdec.sampling.params import SamplingParams
    from specdec.server.settings import ClientSettings
    from target_service.client import connect

    async def serve_blocks() -> None:
        client = connect(f"127.0.0.1:{port}", ClientSettings(plaintext=True, timeout_s=60),
                         tracer_provider=setup_tracing("bench-client"))
        session_id = uuid.uuid4().hex
        start, _ = await client.start_session(session_id, PROMPT, SamplingParams())
        print("ready", flush=True)
        for line in sys.stdin:
            rows, position = [], start
            for _ in range(int(line)):
                with measure_cycle() as cost:
                    await client.decode(session_id, position, 1)
                position += 1
                rows.append((cost.calls_s, cost.target_model_s, cost.queued_s, cost.handler_s))
            await client.truncate(session_id, start)  # the same context every block
            print(json.dumps(rows), flush=True)
        await client.close()

    asyncio.run(serve_blocks())


def start_client(root: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "OTEL_TRACES_EXPORTER": "none"}
    proc = subprocess.Popen([sys.executable, __file__, "--client-port", str(port)], cwd=root, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the client from {root} did not start")
    return proc


def measure(clients: dict[str, subprocess.Popen], rounds: int, calls: int) -> dict[str, list[list[float]]]:
    rows: dict[str, list[list[float]]] = {name: [] for name in clients}
    for round_ in range(rounds):
        order = list(clients) if round_ % 2 == 0 else list(clients)[::-1]
        for name in order:
            clients[name].stdin.write(f"{calls}\n")
            clients[name].stdin.flush()
            rows[name].extend(json.loads(clients[name].stdout.readline()))
    return rows


def report(name: str, values: list[list[float]]) -> None:
    ms = {part: [v[i] * 1e3 for v in values] for i, part in enumerate(PARTS)}
    overhead = [c - m for c, m in zip(ms["call"], ms["model"])]
    transport = [c - h for c, h in zip(ms["call"], ms["handler"])]
    work = [h - m - q for h, m, q in zip(ms["handler"], ms["model"], ms["queue"])]
    p50, mean = statistics.median, statistics.fmean
    print(f"{name:>6}: round trip p50 {p50(ms['call']):.2f} ms, model p50 {p50(ms['model']):.2f} ms, overhead "
          f"p50 {p50(overhead):.2f} ms, mean {mean(overhead):.2f} ms (p50 transport {p50(transport):.2f}, "
          f"queue {p50(ms['queue']):.2f}, service work {p50(work):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="source tree of the other build")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=25, help="calls per block")
    parser.add_argument("--target-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for both target services, e.g. --target-arg=--device=cuda:0 (repeatable)")
    parser.add_argument("--client-port", type=int, help=argparse.SUPPRESS)  # a client worker's
    args = parser.parse_args()
    if args.client_port is not None:
        return client_worker(args.client_port)
    sys.path.insert(0, str(HERE))
    from specdec.bench.gpu import model_dir

    dtype = next((a.split("=", 1)[1] for a in args.target_arg if a.startswith("--dtype=")), "float32")
    model = model_dir(args.model, dtype)
    log_dir = Path(tempfile.mkdtemp(prefix="call-overhead-"))
    procs, clients = {}, {}
    roots = {"before": args.before.resolve()} if args.before else {}
    roots["after" if args.before else "this"] = HERE
    load = os.getloadavg()[0]
    try:
        for name, root in roots.items():
            procs[name] = start(root, model, log_dir, args.target_arg)
        for name, root in roots.items():
            clients[name] = start_client(root, procs[name][1])
        rows = measure(clients, args.rounds, args.calls)
    finally:
        for proc in [*clients.values(), *(p for p, _ in procs.values())]:
            proc.terminate()
            proc.wait()
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{args.rounds} rounds x {args.calls} calls per build")
    for name, values in rows.items():
        report(name, values)


if __name__ == "__main__":
    main()
