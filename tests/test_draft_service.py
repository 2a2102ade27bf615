"""The draft service over real gRPC, with the target service: both as subprocesses on tiny random
models, driven by the speculative loop through TargetClient + DraftClient.

Four subprocesses start together, once for the module: the target, and drafts with a random draft
model, the target's own weights (an identical draft) and n-gram lookup. The last test kills the n-gram
draft with SIGKILL.
"""

from __future__ import annotations

import uuid

import grpc
import grpc.aio
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.client import DraftClient
from draft_service.client import connect as connect_draft
from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec import errors
from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.models.tokenizer import load_tokenizer, vocab_fingerprint
from specdec.proposers.draft_model import DraftModelProposer
from specdec.rpc import ACTUAL_POSITION_KEY, LATEST_EPOCH_KEY, LIVE_EPOCHS_KEY, common_pb2, draft_pb2, draft_pb2_grpc
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.server.settings import ClientSettings
from specdec.testing.tiny_models import TINY_EOS_ID
from target_service.client import TargetClient
from target_service.client import connect as connect_target

Code = grpc.StatusCode
GREEDY = SamplingParams()
PROMPTS = [[1, 5, 9, 12, 5, 9], [3, 3, 3, 7, 200, 31, 44, 3, 3], [17]]
PLAIN = ClientSettings(plaintext=True, timeout_s=30.0)
CONTEXT = 256
TOP_M = 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return {"target": tiny_model_dir(base, "target", seed=0), "random": tiny_model_dir(base, "draft", seed=1)}


@pytest.fixture(scope="module")
def services(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("draft-logs")
    common = ["--plaintext", "--max-context", str(CONTEXT)]

    def draft(*args):
        return launch("draft_service", [*common, *args], log_dir=logs)

    procs = {
        "target": launch("target_service", [*common, "--model", str(dirs["target"])], log_dir=logs),
        "random": draft("--proposer", "draft-model", "--model", str(dirs["random"]), "--top-m", str(TOP_M)),
        "same": draft("--proposer", "draft-model", "--model", str(dirs["target"])),
        "ngram": draft("--proposer", "ngram", "--tokenizer", str(dirs["target"]), "--ngram-max", "4"),
    }
    wait_all(*procs.values())
    yield procs
    stop_all(*procs.values())


@pytest.fixture(scope="module")
def local_target(dirs):
    return TargetEngine(load_model(dirs["target"], backend="native", num_slots=4, max_context=CONTEXT))


@pytest.fixture(scope="module")
def plain(local_target):
    """Plain decoding through LocalTarget (the reference), computed once per prompt and parameters."""
    cache: dict = {}

    async def tokens(prompt, params, max_new_tokens=30) -> list[int]:
        key = (tuple(prompt), params, max_new_tokens)
        if key not in cache:
            result = await run_generation(LocalTarget(local_target), None, prompt, params, max_new_tokens)
            cache[key] = result.token_ids
        return cache[key]

    return tokens


async def run_generation(target, draft, prompt, params, max_new_tokens=30, k=4, pipelining=False, branches=1):
    emitted: list[int] = []

    async def emit(tokens):
        emitted.extend(tokens)

    session_id = uuid.uuid4().hex
    result = await generate(target, draft, session_id, prompt, params, StopChecker(max_new_tokens, ()), emit,
                            LoopSettings(num_draft_tokens=k, pipelining=pipelining, pipeline_branches=branches))
    assert emitted == result.token_ids
    await target.end_session(session_id)
    if draft is not None:
        try:
            await draft.end_session(session_id)
        except errors.ServiceUnavailable:  # the dead-draft test
            pass
    return result


def clients(services, kind: str) -> tuple[TargetClient, DraftClient]:
    return connect_target(services["target"].address, PLAIN), connect_draft(services[kind].address, PLAIN)


# ---- lossless through the services ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "same", "ngram"])
async def test_greedy_generation_equals_plain_decoding(services, plain, kind):
    target, draft = clients(services, kind)
    async with target, draft:
        for prompt in PROMPTS:
            speculative = await run_generation(target, draft, prompt, GREEDY)
            assert speculative.token_ids == await plain(prompt, GREEDY)
            stats = speculative.stats
            assert stats.cycles > 0 and stats.fallbacks == 0
            if kind == "same":  # an identical draft is always right
                assert stats.accepted == stats.drafted


async def test_sampled_generation_equals_in_process_generation(services, local_target, plain, dirs):
    """Rejection sampling is deterministic given the proposals (counter-based randomness), so the
    same generation over gRPC and in process agree token for token only if the sparse draft
    distributions cross the wire exactly. Gumbel coupling equals plain decoding outright."""
    draft_engine = DraftEngine(DraftModelProposer(
        load_model(dirs["random"], backend="native", num_slots=2, max_context=CONTEXT), top_m=TOP_M))
    target, draft = clients(services, "random")
    async with target, draft:
        rejection = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=11)
        remote = await run_generation(target, draft, PROMPTS[0], rejection)
        local = await run_generation(LocalTarget(local_target), LocalDraft(draft_engine), PROMPTS[0], rejection)
        assert remote.token_ids == local.token_ids and remote.stats.accepted == local.stats.accepted
        gumbel = SamplingParams(temperature=0.8, seed=5, mode=SamplingMode.GUMBEL)
        remote = await run_generation(target, draft, PROMPTS[1], gumbel)
        assert remote.token_ids == await plain(PROMPTS[1], gumbel)


