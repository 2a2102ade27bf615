"""Draft trimming by goodput: the step cost fit; the trim (the best prefixes, checked by brute force;
nothing trimmed while drafted tokens are free or a session is alone; low-acceptance drafts dropped
under load); lossless verification of trimmed drafts through the engine; the adaptive loop decoding
plainly while the target trims."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from specdec.engine.batch import DecodeWork, VerifyWork
from specdec.engine.goodput import DraftTrimmer, StepCost, prefix, run_trimmed_batch
from specdec.engine.inner_draft import InnerDraftWork
from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock, VerifyOutcome

ALPHA, BETA = 0.07, 0.007  # a CPU-like step: 70 ms of weights plus 7 ms per token


def trimmer_with_cost(alpha: float = ALPHA, beta: float = BETA, **kwargs) -> DraftTrimmer:
    trimmer = DraftTrimmer(**kwargs)
    for rows, width in itertools.product(range(1, 5), range(1, 6)):  # steps of every shape: nothing untold
        trimmer.cost.observe(rows * width, alpha + beta * rows * width, rows)
    return trimmer


def teach(trimmer: DraftTrimmer, session_id: str, accepted: int, drafted: int, times: int = 30) -> None:
    """Verify outcomes of a session, leaving the step cost as it was."""
    cost = copy.deepcopy(trimmer.cost)
    work = VerifyWork(session_id, 0, DraftBlock(torch.zeros(drafted, dtype=torch.long)))
    for _ in range(times):
        trimmer.observe([work], [VerifyOutcome(0, drafted, accepted, 0)], ALPHA)
    trimmer.cost = cost


def verify(session_id: str, k: int) -> VerifyWork:
    return VerifyWork(session_id, 10, DraftBlock(torch.arange(k)))


def inner(session_id: str, k: int) -> InnerDraftWork:
    """A row that drafts up to k tokens with the draft model the target hosts, then verifies them."""
    return InnerDraftWork(session_id, 10, k, SamplingParams())


def test_step_cost_fit():
    cost = StepCost()
    for n in [1, 5, 16, 80, 3, 40] * 3:
        cost.observe(n, 0.05 + 0.002 * n)
    alpha, beta = cost.fit()
    assert alpha == pytest.approx(0.05) and beta == pytest.approx(0.002)
    same_size = StepCost()
    for _ in range(20):
        same_size.observe(16, 0.1)
    assert same_size.fit() is None  # no slope can be told from steps of one size


def test_a_few_graph_captures_do_not_move_the_step_cost_fit_far():
    """A step that captured a CUDA graph (~0.2 s at the 8B shape, past the warm-up context) counts at
    most twice what the fit expects of its size; unclamped, three of them made a 16-token step 4.4x dearer."""
    cost = StepCost()
    for n in [1, 5, 16, 8, 3, 12] * 4:
        cost.observe(n, 0.008 + 0.0002 * n)
    for n in (5, 9, 13):
        cost.observe(n, 0.2)
    alpha, beta = cost.fit()
    assert alpha + 16 * beta < 1.25 * (0.008 + 16 * 0.0002)


def goodput(trimmer: DraftTrimmer, works, kept: list[int]) -> float:
    gain = sum(sum(trimmer.acceptance(w.session_id) ** j for j in range(d + 1)) if isinstance(w, VerifyWork)
               else 1.0 for w, d in zip(works, kept))
    tokens = len(kept) * max(1 + d for d in kept)  # every row padded to the widest
    return gain / (ALPHA + BETA * tokens)


def test_trim_keeps_the_prefixes_with_the_best_goodput():
    trimmer = trimmer_with_cost()
    for session_id, accepted in (("good", 4), ("fair", 2), ("poor", 0)):
        teach(trimmer, session_id, accepted, 4)
    works = [verify("good", 4), verify("fair", 4), verify("poor", 4), DecodeWork("plain", 10)]
    kept = [w.draft.num_tokens if isinstance(w, VerifyWork) else 0 for w in trimmer.trim(works)]
    options = itertools.product(range(5), range(5), range(5), [0])
    best = max(options, key=lambda ks: (goodput(trimmer, works, list(ks)), sum(ks)))  # ties: free tokens kept
    assert kept == list(best)
    assert kept[0] == kept[1] == kept[2] > 0  # the step is padded to its widest row: up to it, tokens are free
    cheap = [verify("good", 4), DecodeWork("plain", 10)]
    assert trimmer.trim(cheap)[0].draft.num_tokens > trimmer.trim([verify("poor", 4), cheap[1]])[0].draft.num_tokens


def test_under_load_low_acceptance_drafts_are_dropped_and_free_tokens_are_kept():
    loaded = trimmer_with_cost(margin=0.0)  # the goodput rule alone
    for i in range(16):
        teach(loaded, f"s{i}", 1, 4)  # a ~ 0.5: in a batch of 16 no drafted token pays for itself
    trimmed = loaded.trim([verify(f"s{i}", 4) for i in range(16)])
    assert all(w.draft.num_tokens == 0 for w in trimmed)
    pair = [verify("s0", 4), DecodeWork("other", 10)]
    assert 0 < loaded.trim(pair)[0].draft.num_tokens < 4  # with one other row the first ones still pay
    assert loaded.trim(pair[:1])[0].draft.num_tokens == 4  # alone: the coordinator's call
    flat = trimmer_with_cost(beta=0.0, margin=0.0)  # a GPU at small batches: tokens cost nothing extra
    teach(flat, "s0", 0, 4)
    assert flat.trim(pair)[0].draft.num_tokens == 4
    assert DraftTrimmer().trim(pair)[0].draft.num_tokens == 4  # no cost measured yet


def test_drafts_made_on_the_target_pay_for_the_draft_passes_too():
    """A target hosting the draft model runs width - 1 draft steps before the forward: with draft
    steps as dear as a tenth of the target's, rows drafting there get narrower plans."""
    trimmer = trimmer_with_cost()
    teach(trimmer, "a", 3, 4)
    teach(trimmer, "b", 3, 4)
    rows = [verify("a", 6), verify("b", 6)]
    free = trimmer.plan(rows, drafting_here=True)  # no draft pass measured yet: as a draft service's
    assert free == trimmer.plan(rows) and free[0] > 0
    trimmer.observe_draft(steps=4, seconds=4 * 0.012)
    assert trimmer.draft_price.at(2) == pytest.approx(0.012)
    assert trimmer.plan(rows) == free  # drafts made elsewhere cost this step nothing
    assert trimmer.plan(rows, drafting_here=True)[0] < free[0]


