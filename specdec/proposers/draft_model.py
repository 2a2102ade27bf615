"""Draft-model proposer: a small causal LM with the target's tokenizer drafts k tokens.

Each drafted token comes with the exact distribution it was sampled from (the draft's logits warped
with the request's parameters, optionally cut to its top_m entries and renormalised). Sending
exactly that distribution is what keeps verification lossless (Leviathan et al. 2023, sec. 2.3).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from specdec.errors import CacheFull, InvalidArgument
from specdec.models.base import CausalLM, ModelInfo
from specdec.sampling.draft import pack_sparse, sample_draft_token
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock

import torch


@dataclass
class _DraftSlot:
    session_id: str
    slot: int | None = None


class DraftModelProposer:
    name = "draft-model"

    def __init__(self, model: CausalLM, top_m: int = 64):
        if top_m < 0:
            raise InvalidArgument(f"top_m must be >= 0 (0 = full distribution), got {top_m}")
        self.model = model
        self.top_m = top_m
        self._open: OrderedDict[str, _DraftSlot] = OrderedDict()  # least recently used first

    def info(self) -> ModelInfo | None:
        return self.model.info

    def open(self, session_id: str) -> _DraftSlot:
        state = _DraftSlot(session_id)
        self._open[session_id] = state
        return state

    def close(self, state: _DraftSlot) -> None:
        if state.slot is not None:
            self.model.free(state.slot)
            state.slot = None
        self._open.pop(state.session_id, None)

    def rollback(self, state: _DraftSlot, length: int) -> None:
        if state.slot is not None and self.model.length(state.slot) > length:
            self.model.truncate(state.slot, length)

    def propose(
        self, state: _DraftSlot, token_ids: Sequence[int], num_tokens: int, params: SamplingParams
    ) -> DraftBlock:
        # The last drafted token needs no forward, hence the + 1: room for len + num_tokens - 1.
        num_tokens = min(num_tokens, self.model.info.max_context - len(token_ids) + 1)
        if num_tokens <= 0 or not token_ids:
            return DraftBlock.empty()
        slot = self._ensure_slot(state)
        cached = self.model.length(slot)
        if cached >= len(token_ids):  # logits after the last token need that token fed again
            cached = len(token_ids) - 1
            self.model.truncate(slot, cached)
        feed = list(token_ids[cached:])
        drafted: list[int] = []
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(num_tokens):
            logits = self.model.forward([slot], [feed], [1])[0][-1]  # [vocab]
            token, ids, probs = sample_draft_token(logits, params, len(token_ids) + i, self.top_m)
            drafted.append(token)
            rows.append((ids, probs))
            feed = [token]
        token_tensor = torch.tensor(drafted, dtype=torch.long)
        if params.greedy:  # a greedy draft is a point mass: nothing to send
            return DraftBlock(token_ids=token_tensor)
        prob_ids, draft_probs = pack_sparse(rows)
        return DraftBlock(token_ids=token_tensor, draft_prob_ids=prob_ids, draft_probs=draft_probs)

    def _ensure_slot(self, state: _DraftSlot) -> int:
        self._open.move_to_end(state.session_id)
        if state.slot is not None:
            return state.slot
        while True:
            try:
                state.slot = self.model.allocate()
                return state.slot
            except CacheFull:
                # Evict the least recently used other session: it re-feeds its tokens when next used.
                victim = next((s for s in self._open.values() if s.slot is not None and s is not state), None)
                if victim is None:
                    raise
                self.model.free(victim.slot)
                victim.slot = None
