"""The benchmark's open-loop phase (specdec/bench/arrivals.py): Poisson arrivals shared by every
method, latency counted from arrival (client-side waits included), and its report. The phase running
against real services is covered by test_bench.py's end-to-end run."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import pytest

from specdec.bench import arrivals
from specdec.bench.methods import RequestResult
from specdec.bench.prompts import Prompt
from specdec.commands.bench import _rates


def test_arrivals_are_a_seeded_poisson_process_shared_by_every_method():
    offsets = arrivals.schedule(2.0, 4000, "0/2/0")
    assert offsets == arrivals.schedule(2.0, 4000, arrivals.round_seed(0, 2.0, 0))  # same seed, same instants
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    # Exponential gaps of mean 1 / rate: the mean within 10% (4 standard errors at n = 4000) and the
    # standard deviation equal to the mean, which evenly spaced or uniform gaps would not give.
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.1)
    assert arrivals.schedule(2.0, 50, arrivals.round_seed(0, 2.0, 1)) != offsets[:50]  # rounds differ
    with pytest.raises(ValueError, match="must be > 0"):
        arrivals.schedule(0.0, 3, 0)


def test_rates_flag_takes_positive_requests_per_second_only():
    assert _rates("0.2,0.5") == (0.2, 0.5)
    for bad in ("0,1", "-1", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="requests per second"):
            _rates(bad)


class _SlowRunner:
    """A method that takes `seconds` per request and records when each was sent."""

    name = "slow"

    def __init__(self, seconds: float):
        self.seconds, self.sent = seconds, []

    async def run(self, prompt, prompt_ids, max_new_tokens):
        started = time.perf_counter()
        self.sent.append(started)
        await asyncio.sleep(self.seconds)
        return RequestResult(self.name, prompt.question_id, prompt.category, [1, 2, 3], len(prompt_ids), 0.01,
                             time.perf_counter() - started, started)


def test_requests_go_out_at_their_arrival_and_a_full_client_counts_the_wait():
    prompts = [Prompt(str(i), "qa", f"q{i}") for i in range(3)]
    ids = {p.question_id: [1, 2] for p in prompts}
    runner = _SlowRunner(0.3)
    t0 = time.perf_counter()
    # Arrivals at 0, 0.1 and 0.5 s; one session at a time: the second waits for the first (0.2 s).
    results = asyncio.run(arrivals.serve(runner, prompts, ids, [0.0, 0.1, 0.5], 1, 8))
    by_id = {r.question_id: r for r in results}
    arrived = [by_id[str(i)].start_s - t0 for i in range(3)]
    assert arrived == [pytest.approx(t, abs=0.05) for t in (0.0, 0.1, 0.5)]  # arrival, not send
    assert runner.sent[1] - t0 == pytest.approx(0.3, abs=0.05)  # sent when the first ended
    assert by_id["1"].client_wait_s == pytest.approx(0.2, abs=0.05)
    assert by_id["1"].e2e_s == pytest.approx(0.5, abs=0.05)  # the wait counts in its latency
    assert by_id["1"].ttft_s == pytest.approx(0.21, abs=0.05)
    assert by_id["2"].client_wait_s == pytest.approx(0.1, abs=0.05)  # arrived at 0.5, slot free at 0.6
    assert by_id["0"].client_wait_s == pytest.approx(0.0, abs=0.02)


def test_the_report_gives_latency_from_arrival_against_plain_at_the_same_rate():
    def request(method, start, e2e, wait=0.0, rnd=0):
        return RequestResult(method, "q", "c", list(range(11)), 3, 0.5, e2e, start_s=start, phase="arrival",
                             rate=0.5, round=rnd, client_wait_s=wait)

    # The same arrivals at 0 and 2 s; plain takes 4 s a request, speculation 2 s.
    plain = [request("plain", 0.0, 4.0), request("plain", 2.0, 4.0, wait=0.5)]
    spec = [request("specdec-draft", 10.0, 2.0), request("specdec-draft", 12.0, 2.0)]
    table = arrivals.report(plain + spec, ["plain", "specdec-draft"])["0.5"]
    assert table["plain"]["achieved_rate"] == pytest.approx(2 / 6)  # first arrival to last end
    assert table["specdec-draft"]["achieved_rate"] == pytest.approx(2 / 4)
    assert table["plain"]["mean_in_flight"] == pytest.approx(8 / 6)
    assert table["plain"]["waited_share"] == 0.5 and table["plain"]["client_wait_mean_s"] == 0.25
    assert table["specdec-draft"]["e2e_mean_vs_plain"] == pytest.approx(0.5)
    assert table["specdec-draft"]["throughput_vs_plain"] == pytest.approx(6 / 4)
    assert "e2e_mean_vs_plain" not in table["plain"]
    # Other phases' requests are not counted.
    other = RequestResult("plain", "q", "c", [1], 3, 0.1, 0.1, phase="concurrency", concurrency=2)
    assert arrivals.report([other], ["plain"]) == {}


def test_outputs_under_load_are_checked_against_plain_decoding_alone():
    """The concurrency and open-loop phases report each method's share of outputs equal to plain
    decoding's at batch 1, and the printed tables warn where one differs."""
    from specdec.bench.output import _lossless_under_load, tables

    def request(method, tokens, phase="arrival"):
        return RequestResult(method, "q1", "c", tokens, 3, 0.1, 1.0, phase=phase, rate=0.5)

    results = [request("plain", [1, 2, 3], phase="batch1"), request("plain", [1, 2, 3]),
               request("specdec-draft", [1, 2, 3]), request("specdec-draft", [1, 2, 4])]
    section = arrivals.report(results, ["plain", "specdec-draft"])
    _lossless_under_load(results, section, arrivals.PHASE, lambda r: f"{r.rate:g}")
    assert section["0.5"]["plain"]["lossless_fraction"] == 1.0
    assert section["0.5"]["specdec-draft"]["lossless_fraction"] == 0.5
    assert section["0.5"]["specdec-draft"]["differing_prompts"] == ["q1"]
    report = {"batch1": {"overall": {}, "by_category": {}}, "arrivals": section}
    assert "WARNING arrivals 0.5 specdec-draft: 50% of outputs equal" in tables(report)