def test_speculation_that_barely_pays_in_the_step_is_cut_by_the_margin():
    """With a margin (the target's --trim-margin 0.2), drafts pass only if they raise the step's
    modelled goodput by 20%: a drafted row also costs its session a draft round trip the step cost
    does not see. The default, 0, is the goodput rule alone."""
    rows = [verify("s0", 4), DecodeWork("other", 10), DecodeWork("third", 10)]
    strict, pure = trimmer_with_cost(margin=0.2), trimmer_with_cost()
    for trimmer in (strict, pure):
        teach(trimmer, "s0", 3, 4)  # a ~ 0.75: the first token raises the step's goodput by < 20%
    assert pure.trim(rows)[0].draft.num_tokens > 0
    assert strict.trim(rows)[0].draft.num_tokens == 0
    good = trimmer_with_cost(margin=0.2)
    teach(good, "s0", 4, 4)  # everything accepted: well worth its tokens (beside one plain row)
    assert good.trim(rows[:2])[0].draft.num_tokens == 4


def test_each_plain_row_is_told_what_a_draft_of_its_own_would_have_kept():
    """draft_limits: for every DecodeWork row, the drafted tokens the same step would have verified
    had that row been a verify of 8, the others as they were, or, where that is more, had every
    plain row been one: what trim itself keeps then."""
    for beta, margin in ((BETA, 0.2), (BETA, 0.0), (0.05, 0.2), (0.0, 0.2)):
        trimmer = trimmer_with_cost(beta=beta, margin=margin)
        for session_id, accepted in (("good", 4), ("fair", 2), ("poor", 0)):
            teach(trimmer, session_id, accepted, 4)
        for others in (["fair"], ["good", "poor"], ["new", "fair", "poor"]):
            for session_id in ("good", "fair", "poor", "new"):
                rows = [DecodeWork(s, 10) for s in others if s != session_id]
                if not rows:
                    continue  # alone (below)
                trimmer.trim([DecodeWork(session_id, 10), *rows])
                told = trimmer.draft_limits[session_id]
                alone = trimmer.trim([verify(session_id, 8), *rows])[0].draft.num_tokens
                together = trimmer.trim([verify(session_id, 8), *(verify(w.session_id, 8) for w in rows)])
                assert told == max(alone, together[0].draft.num_tokens), (beta, margin, others, session_id)
    loaded = trimmer_with_cost(beta=0.05, margin=0.2)  # a compute-bound step: no draft pays
    loaded.trim([DecodeWork("a", 10), DecodeWork("b", 10)])
    assert loaded.draft_limits == {"a": 0, "b": 0}
    flat = trimmer_with_cost(beta=0.0)  # tokens cost nothing extra: the whole probe
    flat.trim([DecodeWork("a", 10), verify("b", 4)])
    assert flat.draft_limits == {"a": 8}  # only plain rows are told
    flat.trim([DecodeWork("a", 10)])
    assert flat.draft_limits == {}  # alone: the coordinator's call


