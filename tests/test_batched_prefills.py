"""A StartSession's prefill as a row of a batched step (batch.PrefillWork): the same first token and
the same continuation as start_session alone, beside decode and verify rows, for every sampling mode;
a bad or failed prefill fails alone and leaves no session; the trimmer keeps prompts out of its step
cost and answers the admission; the target service takes the row where its backend packs."""

from __future__ import annotations

import asyncio
import random

import torch

from specdec.engine.batch import DecodeWork, PrefillWork, StartedSession, VerifyWork, run_target_batch
from specdec.engine.goodput import DraftTrimmer, run_trimmed_batch
from specdec.errors import CacheFull, ContextOverflow, InvalidArgument, SessionExists
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.types import DraftBlock

import batching_helpers
from batching_helpers import CONTEXT, one_thread, tiny_dir  # noqa: F401 (module fixtures)

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=21),
    SamplingParams(temperature=0.7, top_k=30, top_p=0.9, seed=22),
    SamplingParams(temperature=1.0, seed=23, mode=SamplingMode.GUMBEL),
]


def prompt(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(256) for _ in range(rng.randrange(2, 40)))


def test_prefills_in_a_step_equal_start_session_alone(tiny_dir):
    """New sessions prefilled beside running ones (decodes and a verify) get start_session's first
    token, and their next steps and the running sessions' results are those of sequential calls."""
    batched, alone = (batching_helpers.target_engine(tiny_dir, 16) for _ in range(2))
    rng = random.Random(0)
    for i in range(3):  # sessions already running
        for engine in (batched, alone):
            engine.start_session(f"old{i}", [5 + i, 9, 17 + i], PARAMS[i])
    prompts = {f"new{i}": prompt(rng) for i in range(6)}
    draft = DraftBlock(torch.tensor([3, 4, 5]))
    position = {f"old{i}": len(alone.committed_tokens(f"old{i}")) for i in range(3)}
    works = [PrefillWork(sid, tokens, PARAMS[i % 4]) for i, (sid, tokens) in enumerate(prompts.items())]
    works[2:2] = [DecodeWork("old0", position["old0"]), VerifyWork("old1", position["old1"], draft),
                  DecodeWork("old2", position["old2"])]
    results = run_target_batch(batched, works)
    for work, result in zip(works, results):
        if isinstance(work, PrefillWork):
            expected = alone.start_session(work.session_id, list(work.token_ids), work.params)
            assert result == StartedSession(*expected)
        elif isinstance(work, VerifyWork):
            assert result == alone.verify(work.session_id, work.position, work.draft)
        else:
            assert result == alone.decode(work.session_id, work.position, 1)
    for session_id in [*prompts, "old0", "old1", "old2"]:  # and they go on alike
        at = len(alone.committed_tokens(session_id))
        assert run_target_batch(batched, [DecodeWork(session_id, at)]) == [alone.decode(session_id, at, 1)]
        assert batched.committed_tokens(session_id) == alone.committed_tokens(session_id)


def test_a_prefill_that_fails_fails_alone_and_leaves_no_session(tiny_dir):
    engine = batching_helpers.target_engine(tiny_dir, 2)
    engine.start_session("kept", [1, 2, 3], SamplingParams())
    kept = engine.committed_tokens("kept")
    works = [PrefillWork("kept", (7, 8), SamplingParams()),  # exists: refused, the session intact
             PrefillWork("long", tuple(range(CONTEXT)), SamplingParams()),  # no room for a first token
             PrefillWork("bad", (1, 2), SamplingParams(temperature=-1.0)),
             PrefillWork("fine", (4, 5, 6), SamplingParams()),
             DecodeWork("kept", len(kept))]
    results = run_target_batch(engine, works)
    assert isinstance(results[0], SessionExists) and isinstance(results[1], ContextOverflow)
    assert isinstance(results[2], InvalidArgument)
    assert isinstance(results[3], StartedSession) and isinstance(results[4], list)
    assert engine.committed_tokens("kept") == kept + results[4]
    assert {s.session_id for s in engine.sessions} == {"kept", "fine"}
    # Both slots held by sessions in use: the prefill finds none, and no session is left behind.
    full = batching_helpers.target_engine(tiny_dir, 2)
    for session_id in ("a", "b"):
        full.start_session(session_id, [1, 2], SamplingParams())
    for state in full.sessions:
        state.in_use += 1
    [result] = run_target_batch(full, [PrefillWork("c", (3, 4), SamplingParams())])
    assert isinstance(result, CacheFull) and {s.session_id for s in full.sessions} == {"a", "b"}


def test_the_trimmer_keeps_prompts_out_of_its_step_cost_and_answers_the_admission(tiny_dir):
    engine = batching_helpers.target_engine(tiny_dir, 8)
    trimmer = DraftTrimmer(packed=True)
    for session_id in ("a", "b"):
        engine.start_session(session_id, [1, 2, 3], SamplingParams())
    decodes = [DecodeWork(s, len(engine.committed_tokens(s))) for s in ("a", "b")]
    run_trimmed_batch(engine, trimmer, [PrefillWork("p", tuple(range(1, 30)), SamplingParams()), *decodes])
    assert trimmer.cost._w == 0  # the step with a prompt taught the cost fit nothing
    trimmer.cycle_wall._verdicts[""] = (0, 64)  # as after a refusal: new sessions start refused
    results = run_trimmed_batch(engine, trimmer, [PrefillWork("q", (4, 5), SamplingParams(), drafts_elsewhere=True),
                                                  PrefillWork("r", (4, 5), SamplingParams())])
    assert [r.draft_limit for r in results] == [0, None]  # only a session that drafts elsewhere is told
    assert results[0].first_token_id == results[1].first_token_id  # the same prompt, greedy


async def test_the_target_service_batches_prefills_where_its_backend_packs(tiny_dir):
    """StartSession goes through the batcher (a prefill row) on the CPU's packed backend, and alone
    with --batch-prefills off; either way the session starts alike."""
    from specdec.observability.metrics import TargetMetrics
    from specdec.rpc import target_pb2
    from specdec.server.bootstrap import ModelExecutor
    from specdec.server.service import BatchSettings
    from target_service.servicer import TargetServicer
    from prometheus_client import CollectorRegistry

    firsts = []
    for mode, batched in (("auto", True), ("off", False)):
        engine = batching_helpers.target_engine(tiny_dir, 4)
        executor = ModelExecutor("test-model")
        registry = CollectorRegistry()
        servicer = TargetServicer(engine, executor, TargetMetrics(registry), None, 8, BatchSettings(),
                                  trim_drafts=True, batch_prefills=mode)
        assert servicer.batch_prefills is batched
        try:
            request = target_pb2.TargetServiceStartSessionRequest(session_id="s", token_ids=[3, 1, 4, 1, 5],
                                                                  sample_first_token=True)
            response = await servicer.StartSession(request, None)
            firsts.append((response.position, response.first_token_id))
            await asyncio.sleep(0.01)  # the step's metrics run after its callers
            assert registry.get_sample_value("specdec_target_batch_size_count", {"step": "prefill"}) == 1
            # A batched step sets the rows gauge; a prefill run alone does not.
            assert registry.get_sample_value("specdec_target_batch_rows") == (1 if batched else 0)
        finally:
            await servicer.batcher.aclose()
            executor.shutdown()
    assert firsts[0] == firsts[1] and firsts[0][0] == 6
