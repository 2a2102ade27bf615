"""Closed-loop load on a running coordinator, as stateless backends make it: each of --clients
sends one-turn requests (a new session each) back to back for --seconds, and the run prints
requests/s, tokens/s, time to first token (p50 / p90 / max), the mean request latency and the
failures by status code.

    python scripts/closed_loop_load.py 127.0.0.1:50051 --clients 8 --seconds 60 --tokens 24

Prompts are the first turns of ../shared/data/specbench/dev.jsonl (or --prompts), cut to
--prompt-chars characters (400). Past the targets' --num-slots concurrent sessions it measures
admission: how freed KV slots go to waiting sessions (docs/DEPLOYMENT.md, "More sessions than KV
slots"); past a draft's, how sessions without a draft slot fare.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
from pathlib import Path

from specdec.client import AsyncClient

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "specbench" / "dev.jsonl"


async def _client(client: AsyncClient, first: int, stride: int, prompts: list[str], tokens: int, end: float,
                  results: dict) -> None:
    index = first
    while time.monotonic() < end:
        started, ttft, count = time.monotonic(), None, 0
        try:
            async for chunk in client.stream(prompts[index % len(prompts)], max_new_tokens=tokens,
                                             ignore_eos=True):
                if ttft is None and chunk.token_ids:
                    ttft = time.monotonic() - started
                count += len(chunk.token_ids)
        except Exception as exc:  # noqa: BLE001 - counted by status: failures are what this measures
            code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
            results["failures"][code] += 1
        else:
            results["ttft"].append(ttft)
            results["latency"].append(time.monotonic() - started)
            results["tokens"] += count
        index += stride


async def run(address: str, clients: int, seconds: float, tokens: int, prompts: list[str]) -> dict:
    results = {"ttft": [], "latency": [], "tokens": 0, "failures": collections.Counter()}
    async with AsyncClient(address, plaintext=True) as client:
        await client.generate("Warm up.", max_new_tokens=4)
        started = time.monotonic()
        await asyncio.gather(*[_client(client, i, clients, prompts, tokens, started + seconds, results)
                               for i in range(clients)])
        wall = time.monotonic() - started
    ttft = sorted(results["ttft"])
    quantiles = statistics.quantiles(ttft, n=20) if len(ttft) >= 2 else [float("nan")] * 19
    return {"clients": clients, "requests": len(ttft), "requests_per_s": round(len(ttft) / wall, 3),
            "tokens_per_s": round(results["tokens"] / wall, 2), "ttft_p50_s": round(quantiles[9], 3),
            "ttft_p90_s": round(quantiles[17], 3), "ttft_max_s": round(max(ttft, default=float("nan")), 3),
            "latency_mean_s": round(statistics.fmean(results["latency"]), 3) if ttft else float("nan"),
            "failures": dict(results["failures"]), "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="the coordinator, HOST:PORT (plaintext)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=24, help="max_new_tokens of each request")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="a Spec-Bench style JSONL file")
    parser.add_argument("--prompt-chars", type=int, default=400,
                        help="cut each prompt to this many characters (longer prompts: a costlier re-prefill)")
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0][:args.prompt_chars]
               for line in args.prompts.read_text().splitlines() if line.strip()]
    print(json.dumps(asyncio.run(run(args.address, args.clients, args.seconds, args.tokens, prompts))))


if __name__ == "__main__":
    main()