@pytest.mark.parametrize("packed", [False, True])
def test_plain_rows_that_pay_only_drafting_together_are_told_so(packed):
    """The hosted draft's passes cost the whole step. At 8 sessions on one H200 (8B target, 1B draft
    hosted, alpha 0.8) one row drafting alone slows the step for the 7 others and is cut, while all 8
    drafting together commit about 20 tokens in 17 ms (2 draft steps of 3.7 ms at 8 rows) against
    plain decoding's 8 in 9.4 ms. Told only its own probe, every plain row would hear 0 and the batch
    would never draft. Not so for sessions drafting on a draft service (their round trips are priced
    one session at a time). Priced by its rows: where 8 rows make a pass as dear as two target
    steps, never."""
    sessions = [f"s{i}" for i in range(8)]
    plain = [DecodeWork(s, 10) for s in sessions]
    trimmer = trimmer_with_cost(alpha=0.009, beta=0.00002, packed=packed)
    for rows in (1, 2, 4, 8) * 2:  # 2.2 ms a step + 0.15 ms a row (round 39, one H200)
        trimmer.observe_draft(steps=4, seconds=4 * (0.0022 + 0.00015 * rows), rows=rows)
    assert trimmer.draft_price.at(8) == pytest.approx(0.0034)
    for session_id in sessions:
        teach(trimmer, session_id, 4, 5)  # acceptance about 0.8
    assert trimmer.plan([inner("s0", 4), *plain[1:]], drafting_here=True)[0] == 0  # alone: cut
    trimmer.trim(plain)
    assert all(trimmer.draft_limits[s] >= 1 for s in sessions)
    together = trimmer.plan([inner(s, 4) for s in sessions], drafting_here=True)
    assert all(kept >= 1 for kept in together)  # and the step they ask for keeps their drafts
    for session_id in sessions:  # sessions drafting on a draft service probe one at a time
        trimmer.admit_drafting_elsewhere(session_id, 0.0, "draft-service")
    trimmer.trim(plain)
    assert all(trimmer.draft_limits[s] == 0 for s in sessions)
    dear = trimmer_with_cost(alpha=0.009, beta=0.00002, packed=packed)
    for rows in (1, 2, 4, 8) * 2:  # cheap alone, as dear as two target steps at 8 rows: never together
        dear.observe_draft(steps=4, seconds=4 * (0.0022 + 0.0025 * (rows - 1)), rows=rows)
    for session_id in sessions:
        teach(dear, session_id, 4, 5)
    dear.trim(plain)
    assert all(dear.draft_limits[s] == 0 for s in sessions)


def test_a_padded_target_that_saw_only_plain_steps_lets_wider_drafts_try():
    """One H200, 8B target, 1B draft hosted, 8 sessions at alpha 0.8, after plain steps only: fitted
    on tokens alone, their growth by rows (0.38 ms a row) prices a width of 5 at 22 ms against a real
    9.5 ms, and a step whose 8 rows all draft keeps 1 token each. Charging half of that growth to
    width, it keeps 2, and the steps they make tell the rest (test_step_cost.py)."""
    sessions = [f"s{i}" for i in range(8)]
    kept = {}
    for name, per_row in (("tokens alone", False), ("rows apart", True)):
        trimmer = DraftTrimmer()
        trimmer.cost = StepCost(per_row=per_row)
        for rows in [1, 3, 8, 5, 2, 7, 4, 6] * 3:
            trimmer.cost.observe(rows, 0.0061 + 0.00039 * rows, rows)
        trimmer.observe_draft(steps=4, seconds=4 * 0.0025)
        for session_id in sessions:
            teach(trimmer, session_id, 4, 5)
        kept[name] = set(trimmer.plan([verify(s, 4) for s in sessions], drafting_here=True))
    assert kept == {"tokens alone": {1}, "rows apart": {2}}


