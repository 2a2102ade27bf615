"""Replay proposer: a draft model's real forward passes with a chosen acceptance rate.

For model-scale benchmarks where no trained draft of that size exists (../shared/docs/MODELS.md):
the draft model runs exactly the forward passes a real draft would (real cost, batched like any
draft), but the token it proposes at absolute position p is the target's own greedy token there
with probability alpha, else another token. The target's greedy tokens come from references: full
sequences (prompt + the target's plain greedy output) recorded beforehand. Under greedy
verification every position is then accepted independently with probability alpha, so a cycle of k
tokens commits (1 - alpha^(k+1)) / (1 - alpha) tokens on average, which is what the ideal speedup
assumes.

The draws are keyed on (seed, reference, position), never on call order (one table of draws per
reference): re-drafting a position gives the same decision, and runs repeat exactly. Proposals are
point masses, so verification stays lossless under any sampling mode; with no matching reference
(another prompt, a sampled output that left the greedy path) a proposed token is the draft model's
own. The draft's KV cache holds its own tokens where the replayed ones differ: it costs the same,
and its logits are used only without a reference. alpha is an input of the benchmark, never a result.

With a spread, each reference (each prompt) gets its own alpha, evenly spaced over alpha +- spread
(clipped to [0, 1]) in an order shuffled by the seed: real prompts differ in how predictable they are
(the default pair's Spec-Bench categories range from 0.57 to 0.83 agreement, docs/DISTILLATION.md),
and one alpha for every prompt hides what a per-session draft length is for.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.models.base import CausalLM
from specdec.proposers.base import NextTokens
from specdec.proposers.draft_model import DraftModelProposer
from specdec.types import DraftBlock


class ReplayProposer(DraftModelProposer):
    name = "replay"

    def __init__(self, model: CausalLM, references: Sequence[Sequence[int]], alpha: float, seed: int = 0,
                 spread: float = 0.0):
        if not 0.0 <= alpha <= 1.0:
            raise InvalidArgument(f"replay alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= spread <= 1.0:
            raise InvalidArgument(f"replay alpha spread must be in [0, 1], got {spread}")
        super().__init__(model, top_m=0)
        self.references = [list(map(int, r)) for r in references]
        self.alpha, self.seed = alpha, seed
        self.alphas = reference_alphas(len(self.references), alpha, spread, seed)
        self._reference_of: dict[str, int | None] = {}  # session id -> index into references
        self._draws: dict[int, np.ndarray] = {}  # reference -> its draws (_draws_of)
        self._missed: dict[str, list[int]] = {}  # session id -> a sequence no reference holds (_reference)

    def close(self, state) -> None:
        self._reference_of.pop(state.session_id, None)
        self._missed.pop(state.session_id, None)
        super().close(state)

    def propose_batch(self, requests: Sequence) -> list[DraftBlock | Exception]:
        """The draft model's own proposals (its real forward passes), then each token replaced by
        the replayed one. requests are propose()'s arguments: (state, token_ids, num_tokens, params).
        No confidence stop and no confidences: the draft's own are not those of the replayed tokens,
        whose acceptance the benchmark sets."""
        requests = [tuple(request[:4]) for request in requests]
        results = super().propose_batch(requests)
        replayed: list[DraftBlock | Exception] = []
        for (state, token_ids, _, _), block in zip(requests, results):
            if isinstance(block, Exception) or block.num_tokens == 0:
                replayed.append(block)
                continue
            reference = self._reference(state.session_id, token_ids)
            own = block.token_ids.tolist()
            tokens = [self._choose(reference, len(token_ids) + i, token) for i, token in enumerate(own)]
            replayed.append(DraftBlock(token_ids=torch.tensor(tokens, dtype=torch.long)))
        return replayed

    def rank_batch(self, requests: Sequence, num_ranked: int) -> list[NextTokens | None | Exception]:
        """The replayed token first, then the draft model's own ranking. Note for benchmarks: where
        the replayed token is a wrong one, it is a random token, so the model's own best token is a
        far better guess of the target's than a real draft's runner-up would be."""
        ranked = super().rank_batch(requests, num_ranked)
        out: list[NextTokens | None | Exception] = []
        for (state, token_ids, _), next_tokens in zip(requests, ranked):
            if next_tokens is None or isinstance(next_tokens, Exception):
                out.append(next_tokens)
                continue
            own = self._choose(self._reference(state.session_id, token_ids), len(token_ids), next_tokens.own)
            out.append(NextTokens(own, (own, *(t for t in next_tokens.ranked if t != own))[:num_ranked]))
        return out

    def _reference(self, session_id: str, token_ids: Sequence[int]) -> int | None:
        """The reference this session follows: the one whose prefix is the committed sequence. A
        session that left every reference (a bf16 near-tie flipped, a sampled token) is remembered
        with the sequence that matched none: a sequence extending it matches none either, so its next
        drafts skip the search (every reference compared, for every row of every pass: some 0.3 ms a
        row at 64 references, which the benchmark priced as the draft's)."""
        index = self._reference_of.get(session_id)
        if index is not None and self._extends(self.references[index], token_ids):
            return index
        missed = self._missed.get(session_id)
        if missed is not None and len(token_ids) >= len(missed) and list(token_ids[:len(missed)]) == missed:
            return None
        index = next((i for i, ref in enumerate(self.references) if self._extends(ref, token_ids)), None)
        self._reference_of[session_id] = index
        if index is None:
            self._missed[session_id] = list(token_ids)
        else:
            self._missed.pop(session_id, None)
        return index

    @staticmethod
    def _extends(reference: list[int], token_ids: Sequence[int]) -> bool:
        return len(reference) > len(token_ids) and reference[: len(token_ids)] == list(token_ids)

    def _draws_of(self, reference: int) -> np.ndarray:
        """The reference's two draws per position [len, 2], drawn once: a generator a token (keyed on
        the position) cost 11 us, some 0.35 ms of a draft pass of 8 rows x 4 tokens that a real draft
        does not pay, and the benchmark priced it as the draft's."""
        draws = self._draws.get(reference)
        if draws is None:
            generator = np.random.default_rng([self.seed, reference])
            draws = self._draws[reference] = generator.random((len(self.references[reference]), 2))
        return draws

    def _choose(self, reference: int | None, position: int, own_token: int) -> int:
        if reference is None or position >= len(self.references[reference]):
            return own_token
        true_token = self.references[reference][position]
        accept_draw, other_draw = self._draws_of(reference)[position]
        if accept_draw < self.alphas[reference]:
            return true_token
        vocab = self.model.info.vocab_size
        return (true_token + 1 + int(other_draw * (vocab - 1))) % vocab  # any token but the true one


def reference_alphas(count: int, alpha: float, spread: float, seed: int) -> list[float]:
    """Each reference's alpha: evenly spaced over alpha - spread .. alpha + spread, clipped to [0, 1],
    assigned in an order shuffled by the seed (not by the prompts' order, which groups categories)."""
    if spread == 0.0 or count < 2:
        return [alpha] * count
    ranks = np.random.default_rng([seed, count]).permutation(count)
    return [float(np.clip(alpha + spread * (2.0 * r / (count - 1) - 1.0), 0.0, 1.0)) for r in ranks]
