"""Feeding the draft while speculation is switched off (specdec/generation/draft_feed.py).

A session whose adaptive length switched speculation off decodes plainly until its next probe; every
`feed_draft_every` plain tokens the loop hands the draft what it has not seen, in the background, so
the probe's Propose no longer prefills the whole plain run first. The output is plain decoding's
either way: first with real engines in process (where the test can watch every Propose), then with
the target and the draft as services in their own processes, over gRPC stream messages.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from service_procs import launch, stop_all, tiny_model_dir, wait_all
from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.adaptive import DraftLengthPolicy
from specdec.generation.loop import SpeculativeLoop, start_generation
from specdec.generation.session import LoopObserver, LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams
from specdec.server.settings import ClientSettings

CONTEXT = 256
PROMPT = [1, 5, 9, 12, 5, 9]
NEW_TOKENS = 110
WAIT = 16  # plain steps between switching off and the first probe


class OffPolicy(DraftLengthPolicy):
    """An adaptive length whose every verdict is "plain decoding, probe after WAIT plain steps": it
    drafts its warm-up cycles, switches off, probes after 16, 32, 64 plain steps (each failed probe
    doubles the wait), whatever the draft is worth, so the test knows when the loop decodes plainly."""

    def best_k(self) -> int:
        self._wait = WAIT
        return 0


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return {"target": tiny_model_dir(base, "target", seed=0), "draft": tiny_model_dir(base, "draft", seed=1)}


@pytest.fixture(scope="module")
def plain_tokens(dirs):
    engine = TargetEngine(load_model(dirs["target"], backend="native", num_slots=2, max_context=CONTEXT))
    return engine, _plain(engine)


def _plain(engine: TargetEngine) -> list[int]:
    async def go():
        target = LocalTarget(engine)
        cursor, first = await start_generation(target, "plain", PROMPT, SamplingParams())
        result = await SpeculativeLoop(target, None).run(cursor, StopChecker(NEW_TOKENS - 1, ()), _ignore)
        await target.end_session("plain")
        return [first, *result.token_ids]

    return asyncio.run(go())


async def _ignore(tokens):
    pass


class FeedCounter(LoopObserver):
    def __init__(self):
        self.fed = 0

    def fed_draft(self) -> None:
        self.fed += 1


class WatchedDraft(LocalDraft):
    """A real draft engine that records what each Propose appended, and may fail the feeds."""

    def __init__(self, engine: DraftEngine, fail_feeds: bool = False):
        super().__init__(engine)
        self.appended: list[int] = []  # tokens each Propose appended (the draft's catch-up)
        self.started = 0
        self.fail_feeds = fail_feeds
        self.loop: SpeculativeLoop | None = None

    async def start_session(self, session_id, token_ids, params) -> None:
        self.started += 1
        await super().start_session(session_id, token_ids, params)

    async def propose(self, session_id, keep_position, append_token_ids, num_draft_tokens, *args, **kwargs):
        if self.fail_feeds and self.loop is not None and self.loop.policy.switched_off:
            raise ConnectionError("the draft is unreachable")
        self.appended.append(len(append_token_ids))
        return await super().propose(session_id, keep_position, append_token_ids, num_draft_tokens, *args, **kwargs)


async def generate_switched_off(target, draft, every: int, session_id: str) -> tuple[list[int], SpeculativeLoop]:
    cursor, first = await start_generation(target, session_id, PROMPT, SamplingParams(), drafts_elsewhere=True)
    loop = SpeculativeLoop(target, draft, LoopSettings(num_draft_tokens=4, adaptive=True, feed_draft_every=every),
                           FeedCounter())
    loop.policy = OffPolicy(4, 8)
    if isinstance(draft, WatchedDraft):
        draft.loop = loop
    result = await loop.run(cursor, StopChecker(NEW_TOKENS - 1, ()), _ignore)
    return [first, *result.token_ids], loop


@pytest.mark.parametrize("every", [0, 8])
async def test_a_switched_off_session_feeds_the_draft_and_its_probes_prefill_little(dirs, plain_tokens, every):
    engine, plain = plain_tokens
    draft = WatchedDraft(DraftEngine(DraftModelProposer(
        load_model(dirs["draft"], backend="native", num_slots=2, max_context=CONTEXT))))
    session_id = uuid.uuid4().hex
    tokens, loop = await generate_switched_off(LocalTarget(engine), draft, every, session_id)
    assert tokens == plain  # lossless: the feeds change what the draft holds, never the output
    assert engine.committed_tokens(session_id) == PROMPT + tokens
    engine.end_session(session_id)
    probes_and_feeds = draft.appended[4:]  # after the warm-up cycles and the switch-off verdicts
    if every:
        assert loop.feed.feeds >= 8  # 16 + 32 + 64 plain tokens, one feed every 8
        assert loop.observer.fed == loop.feed.feeds  # the coordinator's specdec_coordinator_draft_feeds_total
        # No Propose caught up on more than a feed's worth (8 tokens, and the probe's own last token).
        assert max(probes_and_feeds) <= every + 1
    else:
        assert loop.feed.feeds == 0
        assert max(probes_and_feeds) >= WAIT  # the probe prefilled the whole plain run
    assert draft.engine.sessions.get(session_id).committed <= len(PROMPT) + len(tokens)


async def test_a_failing_feed_never_fails_the_request_and_the_next_probe_reopens_the_draft(dirs, plain_tokens):
    engine, plain = plain_tokens
    draft = WatchedDraft(DraftEngine(DraftModelProposer(
        load_model(dirs["draft"], backend="native", num_slots=2, max_context=CONTEXT))), fail_feeds=True)
    session_id = uuid.uuid4().hex
    tokens, loop = await generate_switched_off(LocalTarget(engine), draft, 8, session_id)
    assert tokens == plain
    assert loop.feed.feeds >= 3 and draft.started >= 2  # each probe after a failed feed reopened the session
    engine.end_session(session_id)


@pytest.fixture(scope="module")
def services(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("feed-logs")
    common = ["--plaintext", "--max-context", str(CONTEXT), "--num-slots", "4"]
    procs = [launch("target_service", [*common, "--model", str(dirs["target"])], log_dir=logs),
             launch("draft_service", [*common, "--model", str(dirs["draft"])], log_dir=logs)]
    wait_all(*procs)
    yield procs
    stop_all(*procs)


async def test_through_the_services_the_feeds_keep_the_draft_current_and_the_output_plain(services, plain_tokens):
    """The target and draft services in their own processes, the cycle calls as stream messages: the
    feeds run as background tasks on the session's Propose stream, in order with its cycles."""
    from draft_service.client import connect as connect_draft
    from target_service.client import connect as connect_target

    _, plain = plain_tokens
    settings = ClientSettings(plaintext=True, timeout_s=30.0, cycle_calls="stream")
    async with connect_target(services[0].address, settings) as target, \
            connect_draft(services[1].address, settings) as draft:
        for every in (8, 0):
            session_id = uuid.uuid4().hex
            tokens, loop = await generate_switched_off(target, draft, every, session_id)
            assert tokens == plain, every
            assert (loop.feed.feeds > 0) == (every > 0)
            await target.end_session(session_id)
            await draft.end_session(session_id)


def test_the_coordinator_flag_sets_the_feed_interval():
    import argparse

    from coordinator.settings import add_arguments, settings_from_args
    from specdec.server.settings import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser, environ={})
    base = ["--plaintext", "--tokenizer", "t", "--redis-url", "redis://x", "--target-plaintext", "--draft-plaintext"]
    assert settings_from_args(parser.parse_args(base)).feed_draft_every == 0  # off unless asked for
    assert settings_from_args(parser.parse_args(base + ["--feed-draft-every", "8"])).feed_draft_every == 8
    with pytest.raises(ConfigError, match="--feed-draft-every must be >= 0"):
        settings_from_args(parser.parse_args(base + ["--feed-draft-every", "-1"]))
