"""Seeded samples of the real path (draft sampling, verify_batch, Philox) match the target's
distribution by a chi-square test: the first emitted token and the first two-token sequence.

100k independent sessions (seed = session index) are verified in one verify_batch call per cycle;
test_sampling_batched.py shows verify_batch equals verify_block outcome for outcome. Drafting is
vectorised the same way: one rng.sample_rows call over every session's sparse draft row, checked
against sample_draft_token on a prefix of the sessions.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import torch
from scipy import stats

from specdec.sampling import rng
from specdec.sampling.batched import verify_batch
from specdec.sampling.draft import pack_sparse, sample_draft_token
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.rng import Stream
from specdec.sampling.verify import sample_next
from specdec.sampling.warp import warp_logits
from specdec.types import DraftBlock
from sampling_helpers import block_logits, prefix_model, single_torch_thread  # noqa: F401

VOCAB = 6
K = 2
SESSIONS = 100_000
POSITION = 2
PROMPT = (1, 4)
BASE = SamplingParams(temperature=0.8, top_k=5)
TARGET = prefix_model("stats-target", VOCAB, scale=1.0)
DRAFT = prefix_model("stats-draft", VOCAB, scale=1.0)
MIN_P_VALUE = 1e-3  # seeded, so deterministic; a real bias gives p-values far below this


@functools.lru_cache(maxsize=None)
def _draft_row(context: tuple[int, ...]):
    """The sparse distribution sample_draft_token sends for this context (ids [m], probs [m])."""
    _, ids, probs = sample_draft_token(DRAFT(context), BASE, position=0)
    return ids, probs


@functools.lru_cache(maxsize=None)
def _block(prefix: tuple[int, ...], tokens: tuple[int, ...]):
    rows = [_draft_row(prefix + tokens[:j]) for j in range(len(tokens))]
    draft = DraftBlock(torch.tensor(tokens, dtype=torch.long), *pack_sparse(rows))
    return block_logits(TARGET, prefix, draft), draft


def _draft_tokens(contexts: list[tuple[int, ...]], seeds: np.ndarray, position: int) -> list[int]:
    """sample_draft_token for every session at once: same sparse rows, same DRAFT uniforms."""
    rows = [_draft_row(context) for context in contexts]
    ids, probs = pack_sparse(rows)  # [n, m], zero-padded columns are never drawn
    index = rng.sample_rows(probs, seeds, np.full(len(contexts), position), Stream.DRAFT)
    return ids[torch.arange(len(contexts)), index].tolist()


def _cycle(prefixes: list[tuple[int, ...]], seeds: np.ndarray, position: int):
    """One draft + verify cycle for every session; returns the tokens each session emits."""
    drafted: list[tuple[int, ...]] = [()] * len(prefixes)
    for j in range(K):
        contexts = [prefix + tokens for prefix, tokens in zip(prefixes, drafted)]
        new = _draft_tokens(contexts, seeds, position + j)
        drafted = [tokens + (token,) for tokens, token in zip(drafted, new)]
    blocks = [_block(prefix, tokens) for prefix, tokens in zip(prefixes, drafted)]
    params = [SamplingParams(BASE.temperature, BASE.top_k, BASE.top_p, int(seed)) for seed in seeds]
    outcomes = verify_batch([logits for logits, _ in blocks], [draft for _, draft in blocks],
                            params, [position] * len(prefixes))
    return [tokens[: o.num_accepted] + (o.next_token,) for tokens, o in zip(drafted, outcomes)]


def _chi_square(observed: Counter, expected: dict) -> float:
    """p-value of the counts against a distribution (cells with zero probability must be empty)."""
    assert set(observed) <= {cell for cell, p in expected.items() if p > 0}, "impossible output"
    cells = [cell for cell, p in expected.items() if p > 0]
    counts = np.array([observed.get(cell, 0) for cell in cells], dtype=np.float64)
    probs = np.array([expected[cell] for cell in cells])
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


def _probs(context):
    return warp_logits(TARGET(context), BASE).double().tolist()


def test_first_token_and_first_two_tokens_follow_the_target():
    seeds = np.arange(SESSIONS, dtype=np.uint64)
    # The vectorised drafting is sample_draft_token's own computation.
    for seed in range(200):
        params = SamplingParams(BASE.temperature, BASE.top_k, BASE.top_p, seed)
        assert _draft_tokens([PROMPT], seeds[seed: seed + 1], POSITION) == [
            sample_draft_token(DRAFT(PROMPT), params, POSITION)[0]]

    emitted = _cycle([PROMPT] * SESSIONS, seeds, POSITION)
    first = Counter(tokens[0] for tokens in emitted)
    target_first = dict(enumerate(_probs(PROMPT)))
    assert _chi_square(first, target_first) > MIN_P_VALUE
    # Power check: the same counts clearly reject a slightly wrong distribution (target mixed
    # 10% with the draft's).
    draft_first = warp_logits(DRAFT(PROMPT), BASE).double().tolist()
    mixed = {t: 0.9 * target_first[t] + 0.1 * draft_first[t] for t in range(VOCAB)}
    assert _chi_square(Counter({t: first.get(t, 0) for t in mixed if mixed[t] > 0}), mixed) < 1e-6
    assert 0.2 < sum(len(tokens) > 1 for tokens in emitted) / SESSIONS < 0.95  # real rejections

    # Sessions that emitted a single token run a second cycle from the next position.
    short = [i for i, tokens in enumerate(emitted) if len(tokens) == 1]
    second = _cycle([PROMPT + emitted[i] for i in short], seeds[short], POSITION + 1)
    for i, tokens in zip(short, second):
        emitted[i] = emitted[i] + tokens
    pairs = Counter(tokens[:2] for tokens in emitted)
    target_pairs = {(a, b): target_first[a] * _probs(PROMPT + (a,))[b]
                    for a in range(VOCAB) for b in range(VOCAB)}
    assert _chi_square(pairs, target_pairs) > MIN_P_VALUE


def test_gumbel_mode_plain_decoding_samples_the_target():
    params = SamplingParams(BASE.temperature, BASE.top_k, BASE.top_p, 3, SamplingMode.GUMBEL)
    draws = 20_000
    log_probs = torch.log(warp_logits(TARGET(PROMPT), params).double())  # [vocab]
    noise = torch.stack([rng.gumbel_noise(3, position, VOCAB) for position in range(draws)])
    tokens = (log_probs + noise).argmax(dim=-1).tolist()  # sample_next, vectorised:
    assert tokens[:300] == [sample_next(TARGET(PROMPT), params, p) for p in range(300)]
    assert _chi_square(Counter(tokens), dict(enumerate(_probs(PROMPT)))) > MIN_P_VALUE


def test_draft_tokens_follow_the_distribution_they_are_sent_with():
    params = SamplingParams(temperature=1.2, seed=6)
    draws = 50_000
    _, ids, probs = sample_draft_token(DRAFT(PROMPT), params, 0, top_m=3)
    index = rng.sample_rows(probs.expand(draws, -1), np.full(draws, 6), np.arange(draws),
                            Stream.DRAFT)
    tokens = ids[index].tolist()  # sample_draft_token, vectorised:
    assert tokens[:300] == [sample_draft_token(DRAFT(PROMPT), params, p, top_m=3)[0]
                            for p in range(300)]
    sent = dict(zip(ids.tolist(), probs.double().tolist()))
    assert _chi_square(Counter(tokens), {t: sent.get(t, 0.0) for t in range(VOCAB)}) > MIN_P_VALUE
