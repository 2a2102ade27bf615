"""The report of one run: the JSON document (every number) and the short printed tables."""

from __future__ import annotations

import collections
import statistics

from specdec.bench import arrivals, target_batches
from specdec.bench.methods import RequestResult, is_service, is_speculative
from specdec.bench.report import batch1_report, concurrency_report, goals, group_metrics, lossless, phase_table
from specdec.bench.runner import Bench, Collected
from specdec.bench.timing import StepTimes
from specdec.generation.equality import DEFAULT_TIE_THRESHOLD

SCHEMA = "specdec-bench/1"


def _rounds(m: dict) -> str:
    """The per-round ratios to plain decoding, when the level ran more than one round."""
    ratios = m.get("throughput_vs_plain_by_round") or []
    if len(ratios) < 2:
        return ""
    return f"  rounds {min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}"


def _full(m: dict) -> str:
    """The ratio to plain decoding while every client worker was busy (report._while_full), where the
    level refilled its workers (more requests than sessions)."""
    ratio = m.get("full_occupancy_vs_plain")
    return "" if ratio is None else f"; all workers busy {ratio:.2f} (occupancy {m['mean_occupancy']:.2f})"


def sections(results: list[RequestResult], times: list[StepTimes], methods: list[str], fixed_k: int | None,
             notes: dict) -> dict:
    """Every computed section of the report, from the raw requests and engine timings."""
    batch1_rows = [r for r in results if r.phase == "batch1"]
    batch1 = batch1_report(batch1_rows, methods, times, fixed_k)
    concurrency = {}
    if any(r.phase == "concurrency" for r in results):
        concurrency = {"1": {m: group_metrics([r for r in batch1_rows if r.method == m])
                             for m in methods if is_service(m)}}
        plain = concurrency["1"].get("plain")
        for name, m in concurrency["1"].items():
            if plain and name != "plain":
                m["throughput_vs_plain"] = m["tokens_per_s"] / plain["tokens_per_s"]
        concurrency.update(concurrency_report([r for r in results if r.phase == "concurrency"], methods))
        for level, table in (notes.get("target_batches") or {}).items():
            for name, counts in table.items():
                if name in concurrency.get(level, {}):
                    concurrency[level][name]["target_batches"] = target_batches.summary(counts)
    netem = {}
    if notes.get("netem"):
        netem = {"network": notes["netem"]["network"], "levels": {}}
        for level, note in notes["netem"]["levels"].items():
            rows = [r for r in results if r.phase == "netem" and r.delay_ms == float(level)]
            netem["levels"][level] = {**phase_table(rows, methods, times, fixed_k), "_network": note}
    arrival = arrivals.report(results, methods)
    for rate, table in (notes.get("arrival_target_batches") or {}).items():
        for name, counts in table.items():
            if name in arrival.get(rate, {}):
                arrival[rate][name]["target_batches"] = target_batches.summary(counts)
    _lossless_under_load(results, concurrency, "concurrency", lambda r: str(r.concurrency))
    _lossless_under_load(results, arrival, arrivals.PHASE, lambda r: f"{r.rate:g}")
    floor = notes.get("floor")
    return {"batch1": batch1, "concurrency": concurrency, "netem": netem, "arrivals": arrival,
            "goals": goals(batch1, concurrency, floor),
            "did_not_speculate": did_not_speculate(batch1["overall"]),
            "floor": {"target": floor, "draft": notes.get("floor_draft")} if floor else None}


def _lossless_under_load(results: list[RequestResult], section: dict, phase: str, level_of) -> None:
    """Every method's outputs under load against plain decoding's at batch 1 (else the same phase's),
    token for token: rows batched with other sessions, at other positions and draft lengths, must
    decode exactly as alone (greedy)."""
    reference = [r for r in results if r.phase == "batch1" and r.method == "plain"] or \
        [r for r in results if r.phase == phase and r.method == "plain"]
    if not reference:
        return
    for level, table in section.items():
        for name, m in table.items():
            rows = [r for r in results if r.phase == phase and r.method == name and level_of(r) == level]
            if rows:
                m.update(lossless(rows, reference))


