"""Dynamic draft length: the draft stops by its own confidence, the policy calibrates the threshold,
and the output stays exactly the target's (test_sampling_exact.py enumerates the sampled case)."""

from __future__ import annotations

import pytest
import torch

from specdec.generation.adaptive import DraftLengthPolicy
from specdec.generation.confidence import ConfidenceCalibration
from specdec.generation.session import LoopSettings
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling.params import SamplingMode, SamplingParams
from test_engine_loop import PROMPTS, draft_engine, run, target_engine, tiny_dirs  # noqa: F401


# ---- calibration -------------------------------------------------------------------------------------


def test_an_unobserved_calibration_trusts_the_confidences():
    calibration = ConfidenceCalibration()
    assert calibration.survival(0.93) == pytest.approx(0.95)  # the bin's mid-point
    assert calibration.threshold(0.5) == pytest.approx(0.5)  # bins from [0.5, 0.6) up reach 0.5


def test_an_overconfident_draft_gets_a_higher_threshold():
    """A draft that says 0.9 but is right half the time: its blocks must stop earlier."""
    honest, overconfident = ConfidenceCalibration(), ConfidenceCalibration()
    for i in range(200):
        honest.observe((0.9,), num_accepted=1 if i % 10 else 0)  # right 90% of the time
        overconfident.observe((0.9,), num_accepted=i % 2)  # right 50% of the time
    assert honest.survival(0.9) == pytest.approx(0.9, abs=0.02)
    assert overconfident.survival(0.9) == pytest.approx(0.5, abs=0.05)  # the prior pulls toward 0.95
    assert honest.threshold(0.8) <= 0.9 < overconfident.threshold(0.8)


def test_survival_counts_whole_prefixes():
    """Token j survives only if tokens 0..j were all accepted: a block accepted up to its second
    token is a success for products P_0 and P_1 and a failure for P_2."""
    calibration = ConfidenceCalibration(prior_weight=1e-9)
    calibration.observe((0.95, 0.7, 0.5), num_accepted=2)  # products 0.95, 0.665, 0.3325
    assert calibration.survival(0.95) == pytest.approx(1.0)
    assert calibration.survival(0.66) == pytest.approx(1.0)
    assert calibration.survival(0.33) == pytest.approx(0.0, abs=1e-6)


# ---- the policy's threshold ----------------------------------------------------------------------------


def _warm(policy: DraftLengthPolicy, draft_s: float, cycles: int = 30) -> None:
    policy.observe_plain(0.040)
    for i in range(cycles):
        accepted = (3, 1, 0, 2)[i % 4]
        policy.observe_cycle(4, accepted, draft_s * 4, 0.044, 0.002, (0.9, 0.8, 0.6, 0.4))


def test_the_threshold_rises_with_the_draft_cost_and_asks_for_the_longest_draft():
    cheap, dear = DraftLengthPolicy(initial=4, max_tokens=8), DraftLengthPolicy(initial=4, max_tokens=8)
    assert cheap.stop_below() == 0.0  # nothing measured yet: the requested length, no stop
    _warm(cheap, draft_s=0.0005)
    _warm(dear, draft_s=0.004)
    assert 0.0 < cheap.stop_below() < dear.stop_below() < 1.0
    assert cheap.next_k() == 8  # the stop decides the length within the cap


def test_one_more_token_is_priced_at_the_marginal_verify_cost_not_the_multi_token_step():
    """On a CPU at one thread a verify of several tokens costs a step (t2) more than a plain step,
    whatever its length. The stop weighs one more drafted token inside a block that already has
    several: that adds t1, not t1 + t2 (pricing it at t1 + t2 stopped drafts after about two tokens
    and lost 5-10% on half the categories of a quiet k-sweep)."""
    flat, stepped = DraftLengthPolicy(initial=4, max_tokens=8), DraftLengthPolicy(initial=4, max_tokens=8)
    for policy, jump in ((flat, 0.0), (stepped, 0.010)):
        policy.observe_plain(0.040)
        for i in range(40):
            k = 2 + i % 4
            accepted = (0, 1, 2, 3, 4)[i % 5] if i % 5 < k else k
            policy.observe_cycle(k, accepted, 0.002 * k, 0.040 + jump + 0.001 * (k + 1), 0.003,
                                 (0.95, 0.85, 0.7, 0.55, 0.45)[:k])
        policy.observe_plain(0.040)
    marginal = stepped.verify_cost(4) - stepped.verify_cost(3)
    assert marginal == pytest.approx(0.001, abs=2e-4)
    # Same marginal cost, lower best rate (every cycle dearer): never a higher threshold.
    assert 0.0 < stepped.stop_below() <= flat.stop_below()


