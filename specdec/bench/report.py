"""Numbers from the requests of one run: per method, per category and overall.

Throughput is total output tokens / total end-to-end time of the group's requests (prefill
included, as Spec-Bench does); under concurrency, total tokens / wall time of the rounds. Time per
output token is per request, (e2e - ttft) / (n - 1), never between stream chunks.

Ideal speedup (../shared/docs/BENCHMARKS.md; Leviathan et al. 2023 with the measured verify cost):
    ideal = E x t_step / (g x t_draft + t_verify(g + 1)),   E = (1 - a^(g+1)) / (1 - a)
with g the draft length used, t_step, t_draft, t_verify measured on the engines in process
(timing.py), and a Leviathan's per-token acceptance probability: the chance that a drafted token is
accepted given that the ones before it were. Its estimate is accepted / (accepted + rejections), the
tokens actually tested; "acceptance_rate" (accepted / drafted) also counts the tokens after a
rejection that were never tested, and would understate E. "ideal_cycle_mix" charges every cycle what its real draft length
costs and every plain step t_step, for proposers that often draft fewer than g tokens (n-gram).
efficiency = measured speedup / ideal: what RPC, coordination and Redis cost.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Iterable

import numpy as np

from specdec.bench.methods import (DEFAULT_REFERENCE, REFERENCE, REPLAY_PREFIX,
                                   RequestResult, base_name, fixed_k_of, is_service, is_speculative,
                                   without_pipelining)
from specdec.bench.timing import StepTimes, summarize
from specdec.generation.equality import DEFAULT_TIE_THRESHOLD, compare_outputs, is_tie



def timed_proposer(name: str) -> str | None:
    """Which engine timing (timing.py) gives a method's draft step: replay runs the draft model's passes."""
    name = without_pipelining(base_name(name))
    if name in ("specdec-ngram", "specdec-ngram-local", "specdec-ngram-target"):
        return "ngram"
    return "draft-model" if name in ("specdec-draft", "specdec-draft-target") or name.startswith(REPLAY_PREFIX) else None

_SUMMED = ("cycles", "drafted", "accepted", "recovered", "bonus", "decode_steps", "fallbacks", "draft_seconds",
           "verify_seconds", "decode_seconds", "pipeline_hits", "pipeline_misses", "pipeline_wrong_guesses",
           "pipeline_rejected_last", "pipeline_hits_second_guess", "pipeline_hits_rejected_last",
           "timed_cycles", "cycle_seconds", "draft_model_seconds",
           "target_model_seconds", "queued_seconds", "handler_seconds", "call_seconds", "hidden_draft_model_seconds")


def _hit_rates_by_branch(s: dict) -> dict | None:
    attempts = s["pipeline_hits"] + s["pipeline_misses"]
    if not attempts:
        return None
    second, rejected_last = s["pipeline_hits_second_guess"], s["pipeline_hits_rejected_last"]
    return {"main": (s["pipeline_hits"] - second - rejected_last) / attempts,
            "second_guess": second / attempts, "rejected_last": rejected_last / attempts}


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _sum_positions(rows: Iterable[list[int]]) -> list[int]:
    out: list[int] = []
    for row in rows:
        out += [0] * (len(row) - len(out))
        for i, v in enumerate(row):
            out[i] += v
    return out


def group_metrics(results: list[RequestResult], wall_s: float | None = None) -> dict:
    tokens = sum(r.num_tokens for r in results)
    e2e = [r.e2e_s for r in results]
    tpot = [r.tpot_s for r in results if r.tpot_s is not None]
    ttft = [r.ttft_s for r in results]
    out = {
        "requests": len(results), "output_tokens": tokens,
        "tokens_per_s": tokens / (wall_s if wall_s else sum(e2e)) if results else 0.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_mean_s": statistics.fmean(e2e) if e2e else None,
    }
    if wall_s:
        out["wall_s"] = wall_s
    # Protobuf leaves zero counters out of the stats, so any counter present means stats came back.
    stats = [r.stats for r in results if r.stats]
    if any(name in s for s in stats for name in (*_SUMMED, "drafted_by_position")):
        s = {name: sum(x.get(name, 0) for x in stats) for name in _SUMMED}
        drafted_pos = _sum_positions(x.get("drafted_by_position", []) for x in stats)
        accepted_pos = _sum_positions(x.get("accepted_by_position", []) for x in stats)
        cycles = s["cycles"]
        out.update({
            **s,
            "acceptance_rate": s["accepted"] / s["drafted"] if s["drafted"] else None,
            # Per-token acceptance given the prefix was accepted: tested tokens only (see above).
            "alpha": (s["accepted"] / (s["accepted"] + s["recovered"])
                      if s["accepted"] + s["recovered"] and any("recovered" in x or "bonus" in x for x in stats)
                      else None),
            "mean_accepted_length": (s["accepted"] + cycles) / cycles if cycles else None,
            # Pipelined methods: cycles whose speculative block went straight to verification.
            "pipeline_hit_rate": (s["pipeline_hits"] / (s["pipeline_hits"] + s["pipeline_misses"])
                                  if s["pipeline_hits"] + s["pipeline_misses"] else None),
            # Misses a multi-outcome draft could have turned into hits, as shares of pipelined cycles:
            # a second bonus guess (block fully accepted), a branch for all-but-last accepted.
            "pipeline_wrong_guess_rate": (s["pipeline_wrong_guesses"] / (s["pipeline_hits"] + s["pipeline_misses"])
                                          if s["pipeline_hits"] + s["pipeline_misses"] else None),
            "pipeline_rejected_last_rate": (s["pipeline_rejected_last"] / (s["pipeline_hits"] + s["pipeline_misses"])
                                            if s["pipeline_hits"] + s["pipeline_misses"] else None),
            # Hit rate by the branch that hit (multi-outcome pipelining; main = the draft's own guess).
            "pipeline_hit_rate_by_branch": _hit_rates_by_branch(s),
            "mean_drafted_per_cycle": s["drafted"] / cycles if cycles else None,
            "drafted_by_position": drafted_pos, "accepted_by_position": accepted_pos,
            "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_pos, drafted_pos)],
            # As the coordinator sees them: RPC and service overhead included.
            "service_draft_s_per_cycle": s["draft_seconds"] / cycles if cycles else None,
            "service_verify_s_per_cycle": s["verify_seconds"] / cycles if cycles else None,
            "service_decode_s_per_step": s["decode_seconds"] / s["decode_steps"] if s["decode_steps"] else None,
        })
        out.update(cycle_cost(s))
    return out


def cycle_cost(s: dict) -> dict:
    """Per cycle (speculative or plain): wall time, time in each model as the services reported it,
    and the overhead (the rest: RPC, batching, conversions, coordination), also as a fraction."""
    n = s.get("timed_cycles", 0)
    if not n:
        return {}
    # On the critical path: a pipelined Propose's model time beside the verify's is not.
    model_total = s["draft_model_seconds"] + s["target_model_seconds"]
    overhead = max(0.0, s["cycle_seconds"] - model_total + s.get("hidden_draft_model_seconds", 0.0))
    out = {"cycle_s": s["cycle_seconds"] / n, "draft_model_s_per_cycle": s["draft_model_seconds"] / n,
           "target_model_s_per_cycle": s["target_model_seconds"] / n, "overhead_s_per_cycle": overhead / n,
           "overhead_fraction": overhead / s["cycle_seconds"] if s["cycle_seconds"] else None}
    # The overhead's parts, where the services reported their handler times, and only where every
    # call lay on the cycle's path: a pipelined cycle's speculative Propose runs beside its verify, so
    # its round trip counted in the calls made the coordinator's part negative (-6.7 ms a cycle).
    pipelined = s.get("pipeline_hits", 0) + s.get("pipeline_misses", 0) > 0
    if s.get("call_seconds") and not pipelined:
        out["overhead_parts_s_per_cycle"] = {
            "coordinator": (s["cycle_seconds"] - s["call_seconds"]) / n,  # the loop, hand-offs, Redis waits
            "transport": (s["call_seconds"] - s["handler_seconds"]) / n,  # gRPC both ends, interceptors, wake-ups
            "service_queued": s["queued_seconds"] / n,  # batcher windows, running steps, the model-thread hop
            "service_other": (s["handler_seconds"] - s["queued_seconds"] - model_total) / n,  # checks, conversions
        }
    return out


def expected_tokens(a: float, g: int) -> float:
    return float(g + 1) if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)


def ideal_speedup(m: dict, times: dict, proposer: str, draft_length: int | None) -> dict:
    """Both ideals for one method's group metrics `m` and the group's step times."""
    if not times or m.get("acceptance_rate") is None or proposer not in times.get("t_draft", {}):
        return {}
    t_step, t_draft = times["t_step"], times["t_draft"][proposer]
    t_verify = {int(n): v for n, v in times["t_verify"].items()}
    g = draft_length or max(1, round(m["mean_drafted_per_cycle"]))
    if g + 1 not in t_verify:
        return {}
    a = m["alpha"] if m.get("alpha") is not None else m["acceptance_rate"]
    ideal = expected_tokens(a, g) * t_step / (g * t_draft + t_verify[g + 1])
    # Cycle mix: cycles that drafted exactly j tokens, from "drafted a token at position i" counts.
    pos = m["drafted_by_position"] + [0]
    exactly = {0: m["cycles"] - (pos[0] if m["drafted_by_position"] else 0)}
    exactly.update({j: pos[j - 1] - pos[j] for j in range(1, len(pos))})
    if max(exactly) + 1 > max(t_verify):
        return {"ideal": ideal, "g": g}
    cost = sum(c * (j * t_draft + t_verify[j + 1]) for j, c in exactly.items()) + m["decode_steps"] * t_step
    committed = m["accepted"] + m["cycles"] + m["decode_steps"]
    return {"ideal": ideal, "g": g, "ideal_cycle_mix": committed * t_step / cost if cost else None,
            "cost_ratio_c": t_draft / t_step}


def lossless(results: list[RequestResult], reference: list[RequestResult]) -> dict:
    """Fraction of prompts whose output equals the reference method's, token for token; of those
    that differ, how many the target re-scored (bf16 / fp16, ties.py) as numerical ties."""
    ref = {}
    for r in reference:
        ref.setdefault(r.question_id, r.token_ids)
    checked = [(r, compare_outputs([], r.token_ids, ref[r.question_id])) for r in results if r.question_id in ref]
    different = [divergence(r, rep.divergence, r.logit_gap is not None and
                            is_tie(r.logit_gap, r.tie_threshold or DEFAULT_TIE_THRESHOLD))
                 for r, rep in checked if not rep.equal]
    ties = sum(1 for d in different if d["tie"])
    return {"lossless_fraction": (len(checked) - len(different)) / len(checked) if checked else None,
            "lossless_checked": len(checked), "differing_prompts": sorted({d["prompt"] for d in different}),
            "numerical_ties": ties, "unexplained_differences": len(different) - ties, "divergences": different}


def divergence(result: RequestResult, position: int | None, tie: bool) -> dict:
    """One output that parts from the reference: where, at what re-scored gap, and whether its request
    drafted at all. A request that never speculated can part only through the batches it shared: in
    bf16 its plain rows ran in steps shaped by other sessions' verifies (docs/BENCHMARKS.md, round 41)."""
    return {"prompt": result.question_id, "round": result.round, "position": position,
            "logit_gap": result.logit_gap, "tie_threshold": result.tie_threshold, "tie": tie,
            "speculated": bool(result.stats.get("cycles"))}