def recompute(report: dict) -> dict:
    """The same report with its sections computed again from its raw requests and timings (after a
    change to the analysis; nothing is measured again)."""
    fields = set(RequestResult.__dataclass_fields__)
    results = [RequestResult(**{k: v for k, v in r.items() if k in fields}) for r in report["requests"]]
    times = [StepTimes(t["question_id"], t["category"], t["context"], t["t_step"],
                       {int(k): v for k, v in t["t_verify"].items()}, t["t_draft"]) for t in report["step_times"]]
    methods = [m for m, v in report["methods"].items() if v["status"] == "run"]
    policy = report["meta"]["draft_length_policy"]
    fixed_k = policy["num_draft_tokens"] if policy["policy"].startswith("fixed") else None
    notes = {"netem": {"network": report["netem"]["network"],
                       "levels": {lv: t["_network"] for lv, t in report["netem"]["levels"].items()}}
             if report.get("netem") else None,
             "floor": (report.get("floor") or {}).get("target"), "floor_draft": (report.get("floor") or {}).get("draft"),
             "target_batches": report.get("target_batches"),
             "arrival_target_batches": report.get("arrival_target_batches")}
    return {**report, **sections(results, times, methods, fixed_k, notes)}


def assemble(bench: Bench, collected: Collected) -> dict:
    c = bench.config
    notes = collected.notes
    fixed_k = c.num_draft_tokens if c.k_policy.startswith("fixed") else None
    categories = collections.Counter(p.category for p in bench.prompts)
    return {
        "schema": SCHEMA,
        "meta": {
            "machine": notes["machine"], "code": notes["code"], "device": c.device, "dtype": c.dtype,
            "backend": c.backend, "threads": c.threads,
            "cuda_graphs": {"setting": {None: "default (on for CUDA)", True: "on", False: "off"}[c.cuda_graphs],
                            "in_process_models": notes.get("cuda_graphs")},
            "models": {**notes["models"], "target_name": c.target, "draft_name": c.draft},
            "prompts": {"file": c.prompts_file or "specdec/data/bench_prompts.jsonl (default set)",
                        "count": len(bench.prompts), "categories": dict(categories),
                        "question_ids": [p.question_id for p in bench.prompts],
                        "selection": {"categories": list(c.categories), "per_category": c.per_category,
                                      "limit": c.limit}, "single_turn": "turns[0]"},
            "sampling": {"temperature": 0.0, "greedy": True, "max_new_tokens": c.max_new_tokens, "batch": 1},
            "draft_length_policy": {"policy": c.k_policy, "num_draft_tokens": c.num_draft_tokens,
                                    "note": "fixed: every request names k; server: the coordinator's default "
                                            "policy (request k = 0); fixed,server: methods named ...@server "
                                            "use the coordinator's policy; fixed:<k>,...: methods named "
                                            "...@k<N> name draft length N"},
            "extra_service_flags": {"target": list(c.target_args), "draft": list(c.draft_args),
                                    "coordinator": list(c.coordinator_args)},
            "replay": {"alphas": list(c.replay_alphas), "seed": c.replay_seed,
                       "alpha_spread": c.replay_alpha_spread} if c.replay_alphas else None,
            "runs": c.runs, "seed": c.seed,
            "order": "batch 1: per prompt every method once, order rotated from prompt to prompt (base order "
                     "shuffled with the seed); engine step times measured in the same rotation",
            "concurrency": {"levels": list(c.concurrency), "prompts_per_level": c.concurrency_prompts,
                            "rounds": c.concurrency_rounds},
            "arrivals": {"rates_per_s": list(c.arrival_rates), "requests_per_rate": c.arrival_requests,
                         "rounds": c.arrival_rounds, "max_sessions": c.arrival_max_sessions,
                         "process": "Poisson (exponential gaps), the same instants for every method of a round; "
                                    "latency counts from arrival, client-side waits for a session included"}
            if c.arrival_rates else None,
            "hf": notes.get("hf"), "warmup_s": notes.get("warmup_s"), "rescored_divergences": notes.get("rescored_divergences"),
            "batch_invariant_target": notes.get("batch_invariant_target", False),
            # The target's intra-op threads by forward width, as the service and the in-process target
            # ran them (specdec/models/step_threads.py); None: every forward on `threads`.
            "target_step_threads": notes.get("target_step_threads"),
            "tie_units": c.tie_units, "log_dir": notes.get("log_dir"),
        },
        "methods": bench.describe_methods(),
        **sections(collected.results, collected.times, bench.methods, fixed_k, notes),
        "step_times": [t.to_dict() for t in collected.times],
        "requests": [r.to_dict() for r in collected.results],
        "target_batches": notes.get("target_batches") or None,  # raw counts (recompute reads them)
        "arrival_target_batches": notes.get("arrival_target_batches") or None,
    }


