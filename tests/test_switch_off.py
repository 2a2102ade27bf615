"""Switching speculation off where it does not pay, and what the switch itself costs.

Round 23 on two GPUs (8B / 1B, replay drafts at alpha 0.6, where every fixed k loses to plain
decoding) ran the adaptive length at 0.89x of plain decoding: it never switched off, because its
exploring plain step opens a streamed run (a round trip the run's later steps overlap) and so priced
plain decoding at 9.7 ms a token against 7.0 ms. Priced as the streamed run it would be, it switched
off, but then also where drafting paid a little (alpha 0.7, 0.8), on noise, paying each time for
the plain run's opening and the probe that ends it. The rule now: switch off only where plain
decoding's saving pays for the switch within the wait before the next probe (adaptive.py,
_paying_wait), judged on the acceptance's longer memory too (_optimism).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdec.generation.adaptive import DraftLengthPolicy
from specdec.generation.shared_estimates import SharedEstimates

# Round 23's costs on two H200s (BENCHMARKS.md): the 1B draft 2.4 ms a token, the 8B verify 8.1 ms,
# 3.5 ms a cycle outside the models (2.3 ms after a pipelined hit); a plain step 6.5 ms of model and
# 0.5 ms more inside a streamed run, 3.2 ms more for the step that opens one.
DRAFT_S, VERIFY_S, CYCLE_S, AHEAD_S = 0.0024, 0.0081, 0.0035, 0.0023
PLAIN_S, STREAMED_S, OPENING_S, QUEUED_S = 0.0065, 0.0005, 0.0032, 0.0001
PLAIN_RATE = 1.0 / (PLAIN_S + STREAMED_S)


def simulate(make_policy, alpha, turns=20, **kwargs):
    """Tokens per second of turns of 128 tokens at acceptance alpha (simulate_turns)."""
    per_turn = simulate_turns(make_policy, list(alpha) if isinstance(alpha, (list, tuple)) else [alpha] * turns,
                              **kwargs)
    return sum(tokens for tokens, _ in per_turn) / sum(seconds for _, seconds in per_turn)


def simulate_turns(make_policy, alphas, tokens_per_turn=128, report_openings=True, jitter=0.1, seed=0,
                   slow_first_propose=False, first_turn_tokens=None):
    """(tokens, seconds) of each turn (each policy warm-started from the earlier turns, as the
    coordinator does), pipelined cycles and streamed plain runs at the costs above, every drafted
    token of turn i accepted with probability alphas[i], the policy's measurements off by `jitter`
    (relative). report_openings=False: the loop as in round 23, which did not tell an opening step
    apart. slow_first_propose: the first steady cycle's draft reports four times its time (a pause).
    first_turn_tokens: a shorter first turn (the benchmark's warm-up request)."""
    rng = random.Random(seed)
    shared, per_turn = SharedEstimates(), []
    for turn, alpha in enumerate(alphas):
        seconds, limit = 0.0, first_turn_tokens if turn == 0 and first_turn_tokens else tokens_per_turn
        policy = make_policy()
        if shared.estimates is not None:
            policy.warm_start(shared.estimates)
        ahead, caught_up, run_left, produced = False, True, 0, 0
        while produced < limit:
            noisy = lambda s: s * max(0.1, 1.0 + jitter * rng.gauss(0.0, 1.0))  # noqa: E731
            k = policy.next_k()
            if k == 0:
                opening = run_left <= 0
                run_left = policy.plain_run() if opening else run_left
                run_left -= 1
                overhead = OPENING_S if opening else STREAMED_S
                policy.observe_plain(noisy(PLAIN_S), noisy(overhead), opened_run=report_openings and opening,
                                     queued_s=QUEUED_S)
                seconds, produced, ahead, caught_up = seconds + PLAIN_S + overhead, produced + 1, False, False
                continue
            run_left = 0
            # The Propose before the verify (none after a hit; first the tokens decoded plainly), then
            # the guess and the next block drafted beside the verify.
            before = 0.0 if ahead else (k + (0 if caught_up else 1)) * DRAFT_S
            beside, verify, overhead = (k + 1) * DRAFT_S, VERIFY_S + 0.00007 * (k + 1), AHEAD_S if ahead else CYCLE_S
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            draft_s = noisy(before + beside) * (4.0 if slow_first_propose and caught_up else 1.0)
            slow_first_propose = slow_first_propose and not caught_up
            policy.observe_cycle(k, accepted, draft_s, noisy(verify), noisy(overhead), steady=caught_up,
                                 draft_steps=(0 if ahead else k) + k + 1, drafted_ahead=ahead, beside=True)
            seconds += before + max(verify, beside) + overhead
            produced += accepted + 1
            ahead, caught_up = accepted == k and rng.random() < alpha, True
        per_turn.append((produced, seconds))
        shared.absorb(policy.estimates())
    return per_turn


def mean_rate(make_policy, alpha, seeds=6, **kwargs):
    return float(np.mean([simulate(make_policy, alpha, seed=seed, **kwargs) for seed in range(seeds)]))


def adaptive():
    return DraftLengthPolicy(4, 8, confidence_stop=False)


def best_fixed(alpha):
    return max(mean_rate(lambda k=k: DraftLengthPolicy(k, k, adapt=False), alpha) for k in (1, 2, 3))


@pytest.mark.parametrize("alpha", [0.5, 0.6])
def test_where_every_fixed_length_loses_the_adaptive_length_decodes_plainly(alpha):
    """Round 23's loop priced plain decoding by its opening steps and kept drafting (0.83x / 0.89x of
    plain here, 0.89x on the GPUs at 0.6); now within 7% of plain decoding, the rest being each
    turn's opening cycles (a turn drafts before its own cycles switch it off) and probes."""
    assert best_fixed(alpha) < PLAIN_RATE
    assert mean_rate(adaptive, alpha) >= 0.93 * PLAIN_RATE
    assert mean_rate(adaptive, alpha, report_openings=False) < 0.91 * PLAIN_RATE


@pytest.mark.parametrize("alpha", [0.7, 0.8, 0.9])
def test_where_drafting_pays_the_adaptive_length_keeps_drafting(alpha):
    """At 0.7 the best fixed k beats plain decoding by 6% only: pricing plain decoding as a streamed run
    without weighing the switch lost 6% to it (switch-offs on noise); weighed, 2-3% (as before round
    23's change: what an adaptive length pays for finding the best length in turns of 128 tokens)."""
    best = best_fixed(alpha)
    assert best > PLAIN_RATE
    assert mean_rate(adaptive, alpha) >= 0.965 * best


def test_the_wait_before_the_probe_is_as_long_as_the_switch_needs_to_pay():
    """Plain decoding's saving per token against what switching costs (the opening step's round trip,
    the probe): a draft that loses by much waits the shortest, one that loses by little waits longer,
    one whose loss would not pay for the switch within longest_probe_wait keeps drafting."""
    def policy(reopening_s=0.0):
        policy = DraftLengthPolicy(initial=1, max_tokens=1)
        for _ in range(6):  # drafts of one token, all rejected; plain steps now and then
            policy.observe_cycle(1, 0, 0.002, 0.042, 0.001)
            policy.observe_plain(0.040, 0.001)
        policy.observe_plain(0.040, 0.001 + reopening_s, opened_run=True, queued_s=0.001)
        return policy

    plain_s = policy()._plain_cost()
    assert plain_s == pytest.approx(0.041, abs=0.001)
    by_much, by_some, by_little = (policy()._paying_wait(plain_s, plain_s + loss, 1) for loss in (0.010, 0.001, 0.00005))
    assert by_much == policy().first_probe_after and by_much < by_some < policy().longest_probe_wait
    assert by_little is None
    assert policy(reopening_s=0.010)._paying_wait(plain_s, plain_s + 0.001, 1) > by_some  # a dear opening
    assert policy()._paying_wait(plain_s, plain_s - 0.001, 1) is None  # drafting pays


def test_drafting_that_loses_by_less_than_the_least_saving_stays_on():
    """On two H100s at alpha 0.6, where k = 2 tied plain decoding, turns that switched off on a margin
    within the estimates' noise ran 6-15% slower than either (each switch restarts the pipeline, and
    the draft catches up). A draft losing 3% a token keeps drafting; one losing 10% switches off."""
    def verdicts(verify_s, **settings):
        policy = DraftLengthPolicy(initial=1, max_tokens=2, optimism=0.0, **settings)
        for _ in range(12):  # drafts of one and two tokens, all rejected, and plain steps of 40 ms
            policy.observe_cycle(1, 0, 0.002, verify_s, 0.001)
            policy.observe_cycle(2, 0, 0.004, verify_s + 0.001, 0.001)
            policy.observe_plain(0.040, 0.001)
        return policy.best_k()

    assert verdicts(0.040) == 1  # drafting one token: 4.4% dearer a token than a plain step
    assert verdicts(0.040, least_saving=0.0) == 0
    assert verdicts(0.042) == 0  # 8% dearer


def test_a_step_that_opened_a_run_prices_plain_decoding_by_its_queueing_only():
    """The opening step's round trip is the switch's cost, not each plain step's."""
    policy = DraftLengthPolicy(4, 8)
    policy.observe_plain(0.0065, 0.0032, opened_run=True, queued_s=0.0001)
    assert policy._plain_cost() == pytest.approx(0.0066)
    assert policy.estimates().opening_overhead_s == pytest.approx(0.0032)
    streamed = DraftLengthPolicy(4, 8)
    streamed.observe_plain(0.0065, 0.0005)  # inside a run (or every step a call of its own)
    assert streamed._plain_cost() == pytest.approx(0.0070) and streamed.estimates().opening_overhead_s is None


def test_one_slow_propose_does_not_switch_speculation_off_for_good():
    """The first turn's first steady Propose reports four times its time. Taken at its word, it priced
    drafting out, the session switched off, and never came back: every probe after plain steps is a
    catch-up cycle, whose draft time was not measured, and the next turns started from the first's
    estimates (0.77 of the best fixed k here; round 23's code 0.79). A steady cycle's draft time now counts at most twice the
    estimate, and a catch-up's bounds it from above."""
    rate = mean_rate(adaptive, 0.8, seeds=3, slow_first_propose=True)
    assert rate >= 0.96 * best_fixed(0.8)


def test_a_catch_up_cycle_bounds_the_draft_price_from_above():
    policy = DraftLengthPolicy(4, 8)
    policy.observe_cycle(2, 2, 0.010, 0.008, 0.003)  # 5 ms a drafted token
    policy.observe_cycle(2, 2, 0.040, 0.008, 0.003)  # a pause: counted as 10 ms, not 20
    assert policy._draft_s == pytest.approx(0.9 * 0.005 + 0.1 * 0.010)
    policy.observe_cycle(2, 1, 0.016, 0.008, 0.003, steady=False)  # a catch-up at 8 ms a token: no news
    assert policy._draft_s == pytest.approx(0.0055)
    policy.observe_cycle(2, 1, 0.006, 0.008, 0.003, steady=False)  # 3 ms a token, catch-up included
    assert policy._draft_s == pytest.approx(0.003)
