"""Adaptive draft length: Leviathan's expected-tokens-per-time rule on measured costs."""

from __future__ import annotations

import asyncio

import pytest

from specdec.generation.adaptive import DraftLengthPolicy, expected_tokens


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
    policy._verify_s[1] = 0.010
    assert policy.next_k() == 8


def test_a_useless_draft_is_switched_off_and_probed_again_later():
    policy = DraftLengthPolicy(initial=4, max_tokens=8, probe_every=5)
    policy.observe_plain(0.010)
    feed(policy, 10, 4, 0, draft_s=0.002, verify_s=0.012)
    assert policy.next_k() == 0
    for _ in range(5):
        policy.observe_plain(0.010)
    assert policy.next_k() == 4  # the probe cycle
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

    from specdec.generation.loop import LoopSettings
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
