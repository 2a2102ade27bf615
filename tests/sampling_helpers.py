"""Shared helpers of the tests/test_sampling_*.py files: tiny prefix-dependent models and a loop
that drafts and verifies with the real sampling functions."""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch

from specdec.proposers.copy_guess import CopyIndex, CopyRule, copied_token
from specdec.sampling.draft import draft_confidence, pack_sparse, sample_draft_token
from specdec.sampling.params import SamplingParams
from specdec.sampling.verify import sample_next, verify_block
from specdec.types import DraftBlock


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    """Run on one intra-op thread: these tests make thousands of tiny tensor calls, and on a busy
    2-core machine torch's thread pool turns a 7 us softmax into milliseconds. Import this
    fixture into a test module to apply it there."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def prefix_model(salt: str, vocab_size: int, scale: float = 2.0):
    """Logits as a deterministic pseudo-random function of the whole prefix tuple.

    Every position sees a different distribution, so a verifier that pairs a drafted token with
    the wrong target row, or keys randomness on the wrong position, produces a wrong answer.
    """

    @functools.lru_cache(maxsize=None)
    def logits(prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        digest = hashlib.sha256(repr((salt, prefix)).encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(vocab_size, generator=generator) * scale

    return logits


def noisy_copy(target_logits, salt: str, vocab_size: int, noise: float):
    """A draft model that approximates `target_logits`: its logits plus prefix-dependent noise."""
    perturbation = prefix_model(salt, vocab_size, scale=noise)

    def logits(prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        return target_logits(prefix) + perturbation(prefix)

    return logits


def point_proposer(salt: str, vocab_size: int):
    """A deterministic proposer (n-gram-like): one token per prefix, no distribution."""

    def propose(prefix: tuple[int, ...]) -> int:
        digest = hashlib.sha256(repr((salt, prefix)).encode()).digest()
        return digest[0] % vocab_size

    return propose


def draft_block(draft_logits, prefix: tuple[int, ...], k: int, params: SamplingParams,
                top_m: int = 0, proposer=None, stop_below: float = 0.0, copy: CopyRule | None = None,
                copy_decides_on_the_sample: bool = False) -> DraftBlock:
    """Draft k tokens after `prefix` (position len(prefix) onwards) with sample_draft_token, or
    with a point-mass `proposer` when given. stop_below: stop after the token at which the product
    of the draft's confidences falls below it (DraftModelProposer's dynamic draft length). copy:
    DraftModelProposer's copy rule (copy_guess.py) over `prefix`, the committed sequence;
    copy_decides_on_the_sample: the wrong rule, deciding on the sampled token's probability."""
    tokens: list[int] = []
    rows = []
    survival = 1.0
    index = CopyIndex(copy.ngram) if copy is not None else None
    if index is not None:
        index.sync(prefix)
    for i in range(k):
        context = prefix + tuple(tokens)
        if proposer is not None:
            tokens.append(proposer(context))
            continue
        logits = draft_logits(context)
        token, ids, probs = sample_draft_token(logits, params, len(prefix) + i, top_m)
        if index is not None:
            top = draft_confidence(logits, token, ids, probs, params.greedy) if params.greedy else float(probs.max())
            if copy_decides_on_the_sample:
                top = float(probs[ids == token].sum())
            copied = copied_token(copy, index, context, top)
            if copied is not None:
                token, ids, probs = copied, torch.tensor([copied]), torch.tensor([1.0])
        tokens.append(token)
        rows.append((ids, probs))
        survival *= draft_confidence(logits, token, ids, probs, params.greedy)
        if survival < stop_below:
            break
    token_ids = torch.tensor(tokens, dtype=torch.long)
    if proposer is not None:
        return DraftBlock(token_ids)
    ids, probs = pack_sparse(rows)
    return DraftBlock(token_ids, ids, probs)


def block_logits(target_logits, prefix: tuple[int, ...], draft: DraftBlock) -> torch.Tensor:
    """The target's [k + 1, vocab] logits for a block: row i conditions on drafted tokens < i."""
    tokens = tuple(draft.token_ids.tolist())
    return torch.stack([target_logits(prefix + tokens[:i]) for i in range(len(tokens) + 1)])


def speculative_generate(target_logits, draft_logits, prompt: tuple[int, ...], length: int,
                         params: SamplingParams, k: int, top_m: int = 0):
    """Draft, verify, commit until `length` tokens are emitted (the sequential speculative loop).

    Returns (the first `length` emitted tokens, the VerifyOutcome of every cycle).
    """
    sequence = tuple(prompt)
    outcomes = []
    while len(sequence) - len(prompt) < length:
        draft = draft_block(draft_logits, sequence, k, params, top_m)
        outcome = verify_block(block_logits(target_logits, sequence, draft), draft, params,
                               len(sequence))
        outcomes.append(outcome)
        sequence += tuple(draft.token_ids.tolist()[: outcome.num_accepted]) + (outcome.next_token,)
    return list(sequence[len(prompt): len(prompt) + length]), outcomes


def plain_generate(target_logits, prompt: tuple[int, ...], length: int,
                   params: SamplingParams) -> list[int]:
    """Plain decoding with sample_next: what the baseline pool emits."""
    sequence = tuple(prompt)
    for _ in range(length):
        sequence += (sample_next(target_logits(sequence), params, len(sequence)),)
    return list(sequence[len(prompt):])