def test_a_hosted_batch_drafts_together_again_after_another_pools_plain_stretch():
    """One H200, 8B target, 1B draft hosted (round 40's trace of the target's plans): after the
    hosted pool had drafted at 8 sessions, other pools' plain steps (16 rows, fewer at their waves'
    ends), then 16 new hosted sessions, all plain. Priced at the untold half again (0.17 ms a token
    against 0.0125 told), one more token on 16 rows looked 2.9 ms dear (0.2 told) and the joint probe said no:
    whole waves decoded plainly at 0.94 of plain decoding, where drafting together gave 1.11.
    Remembering what the widths told, every row is told to draft."""
    def step(rows: int, width: int) -> float:
        return 0.0050 + 0.000345 * rows + 0.0000125 * rows * (width - 1)

    trimmer = DraftTrimmer()
    for rows, width in itertools.product(range(1, 9), (2, 3, 2, 1)):  # the hosted pool at 8 sessions
        trimmer.cost.observe(rows * width, step(rows, width), rows)
        if width > 1:  # 2.3 ms a draft step at 1 row, 3.8 at 8: 6 ms at 16 rows, as the passes extrapolate
            trimmer.observe_draft(steps=width - 1, seconds=(width - 1) * (0.00207 + 0.00025 * rows), rows=rows)
    for rows in ([16] * 30 + list(range(16, 0, -1))) * 20:  # other pools' plain steps (920)
        trimmer.cost.observe(rows, step(rows, 1), rows)
    sessions = [f"s{i}" for i in range(16)]
    trimmer.plan([DecodeWork(s, 100) for s in sessions])
    assert all(trimmer.draft_limits[s] >= 1 for s in sessions)


def test_prefix_keeps_the_distributions_of_the_kept_tokens():
    block = DraftBlock(torch.tensor([4, 5, 6]), torch.tensor([[4, 1], [5, 2], [6, 3]]),
                       torch.tensor([[0.5, 0.5], [0.9, 0.1], [1.0, 0.0]]))
    short = prefix(block, 2)
    assert short.token_ids.tolist() == [4, 5] and short.draft_probs.shape == (2, 2)
    assert prefix(DraftBlock(torch.tensor([1, 2])), 0).num_tokens == 0


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only spin on a shared machine
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from specdec.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("goodput") / "target", vocab_size=256, seed=0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("refusing", [False, True])
def test_trimmed_verification_is_lossless(tiny_dir, refusing, packed):
    """Greedy sessions whose drafts are trimmed commit exactly what plain decoding commits; so do
    sessions drafting elsewhere that the cycle pricing refuses (every draft of theirs cut). Packed,
    the plan cuts each row to a length of its own (step_plan.py)."""
    model = load_model(tiny_dir, backend="native", num_slots=8, max_context=128)
    engine, plain = TargetEngine(model), TargetEngine(load_model(tiny_dir, backend="native", num_slots=8,
                                                                  max_context=128))
    trimmer = trimmer_with_cost(beta=0.02, packed=packed)
    if refusing:  # as after a refusal: new sessions drafting elsewhere start refused for 64 steps
        trimmer.cycle_wall._verdicts[""] = (0, 64, 0)
    prompts = {f"s{i}": [i + 1, 2 * i + 3, 7] for i in range(6)}
    expected, kept_lengths = {}, set()
    for session_id, prompt in prompts.items():
        engine.start_session(session_id, prompt, SamplingParams())
        plain.start_session(session_id, prompt, SamplingParams())
        expected[session_id] = plain.committed_tokens(session_id) + plain.decode(session_id, 4, 70)
        teach(trimmer, session_id, int(session_id[1]) % 5, 4)  # acceptance 0 .. 0.8: some trimmed
    for _ in range(12):
        works = []
        for session_id in prompts:
            position = len(engine.committed_tokens(session_id))
            start = position - 3
            draft = torch.tensor(expected[session_id][3:][start: start + 4], dtype=torch.long)
            works.append(VerifyWork(session_id, position, DraftBlock(draft), drafted_elsewhere=refusing))
        results = run_trimmed_batch(engine, trimmer, works)
        assert all(isinstance(r, VerifyOutcome) for r in results)
        assert not refusing or all(r.num_drafted == 0 for r in results)
        kept_lengths.update(r.num_drafted for r in results)
    assert trimmer.trimmed_tokens > 0
    assert refusing or not packed or len(kept_lengths) > 2  # packed: rows cut to lengths of their own
    for session_id in prompts:
        committed = engine.committed_tokens(session_id)
        assert committed == expected[session_id][: len(committed)]


