"""The speculative loop over local engines on tiny random models: lossless, whatever the draft."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import FinishReason, StopChecker
from specdec.models.loader import load_model
from specdec.proposers.copy_guess import CopyRule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.testing.tiny_models import make_tiny_model

VOCAB = 256
PROMPTS = [[1, 5, 9, 12, 5, 9], [3, 3, 3, 7, 200, 31, 44, 3, 3], [17]]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_model(root / "target", variant="llama", vocab_size=VOCAB, seed=0)
    other = make_tiny_model(root / "draft", variant="llama", vocab_size=VOCAB, seed=1)
    return {"target": target, "random": other}


def target_engine(path, num_slots=4) -> TargetEngine:
    return TargetEngine(load_model(path, backend="native", num_slots=num_slots, max_context=256))


def draft_engine(kind: str, dirs) -> DraftEngine | None:
    if kind == "none":
        return None
    if kind == "ngram":
        return DraftEngine(NgramProposer())
    path = dirs["target"] if kind == "same" else dirs["random"]
    # "copy": the random draft copying from the sequence wherever it can (copy_guess.py)
    copy = CopyRule(below=1.0, ngram=2) if kind == "copy" else None
    return DraftEngine(DraftModelProposer(load_model(path, backend="native", num_slots=4, max_context=256), copy=copy))


def run(target: TargetEngine, draft: DraftEngine | None, prompt, params, max_new_tokens=40, k=4, eos=(),
        settings: LoopSettings | None = None):
    emitted: list[int] = []

    async def emit(tokens):
        emitted.extend(tokens)

    session_id = uuid.uuid4().hex
    stop = StopChecker(max_new_tokens, eos)
    result = asyncio.run(generate(LocalTarget(target), LocalDraft(draft) if draft else None, session_id,
                                  prompt, params, stop, emit, settings or LoopSettings(num_draft_tokens=k)))
    assert emitted == result.token_ids
    committed = target.committed_tokens(session_id)
    assert committed == list(prompt) + result.token_ids  # the target holds exactly what was emitted
    target.end_session(session_id)
    if draft:
        draft.end_session(session_id)
    return result


def hf_greedy(path, prompt, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["random", "same", "ngram", "copy"])
def test_greedy_equals_plain_decoding(tiny_dirs, kind):
    target = target_engine(tiny_dirs["target"])
    draft = draft_engine(kind, tiny_dirs)
    greedy = SamplingParams()
    for prompt in PROMPTS:
        plain = run(target, None, prompt, greedy)
        for k in (1, 3, 5):
            spec = run(target, draft, prompt, greedy, k=k)
            assert spec.token_ids == plain.token_ids, (kind, prompt, k)
            assert spec.stats.cycles > 0
            if kind == "same":
                assert spec.stats.acceptance_rate == 1.0


def test_plain_decoding_equals_transformers_greedy(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    for prompt in PROMPTS:
        plain = run(target, None, prompt, SamplingParams(), max_new_tokens=24)
        assert plain.token_ids == hf_greedy(tiny_dirs["target"], prompt, 24)


@pytest.mark.parametrize("kind", ["random", "same", "ngram", "copy"])
def test_gumbel_sampling_equals_plain_sampling_token_for_token(tiny_dirs, kind):
    target = target_engine(tiny_dirs["target"])
    draft = draft_engine(kind, tiny_dirs)
    for seed in (0, 1, 2):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, mode=SamplingMode.GUMBEL)
        plain = run(target, None, PROMPTS[0], params)
        spec = run(target, draft, PROMPTS[0], params)
        assert spec.token_ids == plain.token_ids


def test_rejection_sampling_is_reproducible_under_a_seed(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    draft = draft_engine("random", tiny_dirs)
    params = SamplingParams(temperature=0.8, top_k=50, seed=7)
    first = run(target, draft, PROMPTS[1], params)
    second = run(target, draft, PROMPTS[1], params)
    assert first.token_ids == second.token_ids
    other = run(target, draft, PROMPTS[1], SamplingParams(temperature=0.8, top_k=50, seed=8))
    assert other.token_ids != first.token_ids


def test_eos_inside_an_accepted_block_ends_the_output_there(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    draft = draft_engine("same", tiny_dirs)  # accepts everything, so EOS lands inside a block
    plain = run(target, None, PROMPTS[0], SamplingParams(), max_new_tokens=30)
    eos = plain.token_ids[7]
    cut = plain.token_ids.index(eos) + 1
    spec = run(target, draft, PROMPTS[0], SamplingParams(), max_new_tokens=30, k=5, eos=[eos])
    assert spec.finish_reason is FinishReason.EOS
    assert spec.token_ids == plain.token_ids[:cut]


def test_max_new_tokens_is_exact(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    draft = draft_engine("same", tiny_dirs)
    for budget in (1, 2, 5, 13):
        spec = run(target, draft, PROMPTS[0], SamplingParams(), max_new_tokens=budget, k=4)
        assert len(spec.token_ids) == budget
        assert spec.finish_reason is FinishReason.LENGTH


class FlakyDraft(LocalDraft):
    """A draft that fails every third call: the output must not change."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls = 0

    async def propose(self, *args, **kwargs):
        self.calls += 1
        if self.calls % 3 == 0:
            raise ConnectionError("draft replica went away")
        return await super().propose(*args, **kwargs)