async def test_proposals_carry_packed_sparse_distributions(services):
    async with grpc.aio.insecure_channel(services["random"].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        for session_id, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            await stub.StartSession(draft_pb2.DraftServiceStartSessionRequest(
                session_id=session_id, token_ids=PROMPTS[0],
                sampling=common_pb2.SamplingParams(temperature=temperature, seed=3)))
        sampled = await stub.Propose(draft_pb2.DraftServiceProposeRequest(
            session_id="sampled", keep_position=len(PROMPTS[0]), num_draft_tokens=5))
        greedy = await stub.Propose(draft_pb2.DraftServiceProposeRequest(
            session_id="greedy", keep_position=len(PROMPTS[0]), num_draft_tokens=5))
        for session_id in ("sampled", "greedy"):
            await stub.EndSession(draft_pb2.DraftServiceEndSessionRequest(session_id=session_id))
    assert (sampled.epoch, sampled.position, len(sampled.draft_token_ids)) == (1, len(PROMPTS[0]), 5)
    rows = sampled.draft_distributions
    assert list(rows.row_lengths) == [TOP_M] * 5 and len(rows.token_ids) == len(rows.probs) == 5 * TOP_M
    start = 0
    for token, length in zip(sampled.draft_token_ids, rows.row_lengths):
        assert token in rows.token_ids[start:start + length]  # each token sampled from its own row
        assert sum(rows.probs[start:start + length]) == pytest.approx(1.0, abs=1e-5)
        start += length
    assert not greedy.HasField("draft_distributions") and len(greedy.draft_token_ids) == 5  # point masses


async def test_a_confidence_stop_shortens_the_draft_to_a_prefix_over_grpc(services, dirs):
    """stop_below: the block ends at the first token whose confidence product falls below it, the
    confidences travel with the block (one per token, equal to the in-process proposer's), and
    the tokens are a prefix of the unstopped draft's."""
    local = DraftEngine(DraftModelProposer(load_model(dirs["random"], backend="native", num_slots=2,
                                                      max_context=CONTEXT), top_m=TOP_M))
    prompt = PROMPTS[1]
    local.start_session("local", prompt, GREEDY)
    full = local.propose("local", len(prompt), [], 8).block
    assert len(full.confidences) == 8 and all(0.0 < c <= 1.0 for c in full.confidences)
    products = [1.0]
    for confidence in full.confidences:
        products.append(products[-1] * confidence)
    stop_below = (products[2] + products[3]) / 2  # the product falls below it at the third token
    async with connect_draft(services["random"].address, PLAIN) as draft:
        await draft.start_session("stopped", prompt, GREEDY)
        whole = (await draft.propose("stopped", len(prompt), [], 8)).block
        stopped = (await draft.propose("stopped", len(prompt), [], 8, 1, stop_below=stop_below)).block
        await draft.end_session("stopped")
    assert whole.token_ids.tolist() == full.token_ids.tolist()
    assert whole.confidences == pytest.approx(full.confidences, rel=1e-4)
    assert stopped.token_ids.tolist() == full.token_ids.tolist()[:3]
    assert stopped.confidences == pytest.approx(full.confidences[:3], rel=1e-4)


# ---- epochs, positions, pipelining ------------------------------------------------------------------


@pytest.mark.parametrize("cycle_calls", ["unary", "stream"])
async def test_propose_mismatch_reports_length_and_latest_epoch(services, cycle_calls):
    """Refused Proposes, as calls and as messages of the session's stream (ProposeStream: a refusal
    ends the stream with the call's status; the next Propose opens a new one)."""
    prompt = PROMPTS[0]
    settings = ClientSettings(plaintext=True, timeout_s=30.0, cycle_calls=cycle_calls)
    async with connect_draft(services["random"].address, settings) as draft:
        await draft.start_session("s", prompt, GREEDY)
        first = await draft.propose("s", len(prompt), [], 4)
        assert (first.epoch, first.position, first.block.num_tokens) == (1, len(prompt), 4)
        stub = draft_pb2_grpc.DraftServiceStub(draft.channel)
        for parent, keep in ((5, len(prompt) + 1), (1, len(prompt) - 1), (1, len(prompt) + 5)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Propose(draft_pb2.DraftServiceProposeRequest(
                    session_id="s", parent_epoch=parent, keep_position=keep, append_token_ids=[7]))
            assert err.value.code() == Code.FAILED_PRECONDITION
            trailing = dict(err.value.trailing_metadata())
            assert trailing[ACTUAL_POSITION_KEY] == str(len(prompt) + 4) and trailing[LATEST_EPOCH_KEY] == "1"
        with pytest.raises(errors.EpochMismatch) as epoch_err:
            await draft.propose("s", len(prompt) + 1, [7], 4, parent_epoch=9)
        assert epoch_err.value.actual == 1
        with pytest.raises(errors.PositionMismatch) as position_err:
            await draft.propose("s", len(prompt) - 1, [7], 4, parent_epoch=1)
        assert position_err.value.actual == len(prompt) + 4
        # The refusals changed nothing: the outcome of epoch 1 still applies, and drafts continue
        # exactly as in a session that never saw them.
        kept = first.block.token_ids[:2].tolist()
        second = await draft.propose("s", len(prompt) + 2, [9], 3, parent_epoch=1)
        await draft.start_session("fresh", prompt + kept + [9], GREEDY)
        fresh = await draft.propose("fresh", len(prompt) + 3, [], 3)
        assert (second.epoch, second.position) == (2, len(prompt) + 3)
        assert second.block.token_ids.tolist() == fresh.block.token_ids.tolist()
        streams = draft._cycle_streams
        assert (streams is not None and streams.answered == 3) if cycle_calls == "stream" else streams is None
        assert await draft.truncate("s", 3) == 3 and await draft.truncate("s", 50) == 3  # idempotent
        for session_id in ("s", "fresh"):
            assert await draft.end_session(session_id)


async def test_speculative_proposals_over_grpc(services):
    """speculative=true: the guess and the block after it, the refusals (INVALID_ARGUMENT for a
    malformed speculative request, FAILED_PRECONDITION for a discarded parent) and a miss that
    rolls the draft back to its parent's outcome."""
    prompt = PROMPTS[0]
    async with connect_draft(services["random"].address, PLAIN) as draft:
        await draft.start_session("spec", prompt, GREEDY)
        await draft.start_session("seq", prompt, GREEDY)
        first = await draft.propose("spec", len(prompt), [], 2)
        end = len(prompt) + 2
        stub = draft_pb2_grpc.DraftServiceStub(draft.channel)
        response = await stub.Propose(draft_pb2.DraftServiceProposeRequest(
            session_id="spec", parent_epoch=first.epoch, keep_position=end, num_draft_tokens=3, speculative=True))
        assert response.speculative and response.HasField("guessed_token_id")
        assert (response.epoch, response.parent_epoch, response.position) == (2, 1, end + 1)
        # The same block as a sequential Propose after committing the guess.
        await draft.propose("seq", len(prompt), [], 2)
        sequential = await draft.propose("seq", end, [response.guessed_token_id], 3, parent_epoch=1)
        assert list(response.draft_token_ids) == sequential.block.token_ids.tolist()
        for keep, appended, message in ((end - 1, [], "keep_position must be"), (end, [5], "appends no tokens")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Propose(draft_pb2.DraftServiceProposeRequest(
                    session_id="spec", parent_epoch=first.epoch, keep_position=keep, append_token_ids=appended,
                    speculative=True))
            assert err.value.code() == Code.INVALID_ARGUMENT and message in err.value.details()
        # A keep outside the live (but not newest) parent's span is a position refusal, not an epoch one.
        with pytest.raises(errors.PositionMismatch):
            await draft.propose("spec", len(prompt) - 1, [5], 3, parent_epoch=first.epoch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Propose(draft_pb2.DraftServiceProposeRequest(
                session_id="spec", parent_epoch=first.epoch, keep_position=len(prompt) - 1, append_token_ids=[5]))
        assert dict(err.value.trailing_metadata())[LIVE_EPOCHS_KEY] == "1,2"
        assert "span [6, 8]" in err.value.details()
        # A miss: the parent's outcome (1 accepted, then a recovered token) discards the child.
        recovered = (first.block.token_ids[1].item() + 1) % 256
        redraft = await draft.propose("spec", len(prompt) + 1, [recovered], 3, parent_epoch=first.epoch)
        assert (redraft.epoch, redraft.position) == (3, len(prompt) + 2)
        with pytest.raises(errors.EpochMismatch):  # the discarded child is not live any more
            await draft.propose("spec", end + 1, [], 3, parent_epoch=response.epoch)
        assert await draft.truncate("spec", 1000) == len(prompt) + 2 + 3  # intact after the refusal
        for session_id in ("spec", "seq"):
            await draft.end_session(session_id)


@pytest.mark.parametrize("kind", ["same", "random", "ngram"])
async def test_pipelined_generation_over_grpc_equals_plain_decoding(services, plain, kind):
    target, draft = clients(services, kind)
    async with target, draft:
        for prompt in PROMPTS[:2]:
            result = await run_generation(target, draft, prompt, GREEDY, pipelining=True)
            assert result.token_ids == await plain(prompt, GREEDY)
            stats = result.stats
            assert stats.fallbacks == 0 and stats.pipeline_hits + stats.pipeline_misses > 0
            if kind == "same":  # an identical greedy draft guesses every bonus token
                assert stats.pipeline_misses <= 1 and stats.pipeline_hits >= stats.cycles - 2
        gumbel = SamplingParams(temperature=0.8, seed=5, mode=SamplingMode.GUMBEL)
        result = await run_generation(target, draft, PROMPTS[1], gumbel, pipelining=True)
        assert result.token_ids == await plain(PROMPTS[1], gumbel)


async def test_alternative_branches_over_grpc(services, plain):
    """alternatives: repeated DraftBranch in the response, each the block a sequential Propose drafts
    after its outcome; naming one adopts it; a bad kind is INVALID_ARGUMENT; pipelined generation
    with three branches equals plain decoding (greedy and Gumbel-coupled)."""
    prompt = PROMPTS[1]
    async with connect_draft(services["random"].address, PLAIN) as draft:
        stub = draft_pb2_grpc.DraftServiceStub(draft.channel)
        await draft.start_session("alt", prompt, GREEDY)
        first = await draft.propose("alt", len(prompt), [], 3)
        end = len(prompt) + 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Propose(draft_pb2.DraftServiceProposeRequest(
                session_id="alt", parent_epoch=first.epoch, keep_position=end, speculative=True,
                alternatives=[draft_pb2.BRANCH_KIND_MAIN]))
        assert err.value.code() == Code.INVALID_ARGUMENT and "BRANCH_KIND_SECOND_GUESS" in err.value.details()
        child = await draft.propose("alt", end, [], 3, first.epoch, speculative=True,
                                    alternatives=("second_guess", "rejected_last"))
        assert [b.kind for b in child.alternatives] == ["second_guess", "rejected_last"]
        for branch in child.alternatives:
            await draft.start_session("seq", prompt, GREEDY)
            again = await draft.propose("seq", len(prompt), [], 3)
            keep = end if branch.kind == "second_guess" else end - 1
            sequential = await draft.propose("seq", keep, [branch.guessed_token_id], 3, again.epoch)
            assert (sequential.position, sequential.block.token_ids.tolist()) == (
                branch.position, branch.block.token_ids.tolist())
            await draft.end_session("seq")
        adopted = child.alternatives[1]
        # Keep one token of the adopted branch: greedy drafting goes on with the branch's own tokens.
        after = await draft.propose("alt", adopted.position + 1, [], 2, parent_epoch=adopted.epoch)
        assert (after.position, after.block.token_ids.tolist()) == (
            adopted.position + 1, adopted.block.token_ids.tolist()[1:])
        with pytest.raises(errors.EpochMismatch):  # the main branch went when its sibling was adopted
            await draft.propose("alt", child.position, [], 2, parent_epoch=child.epoch)
        await draft.end_session("alt")
    for kind in ("random", "ngram"):
        target, draft = clients(services, kind)
        async with target, draft:
            for prompt in PROMPTS[:2]:
                result = await run_generation(target, draft, prompt, GREEDY, pipelining=True, branches=3)
                assert result.token_ids == await plain(prompt, GREEDY)
                assert result.stats.fallbacks == 0 and result.stats.pipeline_hits + result.stats.pipeline_misses > 0
            gumbel = SamplingParams(temperature=0.8, seed=5, mode=SamplingMode.GUMBEL)
            result = await run_generation(target, draft, PROMPTS[1], gumbel, pipelining=True, branches=3)
            assert result.token_ids == await plain(PROMPTS[1], gumbel)


# ---- bad input -----------------------------------------------------------------------------------


def _start(session_id="bad", tokens=PROMPTS[0], options=None, **sampling):
    return "StartSession", draft_pb2.DraftServiceStartSessionRequest(
        session_id=session_id, token_ids=tokens, sampling=common_pb2.SamplingParams(**sampling),
        options=options or draft_pb2.ProposerOptions())


BAD_INPUT = {
    "empty-tokens": (_start(tokens=[]), Code.INVALID_ARGUMENT, "must not be empty"),
    "token-out-of-vocab": (_start(tokens=[1, 300]), Code.INVALID_ARGUMENT, "in [0, 256)"),
    "past-context": (_start(tokens=[5] * (CONTEXT + 1)), Code.INVALID_ARGUMENT, "context length 256"),
    "top-p-zero": (_start(top_p=0.0), Code.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    "negative-top-k": (_start(top_k=-2), Code.INVALID_ARGUMENT, "top_k must be >= 0"),
    "default-k-above-max": (_start(options=draft_pb2.ProposerOptions(num_draft_tokens=17)), Code.INVALID_ARGUMENT,
                            "in [0, 16]"),
    "other-top-m": (_start(options=draft_pb2.ProposerOptions(top_m=5)), Code.INVALID_ARGUMENT,
                    f"0 (the server default) or {TOP_M}"),
    "session-taken": (_start(session_id="victim"), Code.ALREADY_EXISTS, "already exists"),
    "k-above-max": (("Propose", {"num_draft_tokens": 17}), Code.INVALID_ARGUMENT, "in [0, 16]"),
    "negative-k": (("Propose", {"num_draft_tokens": -1}), Code.INVALID_ARGUMENT, "in [0, 16]"),
    "append-out-of-vocab": (("Propose", {"append_token_ids": [999]}), Code.INVALID_ARGUMENT, "in [0, 256)"),
    "stop-below-one": (("Propose", {"stop_below": 1.0}), Code.INVALID_ARGUMENT, "stop_below must be in [0, 1)"),
    "stop-below-negative": (("Propose", {"stop_below": -0.5}), Code.INVALID_ARGUMENT, "stop_below must be in [0, 1)"),
    "stop-below-nan": (("Propose", {"stop_below": float("nan")}), Code.INVALID_ARGUMENT, "got nan"),
    "unknown-session": (("Propose", {"session_id": "nobody"}), Code.NOT_FOUND, "'nobody' is unknown"),
    "truncate-to-zero": (("Truncate", {"position": 0}), Code.INVALID_ARGUMENT, "must be >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
async def test_bad_input_is_refused_and_other_sessions_are_unaffected(services, case):
    (method, request), code, message = BAD_INPUT[case]
    prompt = PROMPTS[0]
    async with connect_draft(services["random"].address, PLAIN) as draft:
        await draft.start_session("bystander", prompt, GREEDY)
        await draft.start_session("victim", prompt, GREEDY)
        if isinstance(request, dict):
            fields = {"session_id": "victim", "keep_position": len(prompt), **request}
            if method == "Truncate":
                fields.pop("keep_position")
            request = getattr(draft_pb2, f"DraftService{method}Request")(**fields)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(draft_pb2_grpc.DraftServiceStub(draft.channel), method)(request, timeout=10)
        assert err.value.code() == code, err.value.details()
        assert message in err.value.details()
        expected = (await draft.propose("bystander", len(prompt), [], 3)).block.token_ids.tolist()
        victim = await draft.propose("victim", len(prompt), [], 3)
        assert (victim.epoch, victim.block.token_ids.tolist()) == (1, expected)
        for session_id in ("bystander", "victim"):
            await draft.end_session(session_id)


# ---- info, health, reflection, metrics ---------------------------------------------------------------


async def test_get_info_health_reflection_and_metrics(services, dirs):
    fingerprint = vocab_fingerprint(load_tokenizer(dirs["target"]))
    async with connect_draft(services["random"].address, PLAIN) as draft:
        info = await draft.describe()
        stub = reflection_pb2_grpc.ServerReflectionStub(draft.channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in responses for s in r.list_services_response.service}
    assert "specdec.v1.DraftService" in names and "grpc.health.v1.Health" in names
    assert (info.proposer, info.max_draft_tokens, info.vocab_fingerprint) == ("draft-model", 16, fingerprint)
    assert (info.model.architecture, info.model.vocab_size, info.model.max_context) == ("llama", 256, CONTEXT)
    assert info.eos_token_ids == (TINY_EOS_ID,) and info.num_slots == 8
    async with connect_draft(services["ngram"].address, PLAIN) as draft:
        ngram = await draft.describe()
        assert await draft.info() is None  # no weights, as LocalDraft.info() says
    assert (ngram.proposer, ngram.vocab_fingerprint, ngram.eos_token_ids) == ("ngram", fingerprint, (TINY_EOS_ID,))
    for name in ("random", "ngram"):
        assert services[name].serving()
    text = services["random"].metrics()
    for metric in ('specdec_draft_proposed_tokens_total{proposer="draft-model"}',
                   'specdec_draft_step_seconds_count{proposer="draft-model",step="propose"}',
                   "specdec_draft_sessions", "specdec_draft_sessions_in_turn", "specdec_draft_kv_cache_slots_total 8.0"):
        assert metric in text, metric


# ---- a dead draft (last: kills the n-gram service) -----------------------------------------------------


async def test_killed_draft_means_plain_decoding_with_the_same_output(services, plain):
    services["ngram"].kill()
    target, draft = clients(services, "ngram")
    async with target, draft:
        with pytest.raises(errors.ServiceUnavailable):
            await draft.start_session("after-kill", PROMPTS[1], GREEDY)
        result = await run_generation(target, draft, PROMPTS[1], GREEDY)
    assert result.token_ids == await plain(PROMPTS[1], GREEDY) and result.stats.fallbacks >= 1


async def test_every_cycle_is_split_into_model_time_and_overhead(services, plain):
    """Both services report their model time (ServerTiming); the loop's per-cycle accounting adds
    it up and calls the rest overhead."""
    target, draft = clients(services, "random")
    async with target, draft:
        result = await run_generation(target, draft, PROMPTS[0], GREEDY)
    stats = result.stats
    assert result.token_ids == await plain(PROMPTS[0], GREEDY)
    assert stats.timed_cycles == stats.cycles + stats.decode_steps > 0
    assert stats.draft_model_seconds > 0 and stats.target_model_seconds > 0
    # Model time is part of each call's wall time, which is part of the cycle's.
    assert stats.draft_model_seconds < stats.draft_seconds
    assert stats.target_model_seconds < stats.verify_seconds + stats.decode_seconds
    assert 0 < stats.overhead_seconds < stats.cycle_seconds