def test_a_fixed_length_never_stops_by_confidence():
    fixed = DraftLengthPolicy(initial=4, max_tokens=4, adapt=False)
    _warm(fixed, draft_s=0.004)
    assert fixed.stop_below() == 0.0 and fixed.next_k() == 4


def test_without_confidences_the_policy_chooses_k_as_before():
    policy = DraftLengthPolicy(initial=4, max_tokens=8)
    policy.observe_plain(0.040)
    for _ in range(30):
        policy.observe_cycle(4, 2, 0.002, 0.044, 0.002)  # an n-gram proposer: no confidences
    assert policy.stop_below() == 0.0 and policy.next_k() == policy.best_k()


# ---- the proposer --------------------------------------------------------------------------------------


def test_rows_of_one_batch_stop_each_at_their_own_threshold(tiny_dirs):  # noqa: F811
    proposer = DraftModelProposer(load_model(tiny_dirs["target"], backend="native", num_slots=4, max_context=256))
    greedy = SamplingParams()
    prompt = PROMPTS[1]
    full = proposer.propose(proposer.open("full"), prompt, 8, greedy)
    products = torch.tensor(full.confidences).cumprod(0).tolist()
    slot = proposer.model.allocate()
    first_logits = proposer.model.forward([slot], [prompt], [1])[0][-1]
    proposer.model.free(slot)
    assert full.confidences[0] == pytest.approx(float(torch.softmax(first_logits, -1).max()), rel=1e-4)
    at_two, at_five = (products[1] + products[2]) / 2, (products[4] + products[5]) / 2
    blocks = proposer.propose_batch([(proposer.open("a"), prompt, 8, greedy, at_two),
                                     (proposer.open("b"), prompt, 8, greedy, at_five),
                                     (proposer.open("c"), prompt, 8, greedy)])
    assert [b.num_tokens for b in blocks] == [3, 6, 8]
    for block in blocks:
        assert block.token_ids.tolist() == full.token_ids.tolist()[:block.num_tokens]
        assert block.confidences == pytest.approx(full.confidences[:block.num_tokens], rel=1e-4)


# ---- lossless through the loop, with the stop forced on --------------------------------------------------


@pytest.mark.parametrize("kind", ["same", "random"])
@pytest.mark.parametrize("threshold", [0.02, 0.3])
def test_confidence_stopped_drafts_keep_the_output_exact(tiny_dirs, monkeypatch, kind, threshold):  # noqa: F811
    monkeypatch.setattr(DraftLengthPolicy, "stop_below", lambda self: threshold)
    target, draft = target_engine(tiny_dirs["target"]), draft_engine(kind, tiny_dirs)
    settings = LoopSettings(num_draft_tokens=6, max_draft_tokens=6)  # fixed k = 6, cut by the stop
    gumbel = SamplingParams(temperature=1.0, top_p=0.95, seed=3, mode=SamplingMode.GUMBEL)
    drafted = cycles = 0
    for prompt in PROMPTS:
        for params in (SamplingParams(), gumbel):
            plain = run(target, None, prompt, params)
            spec = run(target, draft, prompt, params, settings=settings)
            assert spec.token_ids == plain.token_ids
            drafted, cycles = drafted + spec.stats.drafted, cycles + spec.stats.cycles
    assert cycles < drafted < 6 * cycles  # the stop cut blocks short, and not all to one token