def test_failing_draft_falls_back_to_plain_decoding(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    plain = run(target, None, PROMPTS[0], SamplingParams(), max_new_tokens=40)
    engine = draft_engine("same", tiny_dirs)
    flaky = FlakyDraft(engine)
    emitted: list[int] = []

    async def emit(tokens):
        emitted.extend(tokens)

    result = asyncio.run(generate(LocalTarget(target), flaky, "s", PROMPTS[0], SamplingParams(),
                                  StopChecker(40), emit, LoopSettings(num_draft_tokens=3, retry_draft_after=2)))
    assert result.token_ids == plain.token_ids
    assert result.stats.fallbacks >= 2 and result.stats.decode_steps > 0 and result.stats.cycles > 0


class ForgetfulDraft(LocalDraft):
    """A draft that loses the session every third Propose (expired, evicted, or a draft inside
    another coordinator): the loop reopens it at once, without falling back to plain decoding."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls = 0

    async def propose(self, session_id, *args, **kwargs):
        self.calls += 1
        if self.calls % 3 == 0:
            self.engine.end_session(session_id)
        return await super().propose(session_id, *args, **kwargs)


def test_a_draft_that_lost_the_session_is_reopened_at_once(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    plain = run(target, None, PROMPTS[0], SamplingParams(), max_new_tokens=40)
    forgetful = ForgetfulDraft(draft_engine("same", tiny_dirs))

    async def emit(tokens):
        pass

    result = asyncio.run(generate(LocalTarget(target), forgetful, "s", PROMPTS[0], SamplingParams(),
                                  StopChecker(40), emit, LoopSettings(num_draft_tokens=3)))
    assert result.token_ids == plain.token_ids
    assert result.stats.fallbacks == 0 and forgetful.calls >= 6 and result.stats.decode_steps <= 1
    assert result.stats.accepted == result.stats.drafted > 0  # the same model: every reopened draft agrees


def test_sessions_survive_cache_eviction(tiny_dirs):
    """Two slots, three interleaved sessions: evicted sessions re-feed their tokens, same output."""
    target = target_engine(tiny_dirs["target"], num_slots=2)
    reference = [run(target_engine(tiny_dirs["target"]), None, p, SamplingParams(), 12).token_ids for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        target.start_session(f"s{i}", prompt, SamplingParams())
    outputs = {i: [target.committed_tokens(f"s{i}")[-1]] for i in range(3)}
    for _ in range(11):
        for i, prompt in enumerate(PROMPTS):
            position = len(prompt) + len(outputs[i])
            outputs[i] += target.decode(f"s{i}", position, 1)
    assert [outputs[i] for i in range(3)] == reference
    assert target.evictions > 0


class CountingTarget(LocalTarget):
    """LocalTarget that counts the plain runs (decode_stream calls) the loop opens."""

    def __init__(self, engine):
        super().__init__(engine)
        self.runs: list[int] = []

    def decode_stream(self, session_id, position, num_tokens, append_token_ids=(), stop_token_ids=()):
        self.runs.append(num_tokens)
        return super().decode_stream(session_id, position, num_tokens, append_token_ids, stop_token_ids)


class DeadDraft(LocalDraft):
    async def propose(self, *args, **kwargs):
        raise ConnectionError("draft replica is down")


def test_plain_steps_are_streamed_in_runs_as_long_as_the_loop_knows_them(tiny_dirs):
    """No draft: the whole budget is one run. A dead draft: one run per retry interval. Either way
    the output is plain decoding's and the target holds exactly what was emitted."""
    target = target_engine(tiny_dirs["target"])
    plain = run(target, None, PROMPTS[0], SamplingParams(), max_new_tokens=40).token_ids
    for draft, expected_runs in ((None, [39]), (DeadDraft(draft_engine("same", tiny_dirs)), [6] * 6 + [3])):
        counting, emitted = CountingTarget(target), []

        async def emit(tokens):
            emitted.extend(tokens)

        session_id = uuid.uuid4().hex
        result = asyncio.run(generate(counting, draft, session_id, PROMPTS[0], SamplingParams(), StopChecker(40),
                                      emit, LoopSettings(num_draft_tokens=3, retry_draft_after=5)))
        assert result.token_ids == emitted == plain
        assert counting.runs == expected_runs  # the first token comes from StartSession
        assert target.committed_tokens(session_id) == PROMPTS[0] + plain


@pytest.mark.parametrize("stop_kind", ["eos", "sequence"])
def test_a_stop_inside_a_plain_run_ends_it_and_the_target_keeps_only_what_was_kept(tiny_dirs, stop_kind):
    target = target_engine(tiny_dirs["target"])
    plain = run(target, None, PROMPTS[1], SamplingParams(), max_new_tokens=30).token_ids
    cut = next(i for i in range(8, 30) if plain[i] not in plain[:i])  # first occurrence, mid-run
    emitted: list[int] = []

    async def emit(tokens):
        emitted.extend(tokens)

    if stop_kind == "eos":
        stop = StopChecker(30, eos_token_ids=[plain[cut]])
    else:
        stop = StopChecker(30, stop_sequences=[f"<{plain[cut]}>"], detokenize=lambda ids: "".join(f"<{t}>" for t in ids))
    session_id = uuid.uuid4().hex
    result = asyncio.run(generate(LocalTarget(target), None, session_id, PROMPTS[1], SamplingParams(), stop, emit))
    assert result.token_ids == emitted == plain[:cut + 1]
    assert result.finish_reason == (FinishReason.EOS if stop_kind == "eos" else FinishReason.STOP_SEQUENCE)
    assert target.committed_tokens(session_id) == PROMPTS[1] + plain[:cut + 1]


class EndsFirstRunEarly(CountingTarget):
    """The first run ends after two tokens, as when another call of the session ended it."""

    def decode_stream(self, session_id, position, num_tokens, append_token_ids=(), stop_token_ids=()):
        stream = super().decode_stream(session_id, position, num_tokens, append_token_ids, stop_token_ids)
        if len(self.runs) > 1:
            return stream

        async def two():
            for _ in range(2):
                yield await anext(stream)
        return two()


def test_a_run_the_target_ends_early_is_started_again_from_the_last_token_read(tiny_dirs):
    target = target_engine(tiny_dirs["target"])
    plain = run(target, None, PROMPTS[2], SamplingParams(), max_new_tokens=12).token_ids
    counting = EndsFirstRunEarly(target)

    async def emit(tokens):
        pass

    session_id = uuid.uuid4().hex
    result = asyncio.run(generate(counting, None, session_id, PROMPTS[2], SamplingParams(), StopChecker(12), emit))
    assert result.token_ids == plain and counting.runs == [11, 9]
    assert target.committed_tokens(session_id) == PROMPTS[2] + plain


def test_with_debug_logging_a_turn_logs_its_cycles_and_the_policys_estimates(tiny_dirs, caplog):
    """SPECDEC_LOG_LEVEL=DEBUG: each turn's cycles as drafted:accepted (plain steps as "."), and the
    adaptive length's acceptance and costs at the end, to see why it switched where it did."""
    target, draft = target_engine(tiny_dirs["target"]), draft_engine("same", tiny_dirs)
    with caplog.at_level(logging.DEBUG, logger="specdec.generation.loop"):
        result = run(target, draft, PROMPTS[0], SamplingParams(), max_new_tokens=24,
                     settings=LoopSettings(num_draft_tokens=4, adaptive=True))
    lines = [r.getMessage() for r in caplog.records if "cycles (drafted:accepted" in r.getMessage()]
    assert len(lines) == 1 and "acceptance" in lines[0]
    cycles = lines[0].split(") ", 1)[1].split(";")[0].split()
    # the same weights draft: every drafted token is accepted
    assert cycles and all(c == "." or c.split(":")[0] == c.split(":")[1] for c in cycles)
    # every token but the first (the prompt's prefill gives it) came from a logged cycle
    assert sum(1 if c == "." else int(c.split(":")[1]) + 1 for c in cycles) == len(result.token_ids) - 1