def _f(value, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def _overhead(m: dict) -> str:
    """Per-cycle time outside the model forwards: "ms (% of the cycle)"."""
    if m.get("overhead_s_per_cycle") is None:
        return "-"
    return f"{m['overhead_s_per_cycle'] * 1e3:.1f}ms {m['overhead_fraction']:.0%}"


def _p50_p99(m: dict, stem: str, fmt: str = "{:.1f}", scale: float = 1e3) -> str:
    """"p50/p99" of a metric (stem: "tpot" -> tpot_p50_s, tpot_p99_s), milliseconds by default."""
    return f"{_f(m[f'{stem}_p50_s'], fmt, scale)}/{_f(m[f'{stem}_p99_s'], fmt, scale)}"


def _batches(m: dict) -> str:
    """The target's batched steps during the method's run: "steps, rows per step, ms per step"."""
    batches = m.get("target_batches")
    if not batches or batches["rows_per_step"] is None:
        return "-"
    step_ms = f", {batches['step_ms']:.1f}" if batches.get("step_ms") is not None else ""
    return f"{batches['steps']}, {batches['rows_per_step']:.2f}{step_ms}"


def _plain_steps(levels: dict) -> list[str]:
    """For methods whose streams draft on the target: their steps that verified nothing, by why."""
    lines = []
    for level, table in sorted(levels.items(), key=lambda kv: int(kv[0])):
        for name, m in table.items():
            batches = m.get("target_batches") or {}
            if batches.get("stream_plain_steps"):
                why = ", ".join(f"{reason} {count}" for reason, count in sorted(batches["stream_plain_steps"].items()))
                lines.append(f"  {level} sessions, {name}: steps without a verified draft: {why}; joint explorations "
                             f"{batches.get('joint_explorations', 0)}")
    return lines


def tables(report: dict) -> str:
    lines = []
    overall = report["batch1"]["overall"]
    lines.append(f"{'method':<22} {'tok/s':>7} {'speedup':>7} {'TTFT':>7} {'TPOT p50/p99 ms':>16} {'alpha':>6} "
                 f"{'len':>5} {'ideal':>6} {'eff':>5} {'eff mix':>7} {'lossless':>8} {'pipe hit':>8} "
                 f"{'overhead/cycle':>14}")
    for name, m in overall.items():
        if name.startswith("_"):
            continue
        tpot = _p50_p99(m, "tpot")
        lines.append(f"{name:<22} {_f(m['tokens_per_s'], '{:.1f}'):>7} {_f(m.get('speedup')):>7} "
                     f"{_f(m['ttft_p50_s'], '{:.0f}', 1e3):>5}ms {tpot:>16} {_f(m.get('alpha')):>6} "
                     f"{_f(m.get('mean_accepted_length')):>5} {_f(m.get('ideal')):>6} {_f(m.get('efficiency')):>5} "
                     f"{_f(m.get('efficiency_cycle_mix')):>7} "
                     f"{_f(m.get('lossless_fraction'), '{:.0%}', 1):>8} "
                     f"{_f(m.get('pipeline_hit_rate'), '{:.0%}', 1):>8} {_overhead(m):>14}")
    for name in did_not_speculate(overall):
        lines.append(f"WARNING: {name} ran no speculative cycle: the coordinator decoded plainly (a refused or "
                     "failing draft; see its log), so its row measures plain decoding")
    speculative = [n for n in overall if is_speculative(n) and overall[n].get("speedup") is not None]
    if speculative:
        lines.append("")
        lines.append(f"{'speedup by category':<22}" + "".join(f"{n:>20}" for n in speculative))
        for category, table in report["batch1"]["by_category"].items():
            lines.append(f"{category:<22}" + "".join(f"{_f(table.get(n, {}).get('speedup')):>20}" for n in speculative))
    for name, m in overall.items():
        if not name.startswith("_") and m.get("warning"):
            lines.append(f"WARNING {name}: {m['warning']}")
    if report.get("concurrency"):
        lines.append("")
        lines.append(f"{'sessions':<9} {'method':<22} {'tok/s':>7} {'vs plain':>8} {'TPOT p50/p99 ms':>16} {'TTFT p50':>9}"
                     f" {'overhead/cycle':>14} {'target steps, rows/step, ms':>28}")
        for level, table in sorted(report["concurrency"].items(), key=lambda kv: int(kv[0])):
            for name, m in table.items():
                lines.append(f"{level:<9} {name:<22} {_f(m['tokens_per_s'], '{:.1f}'):>7} "
                             f"{_f(m.get('throughput_vs_plain')):>8} {_p50_p99(m, 'tpot'):>16} "
                             f"{_f(m['ttft_p50_s'], '{:.0f}', 1e3):>7}ms"
                             f" {_overhead(m):>14} {_batches(m):>28}{_rounds(m)}{_full(m)}")
        lines += _plain_steps(report["concurrency"])
    if report.get("arrivals"):
        lines.append("")
        lines.append(f"{'req/s':<7} {'method':<22} {'done/s':>6} {'tok/s':>7} {'e2e p50/p99 s':>14} {'vs plain':>8} "
                     f"{'TTFT p50':>9} {'TPOT p50/p99 ms':>16} {'in flight':>9} {'waited':>6}")
        for rate, table in sorted(report["arrivals"].items(), key=lambda kv: float(kv[0])):
            for name, m in table.items():
                lines.append(f"{rate:<7} {name:<22} {_f(m['achieved_rate']):>6} {_f(m['tokens_per_s'], '{:.1f}'):>7} "
                             f"{_p50_p99(m, 'e2e', scale=1.0):>14} {_f(m.get('e2e_mean_vs_plain')):>8} "
                             f"{_f(m['ttft_p50_s'], '{:.0f}', 1e3):>7}ms {_p50_p99(m, 'tpot'):>16} "
                             f"{_f(m['mean_in_flight'], '{:.1f}'):>9} "
                             f"{_f(m['waited_share'], '{:.0%}', 1):>6}")
        lines.append("(open loop: latency from arrival; 'vs plain' = mean end-to-end time against plain decoding's "
                     "at the same arrivals, below 1 is faster)")
    parts = [("batch1", {"1": (report.get("batch1") or {}).get("overall") or {}}), *(
        (part, report.get(part) or {}) for part in ("concurrency", "arrivals"))]
    for part, levels in parts:
        for level, table in levels.items():
            for name, m in table.items():
                if not isinstance(m, dict):
                    continue
                if m.get("lossless_fraction") is not None and m["lossless_fraction"] < 1.0:
                    ties, unexplained = m.get("numerical_ties", 0), m.get("unexplained_differences")
                    kind = "NOTE" if unexplained == 0 else "WARNING"
                    lines.append(f"{kind} {part} {level} {name}: {m['lossless_fraction']:.0%} of outputs equal plain "
                                 f"decoding's at batch 1 (differing prompts {m['differing_prompts']}); "
                                 f"{ties} at numerical ties (logit gap within a few units of the dtype's "
                                 f"precision, at least {DEFAULT_TIE_THRESHOLD}), {unexplained} not"
                                 + _never_speculated(m.get("divergences") or []))
    if report.get("netem"):
        lines.append("")
        lines.append(f"network delay ({report['netem']['network']['mode']}), batch 1:")
        for level, table in report["netem"]["levels"].items():
            added = table["_network"].get("added_round_trip_ms")
            row = ", ".join(f"{n} {_f(m['tokens_per_s'], '{:.1f}')} tok/s"
                            + (f" ({_f(m.get('speedup'))}x)" if m.get("speedup") else "")
                            + (f" hit {_f(m['pipeline_hit_rate'], '{:.0%}', 1)}" if m.get("pipeline_hit_rate")
                               is not None else "")
                            for n, m in table.items() if not n.startswith("_"))
            lines.append(f"  {level} ms each way" + (f" (measured +{added:.2f} ms per round trip)" if added is not None
                                                     else "") + f": {row}")
    return "\n".join(lines)


def _never_speculated(divergences: list[dict]) -> str:
    """Of the differing requests, those that never drafted (parted through shared batches only), and
    the widest re-scored gap beyond the tie threshold, so that a WARNING says what to look at."""
    plain = [d for d in divergences if not d.get("speculated")]
    beyond = [d for d in divergences if not d.get("tie") and d.get("logit_gap") is not None]
    text = f"; {len(plain)} of them never speculated" if plain else ""
    if beyond:
        widest = max(beyond, key=lambda d: d["logit_gap"] - (d["tie_threshold"] or 0.0))
        text += (f"; widest gap beyond the rule {widest['logit_gap']:g} against {widest['tie_threshold']:g} "
                 f"(prompt {widest['prompt']}, position {widest['position']}, "
                 f"{'speculated' if widest['speculated'] else 'never speculated'})")
    return text


def did_not_speculate(overall: dict) -> list[str]:
    """Speculative service methods whose requests ran no speculative cycle at all (their stats came
    back with only plain decode steps): a draft the coordinator refused, or one failing throughout,
    makes a speculative row silently measure plain decoding."""
    return [n for n, m in overall.items() if not n.startswith("_") and is_service(n) and is_speculative(n)
            and "cycles" in m and not m["cycles"]]
