"""Pipelined cycles through the coordinator over real gRPC (the target and the drafts as real
subprocesses on tiny random models, a real Redis): the output is plain decoding's, greedy and
Gumbel-coupled; hits and misses, by branch too, agree between the turn's stats, the cycle spans and
the metrics. The rest of the coordinator is in test_coordinator.py."""

from __future__ import annotations

import re
import urllib.request

import pytest

from coordinator_harness import Reference, expected, running_coordinator, tokens_of
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec.rpc import common_pb2
from specdec.rpc import coordinator_pb2 as pb

CONTEXT = 256
PROMPTS = ["Name three colours.", "Count: 1, 2, 3"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {"target": tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)}


@pytest.fixture(scope="module")
def services(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pipelining-logs")
    procs = {
        "target": launch("target_service", ["--model", str(dirs["target"]), "--max-context", str(CONTEXT),
                                            "--plaintext"], log_dir=logs),
        "same": launch("draft_service", ["--model", str(dirs["target"]), "--plaintext"], log_dir=logs),
        "ngram": launch("draft_service", ["--proposer", "ngram", "--tokenizer", str(dirs["target"]), "--plaintext"],
                        log_dir=logs),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def reference(dirs):
    return Reference(dirs["target"], CONTEXT)


def coordinator(redis_url, dirs, services, draft: str, **kwargs):
    return running_coordinator(redis_url, dirs["target"], [services["target"].address], [services[draft].address],
                               **kwargs)


@pytest.mark.parametrize("draft", ["same", "ngram"])
async def test_pipelined_cycles_equal_plain_decoding_and_report_hits(redis_url, dirs, services, reference, draft):
    """--pipelining on: the same tokens as plain decoding, greedy and Gumbel-coupled; hits and
    misses in the turn's stats, on the cycle spans and in the metrics; a request may turn it off."""
    n = 24
    gumbel = common_pb2.SamplingParams(temperature=1.0, top_p=0.9, seed=7, mode=common_pb2.SAMPLING_MODE_GUMBEL)
    # Every turn must draft from its start here: with the warm start, a turn after one where the
    # n-gram lookup did not pay (a tiny random model) rightly starts plain and may not pipeline.
    async with coordinator(redis_url, dirs, services, draft, pipelining=True, adaptive_warm_start=False) as c:
        for prompt in PROMPTS:
            prompt_ids = reference.prompt_ids(prompt)
            messages = await c.generate(prompt=prompt, max_new_tokens=n)
            assert tokens_of(messages) == expected(reference, prompt_ids, n)
            stats = messages[-1].stats
            assert stats.fallbacks == 0 and stats.pipeline_hits + stats.pipeline_misses > 0
            if draft == "same":  # an identical greedy draft guesses every bonus token
                assert stats.pipeline_misses == 0 and stats.pipeline_hits >= stats.cycles - 2
        sequential = await c.generate(prompt=PROMPTS[0], max_new_tokens=n, speculation={"pipelined": False})
        assert tokens_of(sequential) == expected(reference, reference.prompt_ids(PROMPTS[0]), n)
        assert sequential[-1].stats.pipeline_hits == sequential[-1].stats.pipeline_misses == 0
        sampled = await c.generate(prompt=PROMPTS[0], max_new_tokens=16, sampling=gumbel)
        plain = await c.generate(prompt=PROMPTS[0], max_new_tokens=16, sampling=gumbel, pool=pb.POOL_BASELINE)
        assert tokens_of(sampled) == tokens_of(plain)
        spans = c.exporter.get_finished_spans()
        text = urllib.request.urlopen(f"http://127.0.0.1:{c.host.metrics_port}/metrics", timeout=5).read().decode()
    marked = [s.attributes["specdec.pipeline_hit"] for s in spans
              if s.name == "specdec.cycle" and "specdec.pipeline_hit" in s.attributes]
    assert marked and (True in marked or draft != "same")
    assert any(s.name == "specdec.propose_speculative" for s in spans)
    proposer = "draft-model" if draft == "same" else "ngram"
    hits = re.search(rf'specdec_coordinator_pipeline_hits_total{{pool="speculative",proposer="{proposer}"}} (\S+)',
                     text)
    misses = re.search(rf'specdec_coordinator_pipeline_misses_total{{pool="speculative",proposer="{proposer}"}} '
                       r'(\S+)', text)
    counted = (float(hits.group(1)) if hits else 0.0) + (float(misses.group(1)) if misses else 0.0)
    assert counted == len(marked)


@pytest.mark.parametrize("draft", ["same", "ngram"])
async def test_pipeline_branches_through_the_coordinator(redis_url, dirs, services, reference, draft):
    """--pipeline-branches 3: plain decoding's tokens; hits by branch in the turn's stats, on the
    cycle spans and in specdec_coordinator_pipeline_branch_hits_total, consistent with each other."""
    n = 24
    # Cold turns, as in the test above: warm, a turn on a route whose drafts do not pay (prompt lookup on
    # a tiny random model) may switch off after its first cycles, before any pipelined one.
    async with coordinator(redis_url, dirs, services, draft, pipelining=True, pipeline_branches=3,
                           adaptive_warm_start=False) as c:
        totals = {"main": 0, "second_guess": 0, "rejected_last": 0}
        for prompt in PROMPTS:
            messages = await c.generate(prompt=prompt, max_new_tokens=n)
            assert tokens_of(messages) == expected(reference, reference.prompt_ids(prompt), n)
            stats = messages[-1].stats
            assert stats.fallbacks == 0 and stats.pipeline_hits + stats.pipeline_misses > 0
            totals["second_guess"] += stats.pipeline_hits_second_guess
            totals["rejected_last"] += stats.pipeline_hits_rejected_last
            totals["main"] += stats.pipeline_hits - stats.pipeline_hits_second_guess - stats.pipeline_hits_rejected_last
        spans = c.exporter.get_finished_spans()
        text = urllib.request.urlopen(f"http://127.0.0.1:{c.host.metrics_port}/metrics", timeout=5).read().decode()
    if draft == "same":
        assert totals["main"] > 0
    on_spans = [s.attributes["specdec.pipeline_branch"] for s in spans
                if s.name == "specdec.cycle" and "specdec.pipeline_branch" in s.attributes]
    proposer = "draft-model" if draft == "same" else "ngram"
    for branch, count in totals.items():
        assert on_spans.count(branch) == count
        found = re.search(rf'specdec_coordinator_pipeline_branch_hits_total{{branch="{branch}",pool="speculative",'
                          rf'proposer="{proposer}"}} (\S+)', text) or re.search(
            rf'specdec_coordinator_pipeline_branch_hits_total{{pool="speculative",proposer="{proposer}",'
            rf'branch="{branch}"}} (\S+)', text)
        assert (float(found.group(1)) if found else 0.0) == count
