"""TargetService.ScoreTokens over real gRPC (the servicer on a real server in the test's process, a
tiny random model): the logits of candidate tokens after a sequence are the model's own, the greedy
token is plain decoding's, bad input gets INVALID_ARGUMENT with what is allowed, and sessions are
left as they were, including one whose cache the throwaway session evicts."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import types

import grpc
import pytest
import torch

from inprocess_target import hosted
from service_procs import tiny_model_dir
from specdec import errors
from specdec.generation.equality import tie_threshold
from specdec.models.loader import load_model
from specdec.rpc import target_pb2
from specdec.sampling.params import SamplingParams
from target_service.servicer import TargetServicer

PROMPT = [1, 5, 9, 12, 5, 9, 33, 7]
CONTEXT = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)


def _next_logits(target_dir, tokens: list[int]) -> torch.Tensor:
    model = load_model(target_dir, backend="native", num_slots=1, max_context=CONTEXT)
    slot = model.allocate()
    return model.forward([slot], [tokens], [1])[0][-1].float()


async def test_scores_are_the_models_logits_and_the_greedy_token_plain_decodings(target_dir):
    want = _next_logits(target_dir, PROMPT)
    candidates = [0, 3, int(want.argmax()), 255]
    async with hosted(target_dir, TargetServicer, num_slots=1, max_context=CONTEXT) as (target, _):
        logits, greedy = await target.score_tokens(PROMPT, candidates)
        assert logits == pytest.approx(want[candidates].tolist(), abs=1e-5)
        assert greedy == int(want.argmax())
        # The same token a session's plain decoding commits after the prompt.
        _, first = await target.start_session("s", PROMPT, SamplingParams())
        assert first == greedy


async def test_scoring_on_a_full_target_waits_in_line_for_a_slot(target_dir):
    """Every slot held by a session in mid-turn: asked not to wait, ScoreTokens is refused at once;
    asked to wait (the canary's re-scoring, which would otherwise leave the divergence unscored), it
    runs once the session's turn ends, and evicts nothing before."""
    want = _next_logits(target_dir, PROMPT)
    async with hosted(target_dir, TargetServicer, num_slots=1, max_context=CONTEXT) as (target, servicer):
        servicer.engine.evict_after_s = 60.0
        position, _ = await target.start_session("mid-turn", PROMPT, SamplingParams())
        with pytest.raises(errors.CacheFull):
            await target.score_tokens(PROMPT, [1])
        waiting = asyncio.ensure_future(target.score_tokens(PROMPT, [1, 2], slot_wait_s=10.0))
        await asyncio.sleep(0.3)
        assert not waiting.done() and servicer.engine.evictions == 0
        assert await target.end_turn("mid-turn", position)
        logits, _ = await asyncio.wait_for(waiting, 5.0)
        assert logits == pytest.approx(want[[1, 2]].tolist(), abs=1e-5)


async def test_a_session_evicted_by_the_scoring_decodes_on_unchanged(target_dir):
    async with hosted(target_dir, TargetServicer, num_slots=1, max_context=CONTEXT) as (target, servicer):
        position, first = await target.start_session("s", PROMPT, SamplingParams())
        before = servicer.engine.evictions
        await target.score_tokens([2, 4, 6], [1])  # one slot: the idle session's cache is evicted
        assert servicer.engine.evictions == before + 1 and len(servicer.engine.sessions) == 1
        got = await target.decode("s", position, 3)
        want = _next_logits(target_dir, PROMPT + [first])
        assert got[0] == int(want.argmax())


@pytest.mark.parametrize("tokens, candidates, message", [
    ([], [1], "token_ids must not be empty"),
    (PROMPT, [], "1 to 64 candidate tokens"),
    (PROMPT, list(range(65)), "1 to 64 candidate tokens"),
    (PROMPT, [256], "token ids must be in [0, 256)"),
    ([1] * CONTEXT, [1], "leave no room in the context length 64"),
])
async def test_bad_input_gets_invalid_argument_and_says_what_is_allowed(target_dir, tokens, candidates, message):
    async with hosted(target_dir, TargetServicer, num_slots=2, max_context=CONTEXT) as (target, servicer):
        await target.start_session("s", PROMPT, SamplingParams())
        with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
            await target.score_tokens(tokens, candidates)
        assert [s.session_id for s in servicer.engine.sessions] == ["s"]  # no throwaway session left behind
        request = target_pb2.TargetServiceScoreTokensRequest(token_ids=tokens, candidate_token_ids=candidates)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await target._stub.ScoreTokens(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class _BaselineRouter:
    """The canary checker's view of the baseline pool: one target, described as bf16 (so that a
    divergence needs re-scoring); the target itself is real, over gRPC."""

    def __init__(self, client, batch_invariant=False):
        self.client, self.batch_invariant = client, batch_invariant

    async def choose_target(self, pool):
        return "baseline:0"

    def target(self, endpoint):
        return self.client

    def failed(self, endpoint):
        raise AssertionError(f"the replay on {endpoint} should not fail")

    async def describe(self, role, endpoint):
        description = await self.client.describe()
        return dataclasses.replace(description, model=dataclasses.replace(description.model, dtype="bfloat16",
                                                                          batch_invariant=self.batch_invariant))


class _OlderTarget(TargetServicer):
    end_turn_calls = 0

    async def ScoreTokens(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    async def EndTurn(self, request, context):
        self.end_turn_calls += 1
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


async def test_a_target_older_than_end_turn_is_asked_once(target_dir):
    """EndTurn is best effort: a target without it answers UNIMPLEMENTED, the client says not
    released, and does not ask that replica again (its slots are then kept for --evict-after)."""
    async with hosted(target_dir, _OlderTarget, num_slots=1, max_context=CONTEXT) as (target, servicer):
        position, _ = await target.start_session("s", PROMPT, SamplingParams())
        assert await target.end_turn("s", position) is False
        assert await target.end_turn("s", position) is False
        assert servicer.end_turn_calls == 1


@pytest.mark.parametrize("servicer_class, threshold, pick, result, batch_invariant", [
    (TargetServicer, 1e3, 1, "tie", False), (TargetServicer, 0.05, -1, "failed", False),
    (_OlderTarget, 1e3, 1, "unscored", False), (TargetServicer, 1e3, 1, "failed", True)],
    ids=["tie", "failed", "older-target", "batch-invariant"])
async def test_the_canary_sorts_a_bf16_divergence_by_the_targets_scores(target_dir, servicer_class, threshold, pick,
                                                                       result, batch_invariant):
    """A replayed turn that parts from plain decoding at token 3 (to the runner-up, or to the least
    likely token): a tie when the baseline target's logit gap between the two tokens there is below
    the threshold (at least a few bf16 units in the last place), a failure above it, unscored where
    the target cannot score. Batch-invariant targets (--batch-invariant) have no near-ties to allow:
    even the runner-up is a failure there, unscored."""
    from opentelemetry import trace

    from coordinator.canary_equality import EqualityChecker

    async with hosted(target_dir, servicer_class, num_slots=2, max_context=CONTEXT) as (target, _):
        checker = EqualityChecker(None, _BaselineRouter(target, batch_invariant), trace.get_tracer("test"),
                                  tie_threshold=threshold)
        reference = await checker._plain(["baseline:0"], PROMPT, 6, SamplingParams())
        logits = _next_logits(target_dir, PROMPT + reference[:3])
        other = int(logits.sort(descending=True).indices[pick])
        candidate = reference[:3] + [other, *reference[4:]]
        gap = float(logits[reference[3]] - logits[other])
        assert (gap < tie_threshold("bfloat16", logits[reference[3]], logits[other], floor=threshold)) == (pick == 1)
        record = types.SimpleNamespace(sampling=SamplingParams(), target_replica="baseline:0")
        out = await checker._compare(PROMPT, candidate, record, "s")
    assert out["result"] == result and out["divergence"] == 3
    if result != "unscored" and not batch_invariant:
        assert out["logit_gap"] == pytest.approx(gap, abs=1e-5)