class TrimmingTarget:
    """A target that verifies none of the drafted tokens, as a heavily loaded one does."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)

    async def verify(self, session_id, position, draft, epoch=0):
        return await self.target.verify(session_id, position, prefix(draft, 0), epoch)


class RefusingTarget(TrimmingTarget):
    """... and says so with every plain step (the DecodeStream message's draft_limit 0)."""

    async def decode_stream(self, *args, **kwargs):
        from specdec.engine.cycle_cost import report_draft_limit

        async for tokens in self.target.decode_stream(*args, **kwargs):
            report_draft_limit(0)
            yield tokens


async def test_a_target_that_refuses_drafts_gets_no_probes(tiny_dir):
    """A fixed draft length trimmed to nothing re-probes on a doubling interval; told by each plain
    step that no draft would be verified, it does not probe at all."""
    from specdec.engine.draft import DraftEngine
    from specdec.engine.local import LocalDraft, LocalTarget
    from specdec.generation.loop import generate
    from specdec.generation.session import LoopSettings
    from specdec.generation.stopping import StopChecker
    from specdec.proposers.draft_model import DraftModelProposer

    async def emit(tokens):
        pass

    load = lambda: load_model(tiny_dir, backend="native", num_slots=2, max_context=256)  # noqa: E731
    draft = LocalDraft(DraftEngine(DraftModelProposer(load())))
    target = LocalTarget(TargetEngine(load()))
    results = {}
    for name, wrapper in (("trimming", TrimmingTarget), ("refusing", RefusingTarget)):
        results[name] = await generate(wrapper(target), draft, name, [5, 6, 7], SamplingParams(), StopChecker(200),
                                       emit, LoopSettings(num_draft_tokens=4, adaptive=False))
    assert results["trimming"].token_ids == results["refusing"].token_ids
    assert results["trimming"].stats.cycles >= 3  # the first try, then probes at 32 and 96
    assert results["refusing"].stats.cycles == 1  # the first try only


async def test_the_adaptive_loop_stops_drafting_when_the_target_trims(tiny_dir):
    from specdec.engine.draft import DraftEngine
    from specdec.engine.local import LocalDraft, LocalTarget
    from specdec.generation.loop import generate
    from specdec.generation.session import LoopSettings
    from specdec.generation.stopping import StopChecker
    from specdec.proposers.draft_model import DraftModelProposer

    def target():
        return LocalTarget(TargetEngine(load_model(tiny_dir, backend="native", num_slots=2, max_context=128)))

    async def emit(tokens):
        pass

    draft = LocalDraft(DraftEngine(DraftModelProposer(load_model(tiny_dir, backend="native", num_slots=2,
                                                                 max_context=128))))
    args = ([5, 6, 7], SamplingParams(), StopChecker(40), emit)
    plain = await generate(target(), None, "p", *args[:2], StopChecker(40), emit)
    result = await generate(TrimmingTarget(target()), draft, "s", *args, LoopSettings(adaptive=True))
    assert result.token_ids == plain.token_ids
    assert result.stats.cycles <= 3 and result.stats.decode_steps >= 35  # one try, then rare probes


def test_the_hosted_drafts_price_comes_from_passes_that_only_drafted(tiny_dir):
    """A hosted draft's pass that first catches a row up (its first step, or a step after plain ones)
    pays a prefill: priced as draft steps, such passes made 8 ms of a 2.5 ms step on one H200, and
    the price kept every row from drafting again. Only passes whose rows only draft set it."""
    from specdec.engine.draft import DraftEngine
    from specdec.engine.inner_draft import run_inner_step
    from specdec.proposers.draft_model import DraftModelProposer

    target = TargetEngine(load_model(tiny_dir, backend="native", num_slots=4, max_context=128))
    drafts = DraftEngine(DraftModelProposer(load_model(tiny_dir, backend="native", num_slots=4, max_context=128)))
    trimmer = DraftTrimmer()
    prompt = [5, 9, 17, 3]
    position, first = target.start_session("s", prompt, SamplingParams())
    opening = InnerDraftWork("s", position, 2, SamplingParams(), open_with=tuple(prompt + [first]))
    result = run_inner_step(target, trimmer, drafts, [opening])[0]
    assert trimmer.draft_price.mean_s is None  # the pass opened the draft's session: a prefill
    committed = prompt + [first] + result.block.token_ids[:result.outcome.num_accepted].tolist() \
        + [result.outcome.next_token]
    keep = len(result.draft_tokens) if result.outcome.num_accepted == result.block.num_tokens else \
        len(prompt) + 1 + result.outcome.num_accepted
    steady = InnerDraftWork("s", len(committed) - 1, 2, SamplingParams(), keep=keep,
                            append=tuple(committed[keep:]))
    assert len(steady.append) == 1
    run_inner_step(target, trimmer, drafts, [steady])
    assert trimmer.draft_price.mean_s is not None and trimmer.draft_price.at(1) > 0
