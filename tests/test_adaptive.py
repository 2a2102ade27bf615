"""Adaptive draft length: Leviathan's expected-tokens-per-time rule on measured costs."""

from __future__ import annotations

import random

import pytest

from specdec.generation.adaptive import UNTIL_TOLD, DraftLengthPolicy, expected_tokens


def test_expected_tokens_matches_the_geometric_series():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 3) - (1 + 0.5 + 0.25 + 0.125)) < 1e-12


def feed(policy, cycles, k, accepted, draft_s=0.001, verify_s=0.010):
    for _ in range(cycles):
        policy.observe_cycle(k, accepted, draft_s * k, verify_s)


def test_a_good_cheap_draft_grows_to_the_longest_draft():
    policy = DraftLengthPolicy(initial=4, max_tokens=8)
    feed(policy, 20, 4, 4)  # everything accepted, verify flat in k (GPU-like), draft 10% of a step
    policy.observe_plain(0.010)
    assert policy.next_k() == 8


def test_a_useless_draft_is_switched_off_and_probed_again_later():
    policy = DraftLengthPolicy(initial=4, max_tokens=8)
    policy.observe_plain(0.010)
    feed(policy, 10, 4, 0, draft_s=0.002, verify_s=0.012)
    assert policy.next_k() == 0
    waited = 0
    while (probe := policy.next_k()) == 0:
        policy.observe_plain(0.010)
        waited += 1
    assert policy.first_probe_after <= waited <= policy.longest_probe_wait
    assert probe == 1  # the probe drafts what might pay: one token, not `initial`
    assert policy.next_k() == 0  # and back to plain decoding unless the probe changed the estimate


