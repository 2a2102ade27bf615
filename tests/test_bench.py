"""`specdec bench` end to end on tiny models (a smoke test: it runs and reports, no speed claims),
the replay proposer's losslessness, and the benchmark's pure pieces."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from service_procs import REPO
from specdec.bench.prompts import Prompt, load_prompts, select_prompts
from specdec.bench.report import expected_tokens, ideal_speedup, lossless
from specdec.bench.methods import RequestResult


def test_bench_runs_end_to_end_and_writes_the_report_and_the_plot(models, tmp_path):
    target, draft = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t, "second turn"]}) + "\n"
                               for i, c, t in ((1, "qa", "Why is the sea salty?"),
                                               (2, "writing", "Write two lines about the sea, the sea."))))
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", str(target), "--draft", str(draft),
         "--prompts", str(prompts), "--max-new-tokens", "12", "--threads", "1", "--concurrency", "1,2",
         "--concurrency-prompts", "2", "--timing-repeats", "1", "--k-policy", "fixed:4,2,server",
         "--arrival-rate", "20", "--arrival-requests", "3", "--arrival-max-sessions", "2",
         "--draft-arg=--session-ttl=900", "--no-progress", "--out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    meta = report["meta"]
    for key in ("machine", "code", "models", "dtype", "threads", "prompts", "sampling", "draft_length_policy", "runs"):
        assert key in meta, key
    assert meta["prompts"]["count"] == 2 and meta["code"]["commit"]
    assert meta["extra_service_flags"]["draft"] == ["--session-ttl=900"]  # every draft service took it
    assert meta["models"]["target"]["parameters"] > 0
    from specdec.models.step_threads import usable_cores  # the target's forwards on every usable core
    assert meta["target_step_threads"] == (None if usable_cores() == 1 else
                                           {"narrow": 1, "wide": usable_cores(), "wide_from_tokens": 1})
    overall = report["batch1"]["overall"]
    assert set(overall) >= {"plain", "plain-inproc", "hf-greedy", "hf-assisted", "hf-pld", "specdec-ngram",
                            "specdec-draft"}
    for name in ("specdec-ngram", "specdec-draft", "hf-assisted", "hf-pld"):
        m = overall[name]
        for key in ("tokens_per_s", "ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "speedup",
                    "acceptance_rate", "mean_accepted_length", "acceptance_by_position"):
            assert m[key] is not None, (name, key)
        assert m["lossless_fraction"] == 1.0, name  # greedy, fp32: token for token
    for name in ("specdec-ngram", "specdec-draft"):
        assert {"ideal", "efficiency", "cost_ratio_c"} <= set(overall[name])
        assert overall[name]["pipeline_hit_rate"] is None  # sequential cycles
    for name in ("specdec-ngram-pipelined", "specdec-draft-pipelined"):
        assert overall[name]["lossless_fraction"] == 1.0, name
        assert 0.0 <= overall[name]["pipeline_hit_rate"] <= 1.0, name
    # --k-policy fixed:4,2,server: k = 4 keeps the plain names, k = 2 and the server policy are methods.
    assert {"specdec-ngram@k2", "specdec-draft@k2", "specdec-ngram@server", "specdec-draft@server"} <= set(overall)
    assert overall["specdec-draft@k2"]["mean_drafted_per_cycle"] <= 2
    for name in ("plain", "specdec-ngram", "specdec-draft", "specdec-draft@k2", "specdec-draft@server"):
        m = overall[name]  # per-cycle cost: the services report model time, the rest is overhead
        assert m["target_model_s_per_cycle"] > 0 and 0 < m["overhead_fraction"] < 1, name
        assert m["cycle_s"] >= m["overhead_s_per_cycle"] + m["target_model_s_per_cycle"] - 1e-9, name
    assert overall["specdec-draft"]["draft_model_s_per_cycle"] > 0
    assert "overhead/cycle" in result.stdout
    assert set(report["batch1"]["by_category"]) == {"qa", "writing"}
    assert {"t_step", "t_verify", "t_draft"} <= set(overall["_step_times"])
    assert report["concurrency"]["2"]["plain"]["requests"] == 2
    # The open-loop phase: 3 arrivals at 20/s with 2 sessions at most, every service method.
    arrival = report["arrivals"]["20"]
    assert arrival["plain"]["requests"] == 3 and arrival["specdec-draft"]["requests"] == 3
    assert arrival["specdec-draft"]["e2e_mean_vs_plain"] > 0 and arrival["plain"]["mean_in_flight"] > 0
    assert report["meta"]["arrivals"]["max_sessions"] == 2 and "done/s" in result.stdout
    for part, level in (("concurrency", "2"), ("arrivals", "20")):  # batched with others, as alone
        for name, m in report[part][level].items():
            assert m["lossless_fraction"] == 1.0 and m["lossless_checked"] >= 2, (part, name)
    arrived = [r for r in report["requests"] if r["phase"] == "arrival" and r["method"] == "plain"]
    assert min(r["client_wait_s"] for r in arrived) < 1e-3  # the first arrival found a free session
    # The target's batched steps during each method's run at 2 sessions: 2 requests of 12 tokens,
    # 11 plain steps each (the first token comes with the prefill), in steps of 1 or 2 rows.
    plain_batches = report["concurrency"]["2"]["plain"]["target_batches"]
    assert 11 <= plain_batches["steps"] <= 22 and 1.0 <= plain_batches["rows_per_step"] <= 2.0
    assert plain_batches["tokens_per_step"] >= plain_batches["rows_per_step"]
    assert "rows/step" in result.stdout
    assert report["requests"] and all(r["num_tokens"] >= 1 for r in report["requests"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup" in result.stdout


def test_replay_proposer_is_lossless_and_accepts_what_alpha_says(models):
    from specdec.engine.draft import DraftEngine
    from specdec.engine.local import LocalDraft, LocalTarget
    from specdec.engine.target import TargetEngine
    from specdec.generation.loop import generate
    from specdec.generation.session import LoopSettings
    from specdec.generation.stopping import StopChecker
    from specdec.models.loader import load_model
    from specdec.proposers.replay import ReplayProposer
    from specdec.sampling.params import SamplingParams

    target_dir, draft_dir = models
    target = TargetEngine(load_model(target_dir, num_slots=2))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]

    def run(proposer, prompt, n=40):
        draft = LocalDraft(DraftEngine(proposer)) if proposer else None
        settings = LoopSettings(num_draft_tokens=4)

        async def ignore(tokens):
            pass

        result = asyncio.run(generate(LocalTarget(target), draft, f"s{id(proposer)}-{prompt[0]}", prompt,
                                      SamplingParams(), StopChecker(n), ignore, settings))
        target.end_session(f"s{id(proposer)}-{prompt[0]}")
        return result

    plain = [run(None, p).token_ids for p in prompts]
    references = [p + out for p, out in zip(prompts[:1], plain[:1])]  # the second prompt has none
    for alpha in (0.0, 0.6, 1.0):
        proposer = ReplayProposer(load_model(draft_dir, num_slots=2), references, alpha, seed=3)
        for prompt, expected in zip(prompts, plain):
            result = run(proposer, prompt)
            assert result.token_ids == expected, alpha
            if prompt is prompts[0]:
                stats = result.stats
                if alpha == 1.0:
                    assert stats.accepted == stats.drafted > 0
                elif alpha == 0.0:
                    assert stats.accepted == 0 and stats.drafted > 0
                else:
                    assert 0 < stats.accepted < stats.drafted


def test_prompt_selection_is_round_robin_over_categories():
    prompts = [Prompt(str(i), c, f"t{i}") for i, c in enumerate("aaabbc")]
    assert [p.question_id for p in select_prompts(prompts, per_category=2)] == ["0", "3", "5", "1", "4"]
    assert [p.question_id for p in select_prompts(prompts, limit=4)] == ["0", "3", "5", "1"]
    assert [p.category for p in select_prompts(prompts, categories=["b"])] == ["b", "b"]
    with pytest.raises(Exception, match="unknown categories"):
        select_prompts(prompts, categories=["z"])
    default = load_prompts()
    assert len({p.category for p in default}) == 13 and len(default) >= 26


def test_ideal_speedup_follows_the_formula():
    times = {"t_step": 0.04, "t_verify": {"1": 0.04, "2": 0.05, "3": 0.055, "4": 0.06, "5": 0.07},
             "t_draft": {"draft-model": 0.002}}
    # Every cycle drafted 4 tokens: the cycle mix equals the closed form with E from the counts.
    m = {"acceptance_rate": 0.5, "mean_drafted_per_cycle": 4.0, "drafted_by_position": [10, 10, 10, 10],
         "cycles": 10, "accepted": 20, "decode_steps": 0}
    out = ideal_speedup(m, times, "draft-model", 4)
    assert out["ideal"] == pytest.approx(expected_tokens(0.5, 4) * 0.04 / (4 * 0.002 + 0.07))
    assert out["ideal_cycle_mix"] == pytest.approx(30 * 0.04 / (10 * (4 * 0.002 + 0.07)))
    assert expected_tokens(1.0, 4) == 5.0


def test_lossless_fraction_compares_token_for_token():
    def r(method, qid, tokens):
        return RequestResult(method, qid, "c", tokens, 3, 0.1, 1.0)

    ref = [r("plain", "1", [1, 2, 3]), r("plain", "2", [4, 5])]
    out = lossless([r("x", "1", [1, 2, 3]), r("x", "2", [4, 6])], ref)
    assert out["lossless_fraction"] == 0.5 and out["differing_prompts"] == ["2"]


def test_delay_proxy_relays_bytes_and_holds_them(tmp_path):
    echo = socket.socket()
    echo.bind(("127.0.0.1", 0))
    echo.listen(1)

    def serve():
        conn, _ = echo.accept()
        while data := conn.recv(4096):
            conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    control, ready = tmp_path / "delay", tmp_path / "ready.json"
    control.write_text("5")
    proc = subprocess.Popen([sys.executable, "-m", "specdec.bench.delay_proxy", "--control", str(control),
                             "--ready-file", str(ready), "--route", f"127.0.0.1:0=127.0.0.1:{echo.getsockname()[1]}"],
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not ready.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        host, port = json.loads(ready.read_text())["listen"][0].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            started = time.perf_counter()
            sock.sendall(b"hello")
            got = b""
            while len(got) < 5:
                got += sock.recv(16)
            elapsed = time.perf_counter() - started
        assert got == b"hello"
        assert elapsed >= 0.010  # 5 ms each way, at least
    finally:
        proc.kill()
        proc.wait()


def test_a_speculative_method_that_never_speculated_is_flagged():
    from specdec.bench.output import did_not_speculate

    overall = {"plain": {"cycles": 0}, "specdec-draft": {"cycles": 0, "decode_steps": 127},
               "specdec-ngram": {"cycles": 40}, "hf-assisted": {}, "_step_times": {}}
    assert did_not_speculate(overall) == ["specdec-draft"]


def test_a_replay_draft_hosted_by_the_target_accepts_what_alpha_says(models, tmp_path):
    """specdec-replay-target: the target service hosts the draft and replays the target's greedy
    tokens with probability alpha (bench/replay_target.py), next to the draft service's replay.
    With --replay-alpha-spread 0.1 the two prompts replay at 0.8 and 1.0, in both services."""
    target, draft = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                               for i, t in enumerate(["Tell me a story.", "List some fruit."])))
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", str(target), "--draft", str(draft),
         "--prompts", str(prompts), "--max-new-tokens", "32", "--threads", "1", "--timing-repeats", "1",
         "--methods", "plain,specdec-replay-target", "--replay-alpha", "0.9", "--replay-alpha-spread", "0.1",
         "--ignore-eos", "--no-progress", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    overall = report["batch1"]["overall"]
    assert report["meta"]["replay"] == {"alphas": [0.9], "seed": 0, "alpha_spread": 0.1}
    for method in ("specdec-replay-0.9", "specdec-replay-target-0.9"):
        assert overall[method]["lossless_fraction"] == 1.0 and overall[method]["cycles"] > 0, method
        # The replayed tokens are the target's: the tiny random draft alone agrees with it far less.
        # A drafted token at alpha 0.8 with k = 4 is accepted 0.59 of the time on average (it needs
        # the tokens before it accepted), at 1.0 always; this seed's draws give 0.61 together.
        assert overall[method]["acceptance_rate"] > 0.5, method
        # One prompt at alpha 1.0 (every drafted token accepted), the other at 0.8 (about 30 tokens
        # drafted: all accepted with probability ~0.001).
        whole = sorted(r["stats"]["accepted"] == r["stats"]["drafted"] > 0
                       for r in report["requests"] if r["method"] == method)
        assert whole == [False, True], method
    assert list((tmp_path / "logs").glob("*replay_target*"))  # the target ran as the replay target


def test_prompt_lookup_in_the_coordinator_and_in_the_target_and_coordinator_flags(models, tmp_path):
    """specdec-ngram-local: the coordinator's own n-gram draft, no draft service; specdec-ngram-target
    and specdec-draft-target: the target's n-gram draft and hosted draft model; --coordinator-arg
    reaches every coordinator (a sequential method's requests leave pipelining to it) and the report."""
    target, draft = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Say a b a b a b."]}) + "\n")
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", str(target), "--draft", str(draft),
         "--prompts", str(prompts), "--max-new-tokens", "16", "--threads", "1", "--timing-repeats", "1",
         "--methods", "plain,specdec-ngram-local,specdec-ngram-target,specdec-draft-target",
         "--coordinator-arg=--pipelining=on",
         "--no-progress",
         "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["meta"]["extra_service_flags"] == {"target": [], "draft": [], "coordinator": ["--pipelining=on"]}
    local = report["batch1"]["overall"]["specdec-ngram-local"]
    assert local["lossless_fraction"] == 1.0 and local["cycles"] > 0
    assert local["pipeline_hit_rate"] is not None  # pipelined by the coordinator's flag, not the request
    for method in ("specdec-ngram-target", "specdec-draft-target"):
        in_target = report["batch1"]["overall"][method]
        assert in_target["lossless_fraction"] == 1.0 and in_target["cycles"] > 0, method
    assert not list((tmp_path / "logs").glob("draft_service*"))  # no draft service was started


def test_target_batches_are_read_from_the_targets_metrics():
    """Rows per batched step from the target's own metrics (prefills apart), as a difference."""
    from prometheus_client import generate_latest

    from specdec.bench import target_batches
    from specdec.observability.metrics import TargetMetrics, new_registry

    registry = new_registry(process=False)
    metrics = TargetMetrics(registry)
    before = target_batches.snapshot(generate_latest(registry).decode())
    for rows in (4, 4, 2):
        metrics.batch_size.labels("decode").observe(rows)
        metrics.tokens.labels("decode").inc(rows)
        metrics.step_latency.labels("decode").observe(0.010)
    metrics.batch_size.labels("mixed").observe(3)
    metrics.tokens.labels("mixed").inc(7)
    metrics.step_latency.labels("mixed").observe(0.030)
    metrics.batch_size.labels("prefill").observe(1)
    metrics.tokens.labels("prefill").inc(300)
    metrics.step_latency.labels("prefill").observe(1.0)
    counts: dict = {}
    target_batches.add_difference(counts, before, target_batches.snapshot(generate_latest(registry).decode()))
    summary = target_batches.summary(counts)
    assert summary.pop("step_ms") == pytest.approx(15.0)  # (3 x 10 + 30) / 4 steps, the prefill apart
    by_kind = summary.pop("step_ms_by_kind")
    assert by_kind.keys() == {"decode", "mixed"}
    assert by_kind["decode"]["steps"] == 3 and by_kind["decode"]["step_ms"] == pytest.approx(10.0)
    assert by_kind["mixed"]["steps"] == 1 and by_kind["mixed"]["step_ms"] == pytest.approx(30.0)
    assert summary == {"steps": 4, "rows_per_step": 13 / 4, "tokens_per_step": 17 / 4}
    # Streams drafting on the target: their steps without a verified draft, by why, and the explorations.
    before = target_batches.snapshot(generate_latest(registry).decode())
    metrics.stream_plain_steps.labels("trimmer").inc(5)
    metrics.stream_plain_steps.labels("length_rule").inc(2)
    metrics.joint_explorations.inc()
    more: dict = {}
    target_batches.add_difference(more, before, target_batches.snapshot(generate_latest(registry).decode()))
    summary = target_batches.summary(more)
    assert summary["stream_plain_steps"] == {"trimmer": 5, "length_rule": 2} and summary["joint_explorations"] == 1
    # A report written before the step seconds were read still summarises (no milliseconds).
    assert target_batches.summary({"steps": 2.0, "rows": 4.0, "tokens": 4.0}) == \
        {"steps": 2, "rows_per_step": 2.0, "tokens_per_step": 2.0}


def test_engine_timings_leave_out_a_shapes_first_forward(models):
    """A forward's first run at a context may build what later ones reuse (a CUDA graph of a new key
    bucket costs ~0.1 s against a 6 ms step): the timer runs one untimed round first, so even a single
    timed repetition is a warm one. Here the first forward of each verify size is made 200 ms slower."""
    from specdec.bench.timing import EngineTimer
    from specdec.engine.target import TargetEngine
    from specdec.models.loader import load_model

    target = TargetEngine(load_model(models[0], num_slots=2, max_context=256))
    verify, seen = target.verify, set()

    def cold_first_verify(session_id, position, block):
        if block.num_tokens not in seen:
            seen.add(block.num_tokens)
            time.sleep(0.2)
        return verify(session_id, position, block)

    target.verify = cold_first_verify
    times = EngineTimer(target, {}, max_verify=5, filler_tokens=8, repeats=1).measure("q", "c", list(range(5, 40)))
    assert seen == {1, 2, 3, 4}
    assert max(times.t_verify.values()) < 0.15


def test_the_catch_up_script_runs_on_a_cpu(tmp_path):
    """scripts/bench_draft_catch_up.py (a GPU diagnostic) still runs: every wave's line is printed."""
    env = {**os.environ, "SPECDEC_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_draft_catch_up.py"), "--model", "random:tiny-draft",
                           "--device", "cpu", "--dtype", "float32", "--max-context", "2048"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("catch-up") == 13


def test_the_draft_rows_script_runs(tmp_path):
    """scripts/bench_draft_rows.py (round 33's draft step against its rows) still runs on the shipped draft."""
    env = {**os.environ, "SPECDEC_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_draft_rows.py"), "--rows", "1", "3",
                           "--repeats", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split(":")[0].split() for line in done.stdout.splitlines()] == [
        ["rows", "1", "k", "1"], ["rows", "1", "k", "4"], ["rows", "3", "k", "1"], ["rows", "3", "k", "4"]]


