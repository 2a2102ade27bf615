"""CPU seconds per generated token in each process, the baseline pool against the speculative pool.

    python scripts/pool_cpu_per_token.py --sessions 16 --tokens 128 --rounds 2 [-- --coordinator flags]

Starts the default pair as the benchmark does (target, draft service, coordinator, Redis), then runs
`--sessions` concurrent requests of `--tokens` tokens through each pool in turn, `--rounds` times,
and prints each level's throughput, its speculative cycles and the CPU time per token of the
coordinator, the target and the draft (from /proc, so Linux only). Under load the speculative pool's
turns decode plainly; this tells whether their path costs more than the baseline pool's (BENCHMARKS.md,
round 23).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from specdec.bench.netdelay import LoopbackNetwork
from specdec.bench.prompts import load_prompts
from specdec.bench.services import Deployment, ServiceOptions
from specdec.client import AsyncClient
from specdec.models.registry import resolve_model


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def level(address: str, prompts: list[str], pool: str, tokens: int) -> tuple[int, float, int]:
    """(tokens generated, wall seconds, speculative cycles) of one request per prompt, all at once."""
    client = AsyncClient(address, plaintext=True)

    async def one(prompt: str) -> tuple[int, int]:
        generated, last = 0, None
        async for chunk in client.stream(prompt, max_new_tokens=tokens, temperature=0.0, pool=pool, ignore_eos=True):
            generated, last = generated + len(chunk.token_ids), chunk
        await client.end_session(last.session_id)
        return generated, int(dict(last.stats).get("cycles", 0))

    started = time.perf_counter()
    results = await asyncio.gather(*[one(p) for p in prompts])
    await client.close()
    return sum(n for n, _ in results), time.perf_counter() - started, sum(c for _, c in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/specbench/dev.jsonl")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pools", default="baseline,speculative", help="the pools to run, in this order")
    parser.add_argument("coordinator_args", nargs="*", help="extra coordinator flags, after --")
    args = parser.parse_args()
    target, draft = resolve_model("smollm2-135m-instruct"), resolve_model("smollm2-135m-draft")
    every = load_prompts(Path(args.prompts))
    prompts = [p.text for p in every[:: max(1, len(every) // args.sessions)]][: args.sessions]
    options = ServiceOptions(target, draft, threads=args.threads, num_slots=args.sessions + 4,
                             coordinator_args=tuple(args.coordinator_args))
    with Deployment(options, LoopbackNetwork(Path(tempfile.mkdtemp()))).start(["draft-model"]) as deployment:
        pids = {"coordinator": next(p for p in deployment.processes if p.module == "coordinator").proc.pid,
                "target": deployment.target.proc.pid, "draft": deployment.drafts["draft-model"].proc.pid}
        address = deployment.coordinators["draft-model"]
        pools = args.pools.split(",")
        for pool in pools:  # warm-up
            asyncio.run(level(address, prompts[:4], pool, 16))
        for _ in range(args.rounds):
            for pool in pools:
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                generated, wall, cycles = asyncio.run(level(address, prompts, pool, args.tokens))
                per_token = {name: (cpu_seconds(pid) - before[name]) * 1e3 / generated for name, pid in pids.items()}
                print(f"{pool:12s} {generated} tokens in {wall:.1f} s ({generated / wall:.1f} tok/s), {cycles} cycles; "
                      "CPU ms per token: " + ", ".join(f"{name} {ms:.2f}" for name, ms in per_token.items()), flush=True)


if __name__ == "__main__":
    main()
