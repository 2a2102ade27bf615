"""The canary's equality replay where the baseline target it chose has no free KV slot: it starts
on another baseline target with room instead of waiting for a slot (as sessions move,
test_target_admission.py), and evicts nobody. Two in-process targets over real gRPC, the real Router."""

from __future__ import annotations

import contextlib

import pytest
from opentelemetry import trace

from coordinator.canary_equality import EqualityChecker
from coordinator.routing import Router
from inprocess_target import hosted
from service_procs import tiny_model_dir
from specdec.sampling.params import SamplingParams
from target_service.servicer import TargetServicer

PROMPT = [1, 5, 9, 12, 5, 9, 33, 7]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp(), "target", seed=0)


async def test_a_replay_moves_off_a_full_baseline_target(target_dir):
    async with contextlib.AsyncExitStack() as stack:
        full, full_servicer = await stack.enter_async_context(hosted(target_dir, TargetServicer, num_slots=1))
        spare, _ = await stack.enter_async_context(hosted(target_dir, TargetServicer, num_slots=1))
        full_servicer.engine.evict_after_s = 60.0  # a session's slot is kept a minute after its last call
        await full.start_session("mid-turn", PROMPT, SamplingParams())  # holds the only slot
        clients = {"full:0": full, "spare:0": spare}
        router = Router(clients.__getitem__, lambda endpoint: None, baseline_targets=list(clients))
        checker = EqualityChecker(None, router, trace.get_tracer("test"))
        where = ["full:0"]
        replayed = await checker._plain(where, PROMPT, 6, SamplingParams())
        assert where == ["spare:0"]
        assert router.is_full("full:0")  # the next replay or session tries the spare first
        expected = [(await spare.start_session("plain", PROMPT, SamplingParams()))[1],
                    *await spare.decode("plain", len(PROMPT) + 1, 5)]
        assert replayed == expected
        assert full_servicer.engine.evictions == 0
        assert full_servicer.engine.sessions.peek("mid-turn").slot is not None
