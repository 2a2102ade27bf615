"""Exact enumeration: speculative decoding emits sequences with exactly the target's probabilities.

Every random choice the real code makes goes through rng.bernoulli (acceptance test) and
rng.sample_from_probs (draft sample, recovered and bonus tokens). Here both are replaced by an
oracle that explores every branch and multiplies the probability of the branch taken, so the real
sample_draft_token / verify_block code runs on every path and the probability of each emitted
sequence is computed exactly (Leviathan et al. 2023, Appendix A.1; Chen et al. 2023, Theorem 1,
checked numerically).

The recovered / bonus sample is the last choice of a block; instead of branching on it the oracle
returns a sentinel token, remembers the weights it was asked to sample from, and the test checks
that verify_block emitted the sentinel itself (so no post-processing can hide).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest
import torch

import sampling_helpers
from specdec.proposers.copy_guess import CopyRule, copied_token
from specdec.sampling import rng, verify
from specdec.sampling.params import SamplingParams
from specdec.sampling.rng import Stream
from specdec.sampling.verify import verify_block
from specdec.sampling.warp import warp_logits
from specdec.types import DraftBlock
from sampling_helpers import (  # noqa: F401 (single_torch_thread is an autouse fixture)
    block_logits,
    draft_block,
    point_proposer,
    prefix_model,
    single_torch_thread,
)

SENTINEL = 10**6
PROMPT = (1, 0)


class _Tape:
    """Replays recorded choices, extends them with first options, and weights the path taken."""

    def __init__(self, choices: list[int]):
        self.choices = list(choices)
        self.widths: list[int] = []
        self.weight = 1.0

    def choose(self, weights: list[float]) -> int:
        options = [i for i, w in enumerate(weights) if w > 0]
        at = len(self.widths)
        if at == len(self.choices):
            self.choices.append(0)
        self.widths.append(len(options))
        chosen = options[self.choices[at]]
        self.weight *= weights[chosen] / sum(weights)
        return chosen


def explore(run):
    """Run `run(tape)` once per path through its choices; yields (result, path probability)."""
    choices: list[int] = []
    while True:
        tape = _Tape(choices)
        yield run(tape), tape.weight
        choices = tape.choices
        while choices and choices[-1] + 1 >= tape.widths[len(choices) - 1]:
            choices.pop()
        if not choices:
            return
        choices[-1] += 1


class _Oracle:
    """Stands in for rng's sampling functions; records every (stream, position) it is asked for."""

    def __init__(self, seed: int):
        self.seed = seed
        self.tape: _Tape | None = None
        self.log: list[tuple[Stream, int]] = []
        self.final: list[float] | None = None

    def bernoulli(self, prob, seed, position, stream):
        assert seed == self.seed and stream is Stream.ACCEPT
        self.log.append((stream, position))
        return self.tape.choose([prob, 1.0 - prob]) == 0

    def sample_from_probs(self, probs, seed, position, stream):
        assert seed == self.seed
        self.log.append((stream, position))
        weights = probs.double().tolist()
        if stream is Stream.DRAFT:
            return self.tape.choose(weights)
        assert stream is Stream.RESAMPLE and self.final is None
        self.final = [w / sum(weights) for w in weights]
        return SENTINEL


def _cycle_distribution(oracle, target, draft_logits, prefix, k, params, top_m, proposer, stop_below=0.0):
    """Exact distribution of the tokens one draft+verify cycle emits after `prefix`."""
    position = len(prefix)
    emitted = defaultdict(float)

    def run_draft(tape):
        oracle.tape, oracle.log = tape, []
        block = draft_block(draft_logits, prefix, k, params, top_m, proposer, stop_below)
        assert oracle.log == [(Stream.DRAFT, position + i) for i in range(len(oracle.log))]
        return block

    for block, draft_weight in explore(run_draft):
        logits = block_logits(target, prefix, block)

        def run_verify(tape):
            oracle.tape, oracle.log, oracle.final = tape, [], None
            return verify_block(logits, block, params, position), oracle.final, oracle.log

        for (outcome, final, log), verify_weight in explore(run_verify):
            tokens = tuple(block.token_ids.tolist()[: outcome.num_accepted])
            if params.greedy:
                emitted[tokens + (outcome.next_token,)] += draft_weight * verify_weight
                continue
            _check_streams(log, outcome)
            for token, weight in enumerate(final):
                if weight > 0:
                    emitted[tokens + (token,)] += draft_weight * verify_weight * weight
    return emitted


def _check_streams(log, outcome):
    """Each decision is keyed on the absolute position of the token it decides, once."""
    assert outcome.next_token == SENTINEL
    tested = [position for stream, position in log if stream is Stream.ACCEPT]
    first = outcome.position
    assert tested == list(range(first, first + len(tested)))
    assert len(tested) == min(outcome.num_accepted + 1, outcome.num_drafted)
    assert log[-1] == (Stream.RESAMPLE, first + outcome.num_accepted)


