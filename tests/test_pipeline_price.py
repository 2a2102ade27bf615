"""--pipelining auto's price (specdec/generation/pipeline_price.py): speculative drafts only while
their hits save more than they slow the verify beside them. The rule alone, then the pipelined loop
over local engines whose verify slows while a speculative draft runs beside it, as a draft sharing
the target's GPU makes it (docs/BENCHMARKS.md, "Round 36"); output unchanged either way."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.pipeline_price import MIN_SAMPLES, PipelinePrice
from specdec.generation.session import LoopSettings
from specdec.generation.stopping import StopChecker
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingParams
from specdec.testing.tiny_models import make_tiny_model

PROMPT = [1, 5, 9, 12, 5, 9]


def _learn(price: PipelinePrice, cycles: int, alone_s: float, beside_s: float, propose_s: float, hit: bool) -> list[bool]:
    choices = []
    for _ in range(cycles):
        beside = price.draft_beside()
        choices.append(beside)
        price.proposed(propose_s)
        price.verified(beside_s if beside else alone_s, beside=beside, hit=hit if beside else None)
    return choices


def test_the_price_stops_drafts_that_slow_the_verify_more_than_hits_save():
    # A shared device: the verify takes 14 ms with a draft beside it, 7 ms alone; a hit saves a 4 ms
    # Propose, and at most 4 ms < 7 ms: sequential, but for one sampling cycle in 16.
    shared = PipelinePrice()
    choices = _learn(shared, 200, alone_s=0.007, beside_s=0.014, propose_s=0.004, hit=True)
    assert not shared.pays()
    assert sum(choices[100:]) == 6  # cycles 101-200: the sampling ones are 112, 128, ..., 192
    # Hardware of its own: the verify takes as long either way; every cycle but the sampling ones drafts.
    own = PipelinePrice()
    choices = _learn(own, 200, alone_s=0.007, beside_s=0.0072, propose_s=0.004, hit=True)
    assert own.pays() and sum(choices[100:]) == 94
    # The same device, but the hits save more than the slowdown costs: pipelining stays.
    slow_propose = PipelinePrice()
    _learn(slow_propose, 100, alone_s=0.007, beside_s=0.009, propose_s=0.010, hit=True)
    assert slow_propose.pays()
    # Nothing is decided before each side has its samples: pipelined, but for one cycle in four.
    fresh = PipelinePrice()
    early = _learn(fresh, 4 * MIN_SAMPLES, alone_s=0.007, beside_s=0.014, propose_s=0.004, hit=True)
    assert early == [True, True, True, False] * MIN_SAMPLES


def test_the_price_follows_the_hit_rate():
    # The verify slows by 2 ms beside a draft and a hit saves 5 ms: worth it above a 40% hit rate.
    for hit, pays in ((True, True), (False, False)):
        price = PipelinePrice()
        _learn(price, 100, alone_s=0.010, beside_s=0.012, propose_s=0.005, hit=hit)
        assert price.pays() is pays


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(root / "target", variant="llama", vocab_size=256, seed=0)


class _Device:
    """One device for target and draft: a verify takes VERIFY_S, plus SLOWDOWN_S if a speculative
    Propose started while it ran (time-slicing); a Propose takes PROPOSE_S."""

    VERIFY_S, SLOWDOWN_S, PROPOSE_S = 0.010, 0.030, 0.005

    def __init__(self, shared: bool):
        self.shared, self.speculative_started = shared, 0


class _SlowTarget(LocalTarget):
    def __init__(self, engine, device: _Device):
        super().__init__(engine)
        self.device = device

    async def verify(self, *args, **kwargs):
        started = self.device.speculative_started
        await asyncio.sleep(_Device.VERIFY_S)
        if self.device.shared and self.device.speculative_started > started:
            await asyncio.sleep(_Device.SLOWDOWN_S)
        return await super().verify(*args, **kwargs)


class _SlowDraft(LocalDraft):
    def __init__(self, engine, device: _Device):
        super().__init__(engine)
        self.device = device

    async def propose(self, *args, speculative: bool = False, **kwargs):
        if speculative:
            self.device.speculative_started += 1
        await asyncio.sleep(_Device.PROPOSE_S)
        return await super().propose(*args, speculative=speculative, **kwargs)


@pytest.mark.parametrize("shared", [True, False])
def test_auto_pipelining_drafts_sequentially_where_the_draft_slows_the_verify(tiny, shared):
    """A draft identical to the target (every block accepted whole, every guess right): the
    full-acceptance gate always pipelines. On a shared device the price stops it after its first
    samples; on hardware of its own it keeps pipelining. The tokens are the sequential loop's."""
    from specdec.generation.loop import SpeculativeLoop, start_generation

    def generate(priced: bool | None, price: PipelinePrice | None = None):
        target = TargetEngine(load_model(tiny, backend="native", num_slots=4, max_context=256))
        draft = DraftEngine(DraftModelProposer(load_model(tiny, backend="native", num_slots=4, max_context=256)))
        device = _Device(shared)

        async def main():
            session_id = uuid.uuid4().hex
            cursor, first = await start_generation(LocalTarget(target), session_id, PROMPT, SamplingParams())
            stop = StopChecker(120, ())
            stop.check([first])
            settings = LoopSettings(num_draft_tokens=3, pipelining=priced is not None,
                                    pipeline_min_full_accept=0.2,
                                    pipeline_price=price if priced else None)

            async def emit(tokens):
                pass

            loop = SpeculativeLoop(_SlowTarget(target, device), _SlowDraft(draft, device), settings)
            result = await loop.run(cursor, stop, emit)
            return [first] + result.token_ids, result.stats

        return asyncio.run(main())

    sequential, _ = generate(None)
    route = PipelinePrice()  # the coordinator's for this route, shared by its turns
    priced, priced_stats = generate(True, route)
    always, always_stats = generate(False)
    again, again_stats = generate(True, route)  # a later turn on the same route starts decided
    assert priced == always == sequential == again
    cycles = always_stats.cycles
    attempts = lambda stats: stats.pipeline_hits + stats.pipeline_misses  # noqa: E731
    assert attempts(always_stats) >= cycles - 3  # the unpriced gate drafts beside nearly every verify
    if shared:  # learning (3 of every 4 cycles until 3 sequential samples), then 1 in 16
        assert attempts(priced_stats) <= 3 * MIN_SAMPLES + priced_stats.cycles // 16 + 1
        assert attempts(again_stats) <= again_stats.cycles // 16 + 1
    else:
        assert attempts(priced_stats) >= priced_stats.cycles - MIN_SAMPLES - priced_stats.cycles // 16 - 3
        assert attempts(again_stats) >= again_stats.cycles - again_stats.cycles // 16 - 3
        # Sequential samples come only from the cycles the price chose: not from the answer's last
        # blocks, which the budget leaves without a child (shorter, so a biased "alone").
        assert route.samples["alone"] <= MIN_SAMPLES + route.cycles // 16


def test_the_coordinator_keeps_one_price_per_target_and_draft():
    from specdec.generation.shared_estimates import SharedEstimatesByRoute

    routes = SharedEstimatesByRoute(max_routes=2)
    first = routes.price("target:1", "draft:1")
    assert routes.price("target:1", "draft:1") is first  # every turn on the route adds to it
    assert routes.price("target:1", "draft:2") is not first  # another draft replica may sit elsewhere
    routes.price("target:2", "draft:1")
    assert len(routes.prices) == 2 and ("target:1", "draft:1") not in routes.prices  # the oldest goes