def phase_table(results: list[RequestResult], methods: list[str], times: list[StepTimes],
                draft_length: int | None) -> dict:
    """Per method metrics with speedup, ideal, efficiency and losslessness (batch-1 style phases)."""
    by_method: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        by_method[r.method].append(r)
    timing = summarize(times)
    table = {}
    for name in methods:
        if not by_method.get(name):
            continue
        m = group_metrics(by_method[name])
        reference = REFERENCE.get(name, DEFAULT_REFERENCE)
        if by_method.get(reference):
            ref_metrics = group_metrics(by_method[reference])
            m["reference"] = reference
            m["speedup"] = m["tokens_per_s"] / ref_metrics["tokens_per_s"]
            m.update(lossless(by_method[name], by_method[reference]))
        if timed_proposer(name):
            g = fixed_k_of(name, draft_length)  # None: the mean k used
            m.update(ideal_speedup(m, timing, timed_proposer(name), g))
            if not m.get("cycles"):
                m["warning"] = ("no speculative cycle at all: the coordinator decoded plainly (draft refused, "
                                "e.g. a vocab fingerprint mismatch, or failing); see the coordinator's log")
            for key in ("ideal", "ideal_cycle_mix"):
                if m.get(key) and m.get("speedup"):
                    m["efficiency" + key[len("ideal"):]] = m["speedup"] / m[key]
        table[name] = m
    if timing:
        table["_step_times"] = timing
    return table


