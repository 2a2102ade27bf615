"""Overhead of one target service call (round trip minus model time), two builds side by side.

    git archive <commit> | tar -x -C /tmp/before && (cd /tmp/before && python -m specdec.protogen)
    python scripts/bench_call_overhead.py --before /tmp/before [--model smollm2-135m-instruct] \
        [--rounds 8] [--calls 25]

Starts one target service from each source tree (the other build's code, this worktree's code) on
the same model and sends one-token Decode calls to them in alternating blocks (A B B A A B ...), so
that a neighbour's load hits both alike. Per call: the round trip as this client measured it, the
model time the service reported (ServerTiming.model_ns; the older build must have it too), and
their difference: gRPC on both ends, interceptors, the service's checks and conversions, the hops
between the event loop and the model thread. Prints medians and means per build.
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
sys.path.insert(0, str(HERE))

from specdec.engine.cycle_cost import measure_cycle  # noqa: E402
from specdec.models.registry import resolve_model  # noqa: E402
from specdec.sampling.params import SamplingParams  # noqa: E402
from specdec.server.settings import ClientSettings  # noqa: E402
from target_service.client import connect  # noqa: E402

PROMPT = list(range(10, 130))  # 120 tokens: a context like the benchmark's


def start(root: Path, model: Path, log_dir: Path) -> tuple[subprocess.Popen, int]:
    ready = log_dir / f"{root.name}.ready.json"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "OTEL_TRACES_EXPORTER": "none"}
    with open(log_dir / f"{root.name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(model), "--plaintext",
                                 "--max-context", "512", "--port", "0", "--metrics-port", "0",
                                 "--ready-file", str(ready)], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (ready.exists() and ready.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the target service from {root} did not start; see {log_dir}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())["port"]


async def measure(ports: dict[str, int], rounds: int, calls: int) -> dict[str, list[tuple[float, float]]]:
    clients = {name: connect(f"127.0.0.1:{port}", ClientSettings(plaintext=True, timeout_s=60))
               for name, port in ports.items()}
    sessions = {}
    for name, client in clients.items():
        session_id = uuid.uuid4().hex
        position, _ = await client.start_session(session_id, PROMPT, SamplingParams())
        sessions[name] = session_id, position
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    for round_ in range(rounds):
        order = list(clients) if round_ % 2 == 0 else list(clients)[::-1]
        for name in order:
            session_id, start = sessions[name]
            position = start
            for _ in range(calls):
                with measure_cycle() as cost:
                    await clients[name].decode(session_id, position, 1)
                position += 1
                rows[name].append((cost.calls_s, cost.target_model_s))
            await clients[name].truncate(session_id, start)  # the same context every block
    for client in clients.values():
        await client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the other build")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=25, help="calls per block")
    args = parser.parse_args()
    model = resolve_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="call-overhead-"))
    procs = {}
    try:
        for name, root in (("before", args.before.resolve()), ("after", HERE)):
            procs[name] = start(root, model, log_dir)
        rows = asyncio.run(measure({name: port for name, (_, port) in procs.items()}, args.rounds, args.calls))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds x {args.calls} calls per build")
    for name, values in rows.items():
        overhead = [(call - model_s) * 1e3 for call, model_s in values]
        print(f"{name:>6}: round trip p50 {statistics.median(c for c, _ in values) * 1e3:.2f} ms, model p50 "
              f"{statistics.median(m for _, m in values) * 1e3:.2f} ms, overhead p50 {statistics.median(overhead):.2f} "
              f"ms, mean {statistics.fmean(overhead):.2f} ms")


if __name__ == "__main__":
    main()