def test_costly_verification_shortens_the_draft():
    """On a CPU a verify of k + 1 tokens costs more than a step: moderate acceptance then wants a
    shorter draft than on a flat-cost device."""
    cpu, flat = DraftLengthPolicy(max_tokens=8), DraftLengthPolicy(max_tokens=8)
    for policy, slope in ((cpu, 0.004), (flat, 0.0)):
        policy.observe_plain(0.010)
        for k in (2, 4, 6):
            feed(policy, 3, k, k // 2, draft_s=0.0005, verify_s=0.010 + slope * k)
    assert 0 < cpu.best_k() < flat.best_k()


@pytest.mark.parametrize("kind", ["random", "same", "ngram"])
def test_adaptive_loop_stays_lossless(tmp_path_factory, kind):
    from test_engine_loop import draft_engine, run, target_engine  # the tiny-model harness

    from specdec.generation.session import LoopSettings
    from specdec.sampling.params import SamplingParams
    from specdec.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("adaptive")
    dirs = {"target": make_tiny_model(root / "t", vocab_size=256, seed=0),
            "random": make_tiny_model(root / "r", vocab_size=256, seed=1)}
    target = target_engine(dirs["target"])
    plain = run(target, None, [1, 5, 9, 12, 5, 9], SamplingParams(), max_new_tokens=60)
    draft = draft_engine(kind, dirs)
    spec = run(target, draft, [1, 5, 9, 12, 5, 9], SamplingParams(), max_new_tokens=60,
               settings=LoopSettings(num_draft_tokens=3, adaptive=True, max_draft_tokens=6))
    assert spec.token_ids == plain.token_ids


def test_expected_tokens_follow_the_acceptance_measured_at_each_position():
    """Lookup drafts are not geometric: here the first token is a coin flip and a draft that
    survives it is nearly always right. E(k) must follow what was measured, not 1 + a + ... + a^k."""
    pattern = [0, 8, 0, 8, 8, 0, 7, 0, 8, 0]  # accepted tokens of 8-token drafts, repeated
    policy = DraftLengthPolicy(initial=8, max_tokens=8, decay=0.999)
    for _ in range(40):
        for accepted in pattern:
            policy.observe_cycle(8, accepted, 0.0, 0.01)
    for k in (1, 2, 4, 8):
        measured = sum(min(n, k) + 1 for n in pattern) / len(pattern)
        assert policy.expected_tokens(k) == pytest.approx(measured, rel=0.03)
    geometric = expected_tokens(policy.acceptance, 2)
    assert abs(geometric - (1 + 0.5 + 0.5)) > 0.2  # the single-rate model is far off at k = 2


def test_a_per_cycle_overhead_is_charged_per_cycle_not_per_drafted_token():
    """Round trips cost the same whatever k: a large fixed overhead makes longer drafts pay (fewer
    cycles per token), so it must not be folded into the per-token draft cost."""
    policies = {}
    for overhead in (0.0, 0.060):
        policy = DraftLengthPolicy(initial=4, max_tokens=8)
        policy.observe_plain(0.050, overhead / 2)
        for accepted in [4, 2, 3, 1, 4, 3] * 3:  # a fairly good draft
            policy.observe_cycle(4, accepted, 0.004 * 4, 0.050, overhead)
        policies[overhead] = policy
    assert policies[0.060].best_k() > policies[0.0].best_k() > 0


def test_an_expensive_round_trip_turns_a_modest_draft_off():
    """When a speculative cycle pays much more outside the models than a plain step does, a draft
    whose tokens are as likely wrong as right does not pay."""
    policy = DraftLengthPolicy(initial=2, max_tokens=8)
    for _ in range(5):
        policy.observe_plain(0.050, 0.002)
    for accepted in [0, 1, 0, 2, 0, 1] * 3:
        policy.observe_cycle(2, accepted, 0.010, 0.052, 0.040)
    assert policy.best_k() == 0
    cheap = DraftLengthPolicy(initial=2, max_tokens=8)
    for _ in range(5):
        cheap.observe_plain(0.050, 0.002)
    for accepted in [0, 1, 0, 2, 0, 1] * 3:
        cheap.observe_cycle(2, accepted, 0.010, 0.052, 0.002)
    assert cheap.best_k() > 0


def test_a_fixed_length_yields_to_trimming_and_comes_back():
    """A request that names k drafts k, except while the loaded target trims its drafts: then no
    more than the target verified, trying k again every probe_every cycles (0: plain decoding,
    probed like an adaptive session)."""
    policy = DraftLengthPolicy(initial=4, max_tokens=4, probe_every=3, adapt=False)
    for accepted in (0, 0, 0, 1, 0):  # poor acceptance never changes a fixed length by itself
        policy.observe_cycle(4, accepted, 0.01, 0.05)
        assert policy.next_k() == 4
    policy.observe_cycle(2, 1, 0.01, 0.05)
    policy.limit(2)  # the target verified only 2 of the 4
    assert [policy.next_k() for _ in range(2)] == [2, 2]
    for _ in range(3):
        policy.observe_cycle(2, 2, 0.01, 0.05)
    assert policy.next_k() == 4  # k again after probe_every cycles
    policy.observe_cycle(0, 0, 0.0, 0.05)
    policy.limit(0)  # everything trimmed: plain decoding, then a probe
    ks = []
    for _ in range(7):
        ks.append(policy.next_k())
        if ks[-1] == 0:
            policy.observe_plain(0.05)
    assert ks[0] == 0 and 4 in ks  # a probe came after the (doubled) probe interval
    policy.observe_cycle(4, 2, 0.01, 0.05)  # the probe was verified in full
    assert policy.next_k() == 4


def test_a_longer_verify_never_looks_cheaper_than_a_shorter_one():
    """On a shared CPU the load changes under a session. Sizes timed at different loads, compared
    size by size, made a 6-token verify look half the price of a 4-token one; one cost line fitted
    over every forward keeps costs ordered by size, and a plain step is a 1-token forward."""
    from specdec.generation.forward_cost import ForwardCost

    cost = ForwardCost()
    for n, seconds in [(1, 0.050), (3, 0.052), (5, 0.054), (2, 0.051), (4, 0.053)] * 4:
        cost.observe(n, seconds)
    assert cost.cost(1) == pytest.approx(0.050, abs=1e-4) and cost.cost(9) == pytest.approx(0.058, abs=1e-4)
    shifting = ForwardCost()
    for _ in range(10):
        shifting.observe(6, 0.050)  # quiet machine
    for _ in range(10):
        shifting.observe(4, 0.100)  # a neighbour took the core
    assert shifting.cost(6) >= shifting.cost(4) >= shifting.cost(1) > 0
    single = ForwardCost()
    single.observe(5, 0.050)  # one size only: 5% of a step per extra token
    assert single.cost(9) == pytest.approx(0.050 * (1 + 0.05 * 4))


def test_three_unlucky_cycles_do_not_switch_a_cheap_draft_off_but_many_do():
    """Switching off ends the measurements that could switch speculation on again, so the rule is
    optimistic by about a standard error of the measured acceptance: three rejected first cycles
    (a hard opening) keep drafting, a long run of rejections does not."""
    policy = DraftLengthPolicy(initial=4, max_tokens=8)
    policy.observe_plain(0.040)
    feed(policy, 3, 4, 0, draft_s=0.004, verify_s=0.048)
    assert policy.next_k() > 0
    pessimist = DraftLengthPolicy(initial=4, max_tokens=8, optimism=0.0, switch_off_after=1)
    pessimist.observe_plain(0.040)
    feed(pessimist, 3, 4, 0, draft_s=0.004, verify_s=0.048)
    assert pessimist.next_k() == 0
    for _ in range(60):
        feed(policy, 1, max(policy.next_k(), 1), 0, draft_s=0.004, verify_s=0.048)
    assert policy.next_k() == 0


def test_while_off_old_evidence_fades_and_a_good_probe_switches_speculation_on():
    policy = DraftLengthPolicy(initial=4, max_tokens=8, probe_every=16)
    policy.observe_plain(0.040)
    for _ in range(60):
        feed(policy, 1, 4, 0, draft_s=0.004, verify_s=0.048)
    assert policy.next_k() == 0
    evidence_before, waited = policy._evidence, 0
    while (probe := policy.next_k()) == 0:
        policy.observe_plain(0.040)
        waited += 1
    # How sure the old estimate was fades with every plain step.
    assert policy._evidence == pytest.approx(evidence_before * policy.decay ** waited)
    feed(policy, 1, probe, probe, draft_s=0.004, verify_s=0.048)  # the text became predictable
    assert policy.next_k() > 0


def test_plain_decoding_is_measured_after_the_warm_up_and_now_and_then():
    """Speculation is judged against what a plain step costs now (under concurrency: queueing behind
    other sessions included), so the policy decodes one step plainly after its warm-up and one every
    explore_plain_every cycles; a fixed draft length never does."""
    policy = DraftLengthPolicy(initial=4, max_tokens=8, explore_plain_every=10)
    fixed = DraftLengthPolicy(initial=4, max_tokens=4, adapt=False)
    ks = []
    for _ in range(30):
        k = policy.next_k()
        ks.append(k)
        if k == 0:
            policy.observe_plain(0.040, 0.002)
        else:
            policy.observe_cycle(k, k - 1, 0.002 * k, 0.044, 0.004)
        assert fixed.next_k() == 4
        fixed.observe_cycle(4, 3, 0.008, 0.044, 0.004)
    plain_steps = [i for i, k in enumerate(ks) if k == 0]
    assert plain_steps[0] == 3 and len(plain_steps) == 3  # after 3 warm-up cycles, then every 10 cycles
    assert all(b - a == 11 for a, b in zip(plain_steps, plain_steps[1:]))


def test_a_catch_up_cycle_is_not_charged_as_drafting():
    """The first Propose of a session (or after plain steps) first feeds the draft the prompt or the
    tokens it missed: a prefill that says nothing of what a drafted token costs."""
    policy = DraftLengthPolicy(initial=4, max_tokens=8)
    policy.observe_plain(0.040, 0.002)
    policy.observe_cycle(4, 2, 0.090, 0.044, 0.030, steady=False)  # 90 ms: the draft's prefill
    for _ in range(3):
        policy.observe_cycle(4, 2, 0.008, 0.044, 0.004)
    assert policy._draft_s == pytest.approx(0.002)
    assert policy._speculative_overhead_s == pytest.approx(0.004)


def test_a_multi_token_forward_may_cost_a_step_more_than_a_plain_one():
    """On a CPU at one thread a 2-token verify costs ~25% more than a plain step and little more per
    token after that (another kernel for several rows): the fit keeps that step apart from the slope."""
    from specdec.generation.forward_cost import ForwardCost

    cost = ForwardCost()
    for n, seconds in [(1, 0.040), (2, 0.050), (5, 0.053), (3, 0.051), (9, 0.057)] * 4:
        cost.observe(n, seconds)
    assert cost.cost(1) == pytest.approx(0.040, abs=5e-4)
    assert cost.cost(2) == pytest.approx(0.050, abs=5e-4) and cost.cost(9) == pytest.approx(0.057, abs=5e-4)


def test_switching_off_takes_two_verdicts_and_reprobes_back_off_up_to_the_longest_wait():
    """A wrong switch-off costs plain steps until the next probe, so one bad verdict is not enough.
    A draft that loses by far pays for the switch soon: the first probe comes after
    first_probe_after plain steps; each probe that fails doubles the wait, up to longest_probe_wait."""
    policy = DraftLengthPolicy(initial=4, max_tokens=8, optimism=0.0)
    policy.observe_plain(0.040)
    feed(policy, 3, 4, 0, draft_s=0.004, verify_s=0.080)  # the first verdict: plain
    assert policy.next_k() == 4
    feed(policy, 1, 4, 0, draft_s=0.004, verify_s=0.080)  # the second in a row
    waits = []
    for _ in range(6):
        assert policy.next_k() == 0
        plain_steps = 1
        policy.observe_plain(0.040)
        while (k := policy.next_k()) == 0:
            plain_steps += 1
            policy.observe_plain(0.040)
        waits.append(plain_steps)
        feed(policy, 1, k, 0, draft_s=0.004, verify_s=0.080)  # the probe fails
    assert waits == [4, 8, 16, 32, 64, 64]
    feed(policy, 1, 4, 4, draft_s=0.004, verify_s=0.080)  # a probe that pays switches it on
    assert policy.next_k() > 0


def test_plain_run_says_how_many_plain_steps_come_before_the_next_probe():
    """The loop streams a run of plain steps as one call, as long as the policy says it will last:
    up to the next probe while speculation is off, one step when it only measures plain decoding."""
    policy = DraftLengthPolicy(initial=4, max_tokens=8, optimism=0.0, explore_plain_every=10)
    policy.observe_plain(0.040)
    feed(policy, 4, 4, 0, draft_s=0.004, verify_s=0.080)  # two "plain" verdicts in a row: off
    runs = []
    for _ in range(3):
        assert policy.next_k() == 0
        run = policy.plain_run()
        for left in range(run, 0, -1):  # every step of the run agrees on what is left, itself included
            assert policy.plain_run() == left
            policy.observe_plain(0.040)
            if left > 1:
                assert policy.next_k() == 0
        runs.append(run)
        k = policy.next_k()  # the probe comes exactly when the run ends
        assert k > 0
        feed(policy, 1, k, 0, draft_s=0.004, verify_s=0.080)
    assert runs == [4, 8, 16]
    on = DraftLengthPolicy(initial=4, max_tokens=8, explore_plain_every=10)
    feed(on, 3, 4, 4)
    assert on.next_k() == 0 and on.plain_run() == 1  # measuring plain decoding: one step


def test_no_probe_while_the_target_says_it_would_verify_no_draft():
    """The target's draft_limit of each plain step: 0 holds the probes back (fixed and adaptive
    lengths alike) and makes a plain run last until it says otherwise; once it says more, or nothing, the
    probe that was due comes at once."""
    for policy in (DraftLengthPolicy(initial=4, max_tokens=4, probe_every=3, adapt=False),
                   DraftLengthPolicy(initial=4, max_tokens=8, probe_every=3, first_probe_after=3)):
        policy.observe_cycle(0, 0, 0.0, 0.05)
        policy.limit(0)  # trimmed to nothing: plain decoding
        for step in range(40):
            assert policy.next_k() == 0
            # Once a plain step said 0: one streamed run until the target allows a probe.
            assert policy.plain_run() == (UNTIL_TOLD if step else policy._probe_interval)
            policy.observe_plain(0.05, draft_limit=0)
        policy.observe_plain(0.05, draft_limit=2)
        assert policy.next_k() > 0  # overdue: at once
        policy.observe_cycle(0, 0, 0.0, 0.05)
        policy.limit(0)
        waits = 0
        while policy.next_k() == 0:
            policy.observe_plain(0.05, draft_limit=None)  # an older target, or a session alone
            waits += 1
        assert 0 < waits <= 48  # probed on the usual (doubled) interval


def test_a_session_the_target_refuses_at_its_start_decodes_plainly_until_told_otherwise():
    for policy in (DraftLengthPolicy(initial=4, max_tokens=4, adapt=False), DraftLengthPolicy(initial=4)):
        policy.start_refused()
        for _ in range(40):
            assert policy.next_k() == 0 and policy.plain_run() == UNTIL_TOLD
            policy.observe_plain(0.05, draft_limit=0)
        policy.observe_plain(0.05, draft_limit=4)
        assert policy.next_k() == 4  # 41 plain steps: the probe is overdue


@pytest.mark.parametrize("argv, adaptive_max, plain_streaming, warm_start", [
    ([], 8, True, True),
    (["--max-adaptive-draft-tokens", "12", "--plain-decoding", "calls", "--adaptive-warm-start", "off"], 12, False,
     False),
])
def test_coordinator_flags_for_the_draft_length_and_plain_decoding(argv, adaptive_max, plain_streaming, warm_start):
    """The adaptive policy stays within 8 drafted tokens by default (the target's CUDA graphs cover a
    verify of 8: GPU runs with drafts of up to 16 ran their longer verifies eagerly); plain runs stream
    unless --plain-decoding calls."""
    import argparse

    from coordinator.settings import add_arguments, settings_from_args
    from specdec.server.settings import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser, environ={})
    base = ["--plaintext", "--tokenizer", "t", "--redis-url", "redis://x", "--target-plaintext", "--draft-plaintext"]
    settings = settings_from_args(parser.parse_args(base + argv))
    assert (settings.max_adaptive_draft_tokens, settings.plain_streaming) == (adaptive_max, plain_streaming)
    assert settings.adaptive_warm_start is warm_start
    with pytest.raises(ConfigError, match="--max-adaptive-draft-tokens must be >= 1"):
        settings_from_args(parser.parse_args(base + ["--max-adaptive-draft-tokens", "0"]))