def test_concurrency_ratios_are_reported_per_round():
    """Rounds rotate the method order so that a slow spell of the machine hits each method; the ratio
    of every round is reported beside the pooled one (and its range printed), so the spread shows."""
    from specdec.bench.output import _rounds
    from specdec.bench.report import concurrency_report

    def request(method, rnd, start, seconds):  # 10 tokens in `seconds`, 2 sessions, one round apart
        return RequestResult(method, "q", "c", list(range(10)), 3, 0.1, seconds, start_s=start,
                             phase="concurrency", concurrency=2, round=rnd)

    rows = [request("plain", 0, 0.0, 1.0), request("plain", 0, 0.0, 1.0),  # 20 tokens / 1 s
            request("specdec-draft", 0, 2.0, 2.0), request("specdec-draft", 0, 2.0, 2.0),  # 20 / 2 s: 0.5
            request("plain", 1, 10.0, 2.0), request("plain", 1, 10.0, 2.0),  # a slow spell: 20 / 2 s
            request("specdec-draft", 1, 13.0, 2.0), request("specdec-draft", 1, 13.0, 2.0)]  # 1.0
    m = concurrency_report(rows, ["plain", "specdec-draft"])["2"]["specdec-draft"]
    assert m["throughput_vs_plain_by_round"] == [0.5, 1.0]
    assert abs(m["throughput_vs_plain"] - 40 / 4 / (40 / 3)) < 1e-9  # pooled: tokens / summed walls
    assert _rounds(m) == "  rounds 0.50-1.00, median 0.75"