def batch1_report(results: list[RequestResult], methods: list[str], times: list[StepTimes],
                  draft_length: int | None) -> dict:
    categories = sorted({r.category for r in results})
    return {
        "overall": phase_table(results, methods, times, draft_length),
        "by_category": {c: phase_table([r for r in results if r.category == c], methods,
                                       [t for t in times if t.category == c], draft_length)
                        for c in categories},
    }


def concurrency_report(results: list[RequestResult], methods: list[str]) -> dict:
    out: dict = {}
    for level in sorted({r.concurrency for r in results}):
        table, by_round = {}, {}
        for name in methods:
            rows = [r for r in results if r.concurrency == level and r.method == name]
            if not rows:
                continue
            walls, full_tokens, full_s = [], 0.0, 0.0
            for rnd in sorted({r.round for r in rows}):
                group = [r for r in rows if r.round == rnd]
                walls.append(max(r.start_s + r.e2e_s for r in group) - min(r.start_s for r in group))
                by_round.setdefault(name, {})[rnd] = sum(r.num_tokens for r in group) / walls[-1]
                tokens, seconds = _while_full(group)
                full_tokens, full_s = full_tokens + tokens, full_s + seconds
            wall = sum(walls)
            table[name] = group_metrics(rows, wall_s=wall)
            table[name]["mean_occupancy"] = sum(r.e2e_s for r in rows) / wall if wall > 0 else None
            table[name]["full_occupancy_tokens_per_s"] = full_tokens / full_s if full_s > 0 else None
        plain = table.get(DEFAULT_REFERENCE)
        for name, m in table.items():
            if plain and name != DEFAULT_REFERENCE:
                m["throughput_vs_plain"] = m["tokens_per_s"] / plain["tokens_per_s"]
                # Each round runs every method once, in a rotated order: its ratios show the spread that
                # a slow spell of a shared machine puts into the pooled one.
                rounds = sorted(set(by_round[name]) & set(by_round[DEFAULT_REFERENCE]))
                m["throughput_vs_plain_by_round"] = [by_round[name][r] / by_round[DEFAULT_REFERENCE][r]
                                                     for r in rounds]
                if m["full_occupancy_tokens_per_s"] and plain["full_occupancy_tokens_per_s"]:
                    m["full_occupancy_vs_plain"] = m["full_occupancy_tokens_per_s"] / plain["full_occupancy_tokens_per_s"]
        out[str(level)] = table
    return out


