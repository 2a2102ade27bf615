"""Draft-model proposer: a small causal LM with the target's tokenizer drafts k tokens.

Each drafted token comes with the exact distribution it was sampled from (the draft's logits warped
with the request's parameters, optionally cut to its top_m entries and renormalised). Sending
exactly that distribution is what keeps verification lossless (Leviathan et al. 2023, sec. 2.3).
propose_batch drafts for many sessions together (the draft service's continuous batching).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from specdec.errors import CacheFull, InvalidArgument
from specdec.models import cpu_scores
from specdec.models.base import CausalLM, ModelInfo
from specdec.proposers.base import NextTokens
from specdec.proposers.context_columns import ContextColumns, greedy_columns
from specdec.proposers.copy_guess import CopyIndex, CopyRule, copied_token
from specdec.sampling.draft import draft_confidence, pack_sparse, sample_draft_token
from specdec.sampling.params import SamplingParams
from specdec.types import DraftBlock

import torch


@dataclass
class _DraftSlot:
    session_id: str
    slot: int | None = None
    last_used: float = 0.0  # when it last drafted (the proposer's clock): mid-turn sessions keep their slot
    between_turns: bool = False  # its turn ended (EndTurn): its slot may go to another session at once
    # Reduced head only: the session's own tokens that lie outside it, scored as extra columns. Text
    # copies from its context (names, numbers, code identifiers); with these the draft agrees with
    # the target as often as with its full head (docs/DISTILLATION.md) at a fraction of the cost.
    context_ids: list[int] = field(default_factory=list)
    context_scanned: list[int] = field(default_factory=list)  # the sequence they were collected from
    context_tensor: torch.Tensor | None = None
    # What scores them, kept between steps: their rows of the full head, and the ids of every column
    # the draft scores (the head's, then these), so a greedy row picks its token without building
    # a vocabulary-sized vector. Dropped when the context is rebuilt; extended, not regathered, as it grows.
    context_rows: torch.Tensor | None = None
    scored_ids: torch.Tensor | None = None
    copy_index: CopyIndex | None = None  # with a CopyRule: the session's n-grams (copy_guess.py)


# propose()'s arguments, optionally followed by stop_below (see propose()).
ProposeRequest = tuple  # (_DraftSlot, Sequence[int], int, SamplingParams[, float])


@dataclass
class _Drafting:
    """One session's proposal while a batch drafts it."""

    index: int  # in the batch
    state: _DraftSlot
    token_ids: Sequence[int]  # the session's sequence so far
    num_tokens: int
    params: SamplingParams
    feed: list[int] = field(default_factory=list)  # tokens the next forward appends to its slot
    drafted: list[int] = field(default_factory=list)
    sparse: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (ids [m], probs [m])
    num_ranked: int = 0  # rank_batch: how many of the first position's most likely tokens to keep
    ranked: list[int] = field(default_factory=list)
    stop_below: float = 0.0  # stop once the product of the drafted tokens' confidences falls below
    confidences: list[float] = field(default_factory=list)
    survival: float = 1.0  # product of confidences so far

    def block(self) -> DraftBlock:
        token_ids = torch.tensor(self.drafted, dtype=torch.long)
        confidences = tuple(self.confidences)
        if self.params.greedy:  # a greedy draft is a point mass: nothing to send
            return DraftBlock(token_ids=token_ids, confidences=confidences)
        prob_ids, draft_probs = pack_sparse(self.sparse)
        return DraftBlock(token_ids=token_ids, draft_prob_ids=prob_ids, draft_probs=draft_probs,
                          confidences=confidences)

    def add(self, token: int, ids: torch.Tensor, probs: torch.Tensor, confidence: float) -> None:
        """Record a drafted token; end the proposal early once its confidence product drops below
        stop_below. Where to stop depends only on the draft's own tokens and distributions, never on
        the target's, so verification stays exact: it verifies a shorter draft."""
        self.drafted.append(token)
        self.sparse.append((ids, probs))
        self.confidences.append(confidence)
        self.feed = [token]
        self.survival *= confidence
        if self.survival < self.stop_below:
            self.num_tokens = len(self.drafted)