def pipelined_cycle(rng, k, ahead, alpha=0.8, draft_s=0.002, overhead_s=0.0038, ahead_overhead_s=0.0023):
    """One pipelined cycle of k drafted tokens with two GPUs' costs (round 21: 1B draft 2 ms a token,
    8B verify 7.6 ms + 0.07 ms a token), each token accepted with probability alpha: (its wall time,
    the model time on its critical path, the draft's model time, the verify's, the draft forwards it
    paid for, tokens accepted, whether its successor drafted beside it is the next block)."""
    before = 0.0 if ahead else k * draft_s  # the Propose before the verify (none after a hit)
    beside = (k + 1) * draft_s  # the guess and k tokens, drafted during the verify
    verify = 0.0076 + 0.00007 * (k + 1)
    critical = before + max(verify, beside)
    wall = critical + (ahead_overhead_s if ahead else overhead_s)
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    hit = accepted == k and rng.random() < alpha  # and the guessed bonus token was the target's
    return wall, critical, before + beside, verify, (0 if ahead else k) + k + 1, accepted, hit


def simulate_pipelined(policy, cycles=1500, alpha=0.8, plain_s=0.0067, honest=True, seed=0):
    """Tokens per second of pipelined cycles (pipelined_cycle; a plain step 6.3 + 0.4 ms), reported to
    the policy as the loop reports them. honest=False: as the loop did before round 22: every draft
    forward charged to the verified block, the overhead clamped."""
    rng = random.Random(seed)
    ahead, seconds, tokens = False, 0.0, 0
    for _ in range(cycles):
        k = policy.next_k()
        if k == 0:
            policy.observe_plain(plain_s - 0.0004, 0.0004)
            seconds, tokens, ahead = seconds + plain_s, tokens + 1, False
            continue
        wall, critical, draft, verify, steps, accepted, hit = pipelined_cycle(rng, k, ahead, alpha)
        if honest:
            policy.observe_cycle(k, accepted, draft, verify, wall - critical, draft_steps=steps, drafted_ahead=ahead,
                                 beside=True)
        else:
            policy.observe_cycle(k, accepted, draft, verify, max(0.0, wall - draft - verify))
        seconds, tokens, ahead = seconds + wall, tokens + accepted + 1, hit
    return tokens / seconds