def _while_full(group: list[RequestResult]) -> tuple[float, float]:
    """(tokens, seconds) of a round while every client worker was busy: from its start to its last
    request's start, each request's tokens after its first spread evenly up to its end. A round is a
    finite batch: plain requests of one length end together, speculative ones of unequal speed leave
    workers idle at its tail, which a server under a steady stream of requests does not see; this is
    the throughput without that tail (the whole round's stays the headline figure)."""
    start = min(r.start_s for r in group)
    window = max(r.start_s for r in group) - start
    if window <= 0:  # one wave: every request started at once, so the round is its tail
        return 0.0, 0.0
    tokens = 0.0
    for r in group:
        first, end = r.start_s - start + r.ttft_s, r.start_s - start + r.e2e_s
        if first <= window:
            tokens += 1
            if end > first:
                tokens += (r.num_tokens - 1) * (min(end, window) - first) / (end - first)
    return tokens, window


def goals(batch1: dict, concurrency: dict, floor: dict | None = None) -> dict:
    """Issue 5's goals against what this run measured (None where the run lacks the method)."""
    overall = batch1.get("overall", {})
    ours = [m for m in overall if is_service(m) and is_speculative(m)]
    get = lambda method, key: overall.get(method, {}).get(key)  # noqa: E731
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    out = {
        "speedup_over_plain >= 2.0": {m: get(m, "speedup") for m in ours},
        "throughput_vs_hf_assisted >= 1.25": {
            "specdec-draft / hf-assisted": ratio(get("specdec-draft", "tokens_per_s"), get("hf-assisted", "tokens_per_s")),
            "specdec-ngram / hf-pld (the n-gram analogue)": ratio(get("specdec-ngram", "tokens_per_s"),
                                                                  get("hf-pld", "tokens_per_s")),
        },
        "efficiency >= 0.9 (CPU; GPU: >= 0.85 at alpha 0.8)": {m: get(m, "efficiency") for m in ours},
        "lossless == 1.0": {m: get(m, "lossless_fraction") for m in ours},
        "concurrent throughput >= plain": {
            level: {m: v.get("throughput_vs_plain") for m, v in table.items() if m in ours}
            for level, table in concurrency.items()},
    }
    if floor:
        out["target step <= 1.3 x memory-bandwidth floor (GPU)"] = floor.get("t_step_over_floor")
    return out