class DraftModelProposer:
    name = "draft-model"

    def __init__(self, model: CausalLM, top_m: int = 64, copy: CopyRule | None = None, evict_after_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        """copy: where the draft is unsure, propose what followed the same n-gram earlier in the
        session instead (copy_guess.py); None or a threshold of 0: never.
        evict_after_s: a session that drafted this recently keeps its KV slot; when every slot is held
        by such sessions a new one is refused (CacheFull: its coordinator decodes plainly and retries)
        instead of evicting one in the middle of a turn, which would re-feed its whole sequence on its
        next cycle and, with more active sessions than slots, on every cycle of every session.
        0: evict the least recently used session whatever its age (a target's hosted draft, whose
        slots mirror the target's sessions)."""
        if top_m < 0:
            raise InvalidArgument(f"top_m must be >= 0 (0 = full distribution), got {top_m}")
        if not evict_after_s >= 0:
            raise InvalidArgument(f"evict_after_s must be >= 0, got {evict_after_s}")
        self.evict_after_s = evict_after_s
        self._clock = clock
        self.evictions = 0  # sessions whose slot went to another (the service's evictions counter)
        self.model = model
        self.top_m = top_m
        self.copy = copy if copy is not None and copy.below > 0 else None
        self._head: torch.Tensor | None = getattr(model, "head_token_ids", None)  # reduced head ids, or None
        self._in_head: list[bool] = []
        self._head_ids: list[int] = []
        if self._head is not None:
            in_head = torch.zeros(model.info.vocab_size, dtype=torch.bool)
            in_head[self._head] = True
            self._in_head = in_head.tolist()
            self._head_ids = self._head.tolist()
            if getattr(model, "device", None) == torch.device("cpu"):
                cpu_scores.warm_up()  # the batched steps' scoring loops (ContextColumns)
        self._open: OrderedDict[str, _DraftSlot] = OrderedDict()  # least recently used first
        self._branch_ids = itertools.count(1)

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

    def end_turn(self, state: _DraftSlot) -> None:
        """The session's turn ended: its cache stays, but its slot is evictable at once, until it drafts again."""
        state.between_turns = True

    def rollback(self, state: _DraftSlot, length: int) -> None:
        if state.slot is not None and self.model.length(state.slot) > length:
            self.model.truncate(state.slot, length)

    def propose(
        self, state: _DraftSlot, token_ids: Sequence[int], num_tokens: int, params: SamplingParams,
        stop_below: float = 0.0,
    ) -> DraftBlock:
        """Draft up to num_tokens tokens. stop_below > 0 ends the draft after the token at which the
        product of the drafted tokens' confidences (the draft's probability of each) falls below it:
        the coordinator's estimate that the rest would not pay (specdec.generation.adaptive)."""
        result = self.propose_batch([(state, token_ids, num_tokens, params, stop_below)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[DraftBlock | Exception]:
        """propose() for many sessions at once: step t of every proposal still drafting runs in one
        forward (proposals differ in length and position; each row is sampled with its own
        parameters at its own position), so the tokens and distributions are those of propose()
        one session at a time. Item i's block, or its own exception, is at index i."""
        results = self._run([(*request[:4], 0, request[4] if len(request) > 4 else 0.0) for request in requests])
        return [r if isinstance(r, Exception) else (r.block() if r is not None else DraftBlock.empty())
                for r in results]

    def rank_batch(self, requests: Sequence[tuple[_DraftSlot, Sequence[int], SamplingParams]],
                   num_ranked: int) -> list[NextTokens | None | Exception]:
        """For each (state, token_ids, params): the token propose(..., 1) would draft next and the
        num_ranked most likely ones by the draft's logits, in one batched forward. None: no room."""
        results = self._run([(state, token_ids, 1, params, num_ranked, 0.0) for state, token_ids, params in requests])
        return [r if r is None or isinstance(r, Exception) else NextTokens(r.drafted[0], tuple(r.ranked))
                for r in results]

    def _run(self, requests: Sequence[tuple]) -> list[_Drafting | None | Exception]:
        results: list[_Drafting | None | Exception] = [None] * len(requests)
        pending = []
        for index, (state, token_ids, num_tokens, params, num_ranked, stop_below) in enumerate(requests):
            # The last drafted token needs no forward, hence the + 1: room for len + num_tokens - 1.
            num_tokens = min(num_tokens, self.model.info.max_context - len(token_ids) + 1)
            if num_tokens > 0 and token_ids:
                pending.append(_Drafting(index, state, token_ids, num_tokens, params, num_ranked=num_ranked,
                                         stop_below=stop_below))
        while pending:
            pending = self._draft_round(pending, results)
        return results

    def fork(self, state: _DraftSlot, length: int) -> _DraftSlot:
        """A branch state (multi-outcome pipelining) holding the session's cache of its first
        `length` tokens, copied into a free slot of its own. CacheFull when no slot is free: a
        branch is optional, so it never evicts another session's cache."""
        if self.model.num_free_slots == 0:
            raise CacheFull("no free KV slot for an alternative branch; every slot holds a session")
        branch = _DraftSlot(f"{state.session_id}\x00branch{next(self._branch_ids)}")
        branch.context_ids, branch.context_scanned = list(state.context_ids), list(state.context_scanned)
        # Shared with the parent: these are replaced when they change, never written in place.
        branch.context_tensor, branch.context_rows = state.context_tensor, state.context_rows
        branch.scored_ids = state.scored_ids
        # branch.copy_index stays None: built from the branch's own sequence when first drafted.
        self._open[branch.session_id] = branch
        branch.slot = self.model.allocate()
        if state.slot is not None:
            self.model.fork(state.slot, branch.slot, min(length, self.model.length(state.slot)))
        return branch

    def adopt(self, state: _DraftSlot, branch: _DraftSlot) -> None:
        """The session continues on a branch it forked: it takes the branch's slot and context."""
        if state.slot is not None and state.slot != branch.slot:
            self.model.free(state.slot)
        state.slot, branch.slot = branch.slot, None
        state.context_ids, state.context_scanned = branch.context_ids, branch.context_scanned
        state.context_tensor, state.context_rows = branch.context_tensor, branch.context_rows
        state.scored_ids = branch.scored_ids
        self.close(branch)

    def _draft_round(self, pending: list[_Drafting], results: list) -> list[_Drafting]:
        """Draft the proposals that get a KV slot; return those left for the next round."""
        busy = {d.state.session_id for d in pending}  # never evict a row of the same batch
        ready, full = [], []
        for d in pending:
            try:
                self._ensure_slot(d.state, busy)
                ready.append(d)
            except CacheFull as exc:
                full.append((d, exc))
        if not ready:
            for d, exc in full:
                results[d.index] = exc
            return []
        try:
            self._draft_steps(ready)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its rows, not the others
            for d in ready:
                results[d.index] = exc
        else:
            for d in ready:
                results[d.index] = d
        return [d for d, _ in full]  # the ready rows' slots are evictable again now

    def _draft_steps(self, rows: list[_Drafting]) -> None:
        for d in rows:
            cached = self.model.length(d.state.slot)
            if cached >= len(d.token_ids):  # logits after the last token need that token fed again
                cached = len(d.token_ids) - 1
                self.model.truncate(d.state.slot, cached)
            d.feed = list(d.token_ids[cached:])
            if self.copy is not None:
                if d.state.copy_index is None:
                    d.state.copy_index = CopyIndex(self.copy.ngram)
                d.state.copy_index.sync(d.token_ids)
        # A proposal's drafted tokens come from the scored columns, so its context stays as it starts.
        columns = None
        if self._head is not None:
            context_rows = [self._context_rows(d) for d in rows]
            columns = ContextColumns(self._head_ids, context_rows, [d.state.context_ids for d in rows])
        pass_row = {d.index: i for i, d in enumerate(rows)}
        for _ in range(max(d.num_tokens for d in rows)):
            active = [d for d in rows if len(d.drafted) < d.num_tokens]
            if not active:  # every row stopped early on its confidence
                break
            slots, feeds = [d.state.slot for d in active], [d.feed for d in active]
            greedy = [d.params.greedy and not d.num_ranked for d in active]
            if columns is None:  # a full head: columns are token ids
                logits = self._step_logits(slots, feeds)
                picks = greedy_columns(logits) if any(greedy) else [None] * len(active)
                for d, row_logits, is_greedy, pick in zip(active, logits, greedy, picks):
                    if is_greedy and pick is not None:
                        self._draft_one(d, row_logits, pick)
                    else:  # samplers warp in place: a copy made outside inference mode
                        self._draft_one(d, row_logits.clone())
                continue
            logits, hidden = self.model.forward_packed(slots, feeds, [1] * len(active))
            in_pass = [pass_row[d.index] for d in active]
            scores = columns.scores(logits, hidden, in_pass)  # [active, head + padded context]
            picks = columns.greedy(scores, in_pass) if any(greedy) else [None] * len(active)
            for d, row, row_scores, is_greedy, pick in zip(active, in_pass, scores, greedy, picks):
                self._draft_one(d, row_scores[:columns.widths[row]], pick if is_greedy else None)

    def _step_logits(self, slots: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """A full head's logits of a drafting step [rows, vocab], the last fed token's per row."""
        packed = getattr(self.model, "forward_packed", None)  # the native backend's; others give rows
        if packed is not None:
            return packed(slots, feeds, [1] * len(slots))[0]
        return torch.cat(self.model.forward(slots, feeds, [1] * len(slots)))

    def _draft_one(self, d: _Drafting, scores: torch.Tensor, greedy_pick: tuple[int, float] | None = None) -> None:
        """Draft row d's next token from its scores (the head's columns, then its context's).
        greedy_pick: the (token, confidence) a batch already found for a greedy row."""
        if greedy_pick is not None:
            (token, confidence), ids, probs = greedy_pick, None, None
        else:
            token = self._reduced_greedy(d, scores) if d.params.greedy and not d.num_ranked else None
            if token is not None:  # a point mass: nothing to send, so no distribution to build
                ids = probs = None
            else:
                full = self._full_vocab(scores, d.state.context_tensor)
                token, ids, probs = sample_draft_token(full, d.params, len(d.token_ids) + len(d.drafted), self.top_m)
                if d.num_ranked and not d.drafted:
                    d.ranked = torch.topk(full, min(d.num_ranked, full.numel())).indices.tolist()
            confidence = draft_confidence(scores, token, ids, probs, d.params.greedy)
        copied = self._copied(d, confidence if d.params.greedy else float(probs.max()))
        if copied is not None:
            token, ids, probs, confidence = copied, torch.tensor([copied]), torch.tensor([1.0]), self.copy.confidence
        d.add(token, ids, probs, confidence)

    def _reduced_greedy(self, d: _Drafting, scores: torch.Tensor) -> int | None:
        """The greedy token over a reduced head's columns: what torch.argmax over _full_vocab's
        vector picks (ties to the lowest token id), without building it. None: a full head, or
        scores that are not finite (left to the general path)."""
        if self._head is None:
            return None
        column = int(torch.argmax(scores))
        best = scores[column]
        if not math.isfinite(float(best)):
            return None
        scored = d.state.scored_ids if d.state.scored_ids is not None else self._head
        tied = scores == best
        if int(torch.count_nonzero(tied)) > 1:  # columns are not in id order
            return int(scored[tied.cpu()].min())  # the ids stay on the CPU, the scores on the model's device
        return int(scored[column])

    def _copied(self, d: _Drafting, top_probability: float) -> int | None:
        if self.copy is None:
            return None
        tail = [*d.token_ids[-self.copy.ngram:], *d.drafted][-self.copy.ngram:]
        return copied_token(self.copy, d.state.copy_index, tail, top_probability)

    def _full_vocab(self, logits: torch.Tensor, context_ids: torch.Tensor | None) -> torch.Tensor:
        """A reduced head scores only its own ids and the session's context ids; every other token
        gets probability 0. The draft then samples from, and sends, exactly that distribution, so
        verification stays lossless."""
        if self._head is None:
            return logits  # [vocab]
        ids = self._head if context_ids is None or not len(context_ids) else torch.cat((self._head, context_ids))
        full = torch.full((self.model.info.vocab_size,), float("-inf"), dtype=logits.dtype, device=logits.device)
        return full.index_copy_(0, ids.to(logits.device), logits)  # [vocab], on the model's device

    def _context_ids(self, d: _Drafting) -> torch.Tensor | None:
        """The session's tokens outside the reduced head, in order of first appearance. Collected
        incrementally; rebuilt when the sequence is not an extension of the one scanned (a rollback
        into the committed text, a new session state), so they depend only on the sequence itself."""
        state, tokens = d.state, d.token_ids
        scanned = len(state.context_scanned)
        if len(tokens) < scanned or list(tokens[:scanned]) != state.context_scanned:
            state.context_ids, state.context_scanned, state.context_tensor, scanned = [], [], None, 0
            state.context_rows = state.scored_ids = None
        if scanned < len(tokens):
            seen = set(state.context_ids)
            for token in tokens[scanned:]:
                token = int(token)
                if not self._in_head[token] and token not in seen:
                    seen.add(token)
                    state.context_ids.append(token)
            state.context_scanned.extend(int(t) for t in tokens[scanned:])
            state.context_tensor = None
        if state.context_tensor is None and state.context_ids:
            state.context_tensor = torch.tensor(state.context_ids, dtype=torch.long)
        return state.context_tensor

    def _context_rows(self, d: _Drafting) -> torch.Tensor | None:
        """The head rows of _context_ids(d), gathered only for ids the state has not gathered yet
        (the context grows by a few tokens a cycle; regathering hundreds of rows every step cost
        more than the head's product with them). Sets state.scored_ids to match."""
        state = d.state
        ids = self._context_ids(d)
        have = 0 if state.context_rows is None else len(state.context_rows)
        if ids is None:
            state.context_rows = state.scored_ids = None
        elif have < len(ids):  # new ids, or all of them after a first use or a reset (_context_ids)
            new_rows = self.model.head_rows(ids[have:])
            state.context_rows = new_rows if state.context_rows is None else torch.cat((state.context_rows, new_rows))
            state.scored_ids = torch.cat((self._head, ids))
        return state.context_rows

    def _ensure_slot(self, state: _DraftSlot, busy: Collection[str] = ()) -> int:
        self._open.move_to_end(state.session_id)
        now = self._clock()
        state.last_used, state.between_turns = now, False
        if state.slot is not None:
            return state.slot
        while True:
            try:
                state.slot = self.model.allocate()
                return state.slot
            except CacheFull:
                # Evict the least recently used other session that is idle: it re-feeds its tokens when next used.
                idle_before = now - self.evict_after_s
                victim = next((s for s in self._open.values()
                               if s.slot is not None and s is not state and s.session_id not in busy
                               and (self.evict_after_s == 0 or s.between_turns or s.last_used <= idle_before)),
                              None)
                if victim is None and self.evict_after_s == 0:
                    raise  # every slot is held by a row of this batch
                if victim is None:
                    raise CacheFull(
                        f"every draft KV slot ({self.model.num_slots}) is held by a session that drafted in the "
                        f"last {self.evict_after_s:g} s (the draft service's --evict-after); this session "
                        "decodes without the draft until one frees, or add draft replicas or --num-slots"
                    ) from None
                self.model.free(victim.slot)
                victim.slot = None
                self.evictions += 1