def test_pipelined_cycles_are_priced_with_their_hits():
    """A pipelined hit skips the Propose and hides the drafting behind the verify. Priced so, the
    adaptive length comes within a few percent of the best fixed one; priced as sequential cycles it
    drafted ~1 token and lost to every fixed k from 2 to 5 (two GPUs: 1.05x against k = 4's 1.14x)."""
    fixed = {k: simulate_pipelined(DraftLengthPolicy(k, k, adapt=False)) for k in range(1, 9)}
    best = max(fixed.values())
    assert max(fixed, key=fixed.get) in (2, 3, 4)
    adaptive = simulate_pipelined(DraftLengthPolicy(4, 8, confidence_stop=False))
    assert adaptive >= 0.97 * best
    naive = simulate_pipelined(DraftLengthPolicy(4, 8, confidence_stop=False), honest=False)
    assert naive < 0.9 * best


def test_a_hit_is_a_whole_block_accepted_and_the_guess_right():
    policy = DraftLengthPolicy(initial=4, max_tokens=8, prior_trials=0.01)
    for _ in range(30):  # 3 of 4 accepted, each cycle: positions 0-2 always, position 3 never
        policy.observe_cycle(4, 3, 0.008, 0.008, 0.003, draft_steps=9, drafted_ahead=False, beside=True)
    # A block of 2 is accepted whole and its guess (judged as position 2) right; one of 3 never is.
    assert policy.hit_probability(2) > 0.95 and policy.hit_probability(3) < 0.05
    # Sequential and pipelined prices of the same measurements: the pipelined one is cheaper.
    pipelined = policy.cycle_cost(4)
    policy.observe_cycle(4, 3, 0.008, 0.008, 0.003, draft_steps=4)  # a sequential cycle (gate closed)
    assert policy.cycle_cost(4) > pipelined