def speculative_distribution(oracle, target, draft_logits, params, k, length, top_m=0,
                             proposer=None, stop_below=0.0):
    """Probability of every `length`-token continuation of PROMPT under speculative decoding."""

    @functools.lru_cache(maxsize=None)
    def continuations(prefix):
        remaining = length - (len(prefix) - len(PROMPT))
        if remaining <= 0:
            return {(): 1.0}
        result = defaultdict(float)
        cycle = _cycle_distribution(oracle, target, draft_logits, prefix, k, params, top_m,
                                    proposer, stop_below)
        for tokens, weight in cycle.items():
            tokens = tokens[:remaining]
            for rest, rest_weight in continuations(prefix + tokens).items():
                result[tokens + rest] += weight * rest_weight
        return dict(result)

    return continuations(PROMPT)


def plain_distribution(target, params, length, prefix=PROMPT):
    """Probability of every continuation under plain target sampling: a product of warped rows."""
    if length == 0:
        return {(): 1.0}
    target_probs = warp_logits(target(prefix), params).double()
    result = {}
    for token in torch.nonzero(target_probs > 0)[:, 0].tolist():
        rest_distribution = plain_distribution(target, params, length - 1, prefix + (token,))
        for rest, weight in rest_distribution.items():
            result[(token,) + rest] = float(target_probs[token]) * weight
    return result


def _max_difference(left, right):
    return max(abs(left.get(s, 0.0) - right.get(s, 0.0)) for s in set(left) | set(right))


# (name, vocab, k, length, params, draft kind, top_m)
CASES = [
    ("t1.0", 5, 2, 3, SamplingParams(temperature=1.0), "model", 0),
    ("t0.7-topk3-k3", 6, 3, 4, SamplingParams(temperature=0.7, top_k=3), "model", 0),
    ("t1.5-topp0.9", 5, 2, 3, SamplingParams(temperature=1.5, top_p=0.9), "model", 0),
    ("t1.0-topk2-v8-k3", 8, 3, 4, SamplingParams(temperature=1.0, top_k=2), "model", 0),
    ("t0.7-topp0.6", 8, 2, 3, SamplingParams(temperature=0.7, top_p=0.6), "model", 0),
    ("t1.0-topk3-topp0.9", 6, 2, 3, SamplingParams(temperature=1.0, top_k=3, top_p=0.9),
     "model", 0),
    ("t1.5-topk3-topp0.6", 7, 2, 3, SamplingParams(temperature=1.5, top_k=3, top_p=0.6),
     "model", 0),
    ("top-m2-draft", 5, 2, 4, SamplingParams(temperature=1.0), "model", 2),
    ("top-m3-draft-topp0.9-k1", 6, 1, 3, SamplingParams(temperature=0.7, top_p=0.9), "model", 3),
    ("point-mass-draft-k3", 5, 3, 4, SamplingParams(temperature=1.0), "point", 0),
    ("point-mass-draft-topk2", 6, 2, 3, SamplingParams(temperature=0.7, top_k=2), "point", 0),
    ("draft-equals-target", 5, 2, 3, SamplingParams(temperature=1.5), "same", 0),
    ("greedy", 6, 3, 4, SamplingParams(temperature=0.0), "model", 0),
]


def _setup(monkeypatch, name, vocab, params, kind):
    oracle = _Oracle(params.seed)
    monkeypatch.setattr(rng, "bernoulli", oracle.bernoulli)
    monkeypatch.setattr(rng, "sample_from_probs", oracle.sample_from_probs)
    target = prefix_model(f"target-{name}", vocab, scale=1.0)
    draft_logits = target if kind == "same" else prefix_model(f"draft-{name}", vocab, scale=1.0)
    proposer = point_proposer(f"point-{name}", vocab) if kind == "point" else None
    return oracle, target, draft_logits, proposer


@pytest.mark.parametrize("name, vocab, k, length, params, kind, top_m", CASES,
                         ids=[case[0] for case in CASES])
def test_speculative_sequences_have_target_probabilities(monkeypatch, name, vocab, k, length,
                                                         params, kind, top_m):
    oracle, target, draft_logits, proposer = _setup(monkeypatch, name, vocab, params, kind)
    speculative = speculative_distribution(oracle, target, draft_logits, params, k, length, top_m,
                                           proposer)
    plain = plain_distribution(target, params, length)
    assert sum(speculative.values()) == pytest.approx(1.0, abs=1e-9)
    assert _max_difference(speculative, plain) < 1e-6


