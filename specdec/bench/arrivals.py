"""Open-loop load: requests arrive at a set rate, whatever the server's speed (`--arrival-rate`).

The concurrency phase is a closed loop: a fixed number of workers each send their next request when
the last one ends, and a round ends with its slowest worker. A serving deployment sees an open loop
instead: backends send requests when their users ask, so a faster method does not get more work, it
gets the same work done sooner, and a slower one queues. This phase measures that. Arrivals are a
Poisson process (exponential gaps, mean 1 / rate) drawn from the run's seed, the same instants for
every method of a round, so methods differ only in how they serve them. Each request's latency counts
from its arrival: a request that finds `max_sessions` already in flight waits in the client, and that
wait is part of its TTFT and end-to-end time (as a backend's connection limit would make it).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from specdec.bench.methods import RequestResult

PHASE = "arrival"
WAITED_S = 1e-3  # a client-side wait counts as one above this (taking a free session costs microseconds)


def schedule(rate: float, count: int, seed: int | str) -> list[float]:
    """Arrival offsets in seconds from the start: the first at 0, then exponential gaps of mean 1 / rate."""
    if rate <= 0:
        raise ValueError(f"an arrival rate is requests per second and must be > 0, got {rate}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def round_seed(seed: int, rate: float, rnd: int) -> str:
    """One schedule per (run seed, rate, round), shared by every method of that round (a string seed:
    random.Random hashes it with SHA-512, the same in every process)."""
    return f"{seed}/{rate:g}/{rnd}"


async def serve(runner, prompts: list, prompt_ids: dict, offsets: list[float], max_sessions: int,
                max_new_tokens: int, tick=None) -> list[RequestResult]:
    """Send prompts[i] at offsets[i] (seconds from now) through `runner`, at most `max_sessions` in
    flight; every result's times count from its arrival."""
    slots = asyncio.Semaphore(max_sessions)
    start = time.perf_counter()
    results: list[RequestResult] = []

    async def one(prompt, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        arrived = time.perf_counter()
        async with slots:
            waited = time.perf_counter() - arrived
            result = await runner.run(prompt, prompt_ids[prompt.question_id], max_new_tokens)
        result.ttft_s += waited
        result.e2e_s += waited
        result.start_s, result.client_wait_s = arrived, waited
        results.append(result)
        if tick is not None:
            tick()

    await asyncio.gather(*(one(p, t) for p, t in zip(prompts, offsets)))
    return results


async def phase(bench, runners: dict, target=None) -> None:
    """Every rate, every round, each method in turn (order rotated between rounds) on the same arrivals."""
    from specdec.bench import target_batches
    from specdec.bench.phases import _target_counts, rotation

    c = bench.config
    prompts = [bench.prompts[i % len(bench.prompts)] for i in range(c.arrival_requests)]
    batches = bench.collected.notes.setdefault("arrival_target_batches", {})
    for rate in c.arrival_rates:
        for rnd in range(c.arrival_rounds):
            offsets = schedule(rate, len(prompts), round_seed(c.seed, rate, rnd))
            for name in rotation(list(runners), rnd):
                before = await _target_counts(target)
                rows = await serve(runners[name], prompts, bench.prompt_ids, offsets, c.arrival_max_sessions,
                                   c.max_new_tokens, lambda: bench.tick(f"{rate:g}/s {name}"))
                for r in rows:
                    r.phase, r.rate, r.round = PHASE, rate, rnd
                bench.collected.results.extend(rows)
                after = await _target_counts(target)
                if before is not None and after is not None:
                    target_batches.add_difference(batches.setdefault(f"{rate:g}", {}).setdefault(name, {}),
                                                  before, after)


def report(results: list[RequestResult], methods: list[str], reference: str = "plain") -> dict:
    """Per rate and method: what was offered and achieved, latency from arrival, and each latency's
    ratio to the reference's at the same rate (below 1: faster than plain decoding)."""
    from specdec.bench.report import _pct, group_metrics

    out: dict = {}
    for rate in sorted({r.rate for r in results if r.phase == PHASE}):
        table = {}
        for name in methods:
            rows = [r for r in results if r.phase == PHASE and r.rate == rate and r.method == name]
            if not rows:
                continue
            walls = []
            for rnd in sorted({r.round for r in rows}):
                group = [r for r in rows if r.round == rnd]
                walls.append(max(r.start_s + r.e2e_s for r in group) - min(r.start_s for r in group))
            wall = sum(walls)
            m = group_metrics(rows, wall_s=wall)
            e2e = [r.e2e_s for r in rows]
            m.update(offered_rate=rate, achieved_rate=len(rows) / wall if wall > 0 else None,
                     e2e_p99_s=_pct(e2e, 99),
                     mean_in_flight=sum(e2e) / wall if wall > 0 else None,
                     client_wait_mean_s=statistics.fmean(r.client_wait_s for r in rows),
                     waited_share=sum(r.client_wait_s > WAITED_S for r in rows) / len(rows))
            table[name] = m
        plain = table.get(reference)
        for name, m in table.items():
            if plain is None or name == reference:
                continue
            for key, ratio in (("e2e_mean_s", "e2e_mean_vs_plain"), ("e2e_p50_s", "e2e_p50_vs_plain"),
                               ("e2e_p99_s", "e2e_p99_vs_plain"), ("ttft_p50_s", "ttft_p50_vs_plain"),
                               ("tpot_p50_s", "tpot_p50_vs_plain"), ("tokens_per_s", "throughput_vs_plain")):
                if m.get(key) and plain.get(key):
                    m[ratio] = m[key] / plain[key]
        out[f"{rate:g}"] = table
    return out