def test_a_few_graph_captures_inside_verifies_do_not_switch_a_paying_draft_off():
    """Past its warm-up context a GPU target captures a CUDA graph the first time a step shape is
    used (~0.2 s for the 8B shape, inside that forward's model time). The adaptive length tries
    several lengths, so it meets most of them: on a 3,300-token prompt at alpha 0.8-0.9 it learned
    the captures as the price of verifying, switched off, and ran 2.1x slower than k = 3 (round 26).
    A forward counts at most outlier_ratio times what the fit expects of its size."""
    policy = DraftLengthPolicy(initial=4, max_tokens=8)
    rng = random.Random(0)
    policy.observe_plain(0.0065)
    for _ in range(12):  # two GPUs' costs (round 23): the 1B draft 2.4 ms a token, the 8B verify 8 ms
        k = max(1, policy.next_k())
        accepted = next((j for j in range(k) if rng.random() > 0.85), k)
        policy.observe_cycle(k, accepted, 0.0024 * k, 0.008 + 0.0001 * k, 0.003)
    assert policy.next_k() >= 3
    for capture in range(5):  # a new key bucket: each length's first verify captures its graph
        k = max(1, policy.next_k())
        policy.observe_cycle(k, min(k, 3), 0.0024 * k, 0.2, 0.003)
        assert policy.next_k() >= 2, capture
    assert policy.verify_cost(5) < 0.015  # 8 ms learned; 83 ms, switched off after two captures, unclamped