@pytest.mark.parametrize("stop_below", [0.15, 0.4])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[7], CASES[12]], ids=lambda case: case[0])
def test_a_draft_stopped_by_its_confidence_keeps_target_probabilities(monkeypatch, case, stop_below):
    """Dynamic draft length (the draft stops once the product of its confidences falls below a
    threshold): blocks of different lengths, and every emitted sequence still has exactly the
    target's probability, because where the draft stops depends only on its own outputs."""
    name, vocab, k, length, params, kind, top_m = case
    oracle, target, draft_logits, proposer = _setup(monkeypatch, name, vocab, params, kind)
    lengths = set()
    original = draft_block

    def recording(*args, **kwargs):
        block = original(*args, **kwargs)
        lengths.add(block.num_tokens)
        return block

    monkeypatch.setitem(globals(), "draft_block", recording)
    speculative = speculative_distribution(oracle, target, draft_logits, params, k, length, top_m,
                                           proposer, stop_below)
    assert len(lengths) > 1, "the threshold must stop some drafts early and not others"
    assert sum(speculative.values()) == pytest.approx(1.0, abs=1e-9)
    assert _max_difference(speculative, plain_distribution(target, params, length)) < 1e-6


def _copying(monkeypatch, rule: CopyRule, on_the_sample: bool = False) -> list:
    """Make this module's draft_block apply `rule`; returns the list of the rule's verdicts."""
    verdicts = []

    def recording(*args, **kwargs):
        verdict = copied_token(*args, **kwargs)
        verdicts.append(verdict)
        return verdict

    monkeypatch.setattr(sampling_helpers, "copied_token", recording)
    monkeypatch.setitem(globals(), "draft_block", functools.partial(
        sampling_helpers.draft_block, copy=rule, copy_decides_on_the_sample=on_the_sample))
    return verdicts


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[7], CASES[12]], ids=lambda case: case[0])
def test_a_draft_that_copies_where_it_is_unsure_keeps_target_probabilities(monkeypatch, case):
    """The copy rule (specdec.proposers.copy_guess): where the draft's most likely token has less
    than `below`, a token copied from the sequence is proposed as a point mass instead. Decided on
    the draft's distribution only, so every sequence keeps exactly the target's probability."""
    name, vocab, k, length, params, kind, top_m = case
    oracle, target, draft_logits, proposer = _setup(monkeypatch, name, vocab, params, kind)
    verdicts = _copying(monkeypatch, CopyRule(below=0.7, ngram=1))
    speculative = speculative_distribution(oracle, target, draft_logits, params, k, length, top_m, proposer)
    assert any(v is not None for v in verdicts) and any(v is None for v in verdicts), "the rule must copy sometimes"
    assert sum(speculative.values()) == pytest.approx(1.0, abs=1e-9)
    assert _max_difference(speculative, plain_distribution(target, params, length)) < 1e-6


def test_enumeration_detects_a_copy_decided_on_the_sampled_token(monkeypatch):
    """The check has teeth: copying when the sampled token (not the most likely one) was unlikely
    keeps only likely draws under the distribution sent, and biases the output."""
    name, vocab, k, length, params, kind, top_m = CASES[0]
    oracle, target, draft_logits, proposer = _setup(monkeypatch, name, vocab, params, kind)
    _copying(monkeypatch, CopyRule(below=0.5, ngram=1), on_the_sample=True)
    speculative = speculative_distribution(oracle, target, draft_logits, params, k, length, top_m, proposer)
    assert _max_difference(speculative, plain_distribution(target, params, length)) > 1e-3


def test_enumeration_detects_a_wrong_residual(monkeypatch):
    """The check has teeth: recovering from target_probs instead of the residual is caught."""
    name, vocab, k, length, params, kind, top_m = CASES[0]
    oracle, target, draft_logits, proposer = _setup(monkeypatch, name, vocab, params, kind)
    monkeypatch.setattr(verify, "residual_probs", lambda target_probs, draft_probs: target_probs)
    speculative = speculative_distribution(oracle, target, draft_logits, params, k, length)
    assert _max_difference(speculative, plain_distribution(target, params, length)) > 1e-3


def test_enumeration_detects_rewarped_draft_probs(monkeypatch):
    """Re-warping the draft's distribution on the target side (top-p twice) biases the output."""
    name, vocab, k, length, params, kind, top_m = CASES[2]
    oracle, target, draft_logits, proposer = _setup(monkeypatch, name, vocab, params, kind)
    dense = verify.dense_draft_probs

    def rewarped(draft: DraftBlock, vocab_size: int):
        return warp_logits(torch.log(dense(draft, vocab_size)), params).double()

    monkeypatch.setattr(verify, "dense_draft_probs", rewarped)
    speculative = speculative_distribution(oracle, target, draft_logits, params, k, length)
    assert _max_difference(speculative, plain_distribution(target, params, length)) > 1e-3