def test_throughput_while_every_worker_is_busy_leaves_out_a_rounds_tail():
    """A round is a finite batch: unequal requests leave workers idle at its end. The report gives the
    throughput up to the last request's start beside the whole round's, and the mean occupancy."""
    from specdec.bench.report import concurrency_report

    def request(method, start, seconds):  # 11 tokens: the first at start + 1 s, the rest evenly after
        return RequestResult(method, "q", "c", list(range(11)), 3, 1.0, seconds, start_s=start,
                             phase="concurrency", concurrency=2, round=0)

    # Two workers, three requests each. Plain: lockstep, 10 s each. Speculative: 6 s and 14 s pairs.
    plain = [request("plain", t, 10.0) for t in (0.0, 0.0, 10.0, 10.0, 20.0, 20.0)]
    spec = [request("specdec-draft", 0.0, 6.0), request("specdec-draft", 0.0, 14.0), request("specdec-draft", 6.0, 6.0),
            request("specdec-draft", 12.0, 6.0), request("specdec-draft", 14.0, 6.0), request("specdec-draft", 18.0, 6.0)]
    table = concurrency_report(plain + spec, ["plain", "specdec-draft"])["2"]
    assert table["plain"]["mean_occupancy"] == pytest.approx(2.0)
    assert table["specdec-draft"]["mean_occupancy"] == pytest.approx(44 / 24)  # its last request runs alone
    # Plain, up to its last start at 20 s: four requests whole; the last two's first tokens come at 21 s.
    assert table["plain"]["full_occupancy_tokens_per_s"] == pytest.approx(44 / 20)
    # Speculative, up to 18 s: four requests whole, 1 + 10 * 3/5 of the one from 14 s to 20 s, nothing
    # of the one started at 18 s.
    assert table["specdec-draft"]["full_occupancy_tokens_per_s"] == pytest.approx(51 / 18)
    assert table["specdec-draft"]["full_occupancy_vs_plain"] == pytest.approx((51 / 18) / (44 / 20))
    # One wave (every request started at once) has no such window.
    one_wave = concurrency_report([request("plain", 0.0, 10.0), request("plain", 0.0, 10.0)], ["plain"])["2"]
    assert one_wave["plain"]["full_occupancy_tokens_per_s"] is None


def test_overhead_parts_are_split_only_where_every_call_lay_on_the_cycles_path():
    """A pipelined Propose's round trip runs beside the verify: counted in the calls, it made the
    coordinator's part negative, so methods with pipelined cycles get the overhead but no split."""
    from specdec.bench.report import cycle_cost

    sequential = {"timed_cycles": 10, "cycle_seconds": 1.0, "draft_model_seconds": 0.2, "target_model_seconds": 0.7,
                  "call_seconds": 0.97, "handler_seconds": 0.93, "queued_seconds": 0.01}
    parts = cycle_cost(sequential)["overhead_parts_s_per_cycle"]
    assert parts == pytest.approx({"coordinator": 0.003, "transport": 0.004, "service_queued": 0.001,
                                   "service_other": 0.002})
    pipelined = {**sequential, "call_seconds": 1.15, "handler_seconds": 1.1, "pipeline_hits": 2, "pipeline_misses": 5,
                 "hidden_draft_model_seconds": 0.1}
    cost = cycle_cost(pipelined)
    assert "overhead_parts_s_per_cycle" not in cost
    assert cost["overhead_s_per_cycle"] == pytest.approx(0.02)  # (1.0 - 0.9 + 0.1) / 10
