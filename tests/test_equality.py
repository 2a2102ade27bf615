"""The equality rule: exact match, a numerical near-tie at the first divergence, a real failure."""

from __future__ import annotations

import torch

from specdec.generation.equality import compare_outputs


def logits_with(gap: float, a: int, b: int, vocab: int = 8) -> torch.Tensor:
    logits = torch.full((vocab,), -5.0)
    logits[a], logits[b] = 3.0, 3.0 - gap
    return logits


def test_identical_outputs_are_equal():
    report = compare_outputs([1, 2], [5, 6, 7], [5, 6, 7])
    assert report.equal and report.passed and report.divergence is None


def test_divergence_at_a_near_tie_is_a_tie_not_a_failure():
    seen = []

    def next_logits(prefix):
        seen.append(list(prefix))
        return logits_with(1e-3, a=6, b=4)

    report = compare_outputs([1, 2], [5, 4, 9], [5, 6, 7], next_logits, tie_threshold=1e-2)
    assert not report.equal and report.tie and report.passed
    assert report.divergence == 1 and abs(report.logit_gap - 1e-3) < 1e-6
    assert seen == [[1, 2, 5]]  # re-scored at the divergence, after the shared prefix


def test_divergence_with_a_clear_gap_fails():
    report = compare_outputs([1], [3, 4], [3, 5], lambda prefix: logits_with(2.0, a=5, b=4), tie_threshold=1e-2)
    assert not report.passed and report.logit_gap == 2.0


def test_fp32_rule_has_no_tolerance_and_lengths_must_match():
    assert not compare_outputs([1], [3, 4], [3, 5], lambda p: logits_with(0.0, 5, 4)).passed
    assert not compare_outputs([1], [3, 4], [3, 4, 5]).passed
