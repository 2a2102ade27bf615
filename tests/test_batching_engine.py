"""Continuous batching on the engines: one batched step gives what the same work gives one session at
a time (tokens, outcomes, committed sequences), with mixed rows, bad items, repeats and eviction."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.batch import DecodeWork, VerifyWork, run_target_batch
from specdec.engine.draft import DraftEngine
from specdec.engine.draft_batch import ProposeWork, run_propose_batch
from specdec.engine.target import TargetEngine
from specdec.errors import CacheFull, ContextOverflow, EpochMismatch, InvalidArgument, PositionMismatch, SessionNotFound
from specdec.models.loader import load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.types import DraftBlock

import batching_helpers
from batching_helpers import CONTEXT, one_thread, tiny_dir  # noqa: F401 (module fixtures)

PARAMS = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=12),
    SamplingParams(temperature=1.0, seed=13, mode=SamplingMode.GUMBEL),
]


def target_engine(path, slots: int = 16) -> TargetEngine:
    return batching_helpers.target_engine(path, slots)


class Drafter:
    """Drafts from the target's own weights (high acceptance) with top_m = 8 (so sampled drafts
    are sometimes rejected), keeping its cache aligned with each session's committed sequence."""

    def __init__(self, path):
        self.proposer = DraftModelProposer(load_model(path, backend="native", num_slots=16,
                                                      max_context=CONTEXT), top_m=8)
        self.states: dict[str, tuple[object, list[int]]] = {}

    def draft(self, session_id: str, tokens: list[int], k: int, params: SamplingParams) -> DraftBlock:
        state, last = self.states.get(session_id) or (self.proposer.open(session_id), [])
        keep = next((i for i, (a, b) in enumerate(zip(last, tokens)) if a != b), min(len(last), len(tokens)))
        self.proposer.rollback(state, keep)
        block = self.proposer.propose(state, tokens, k, params)
        self.states[session_id] = (state, tokens + block.token_ids.tolist())
        return block


def run_sequentially(engine: TargetEngine, works) -> list:
    results = []
    for w in works:
        try:
            if isinstance(w, VerifyWork):
                results.append(engine.verify(w.session_id, w.position, w.draft))
            else:
                results.append(engine.decode(w.session_id, w.position, w.num_tokens, w.append_token_ids))
        except Exception as exc:  # noqa: BLE001
            results.append(exc)
    return results


def same(a, b) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


def open_sessions(engines, count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    ids = []
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 24))]  # different positions
        for engine in engines:
            engine.start_session(f"s{i}", prompt, PARAMS[i % len(PARAMS)])
        ids.append(f"s{i}")
    return ids


def mixed_round(engine: TargetEngine, drafter: Drafter, ids: list[str], round_: int) -> list:
    """Verify rows with k in 0..5 (some corrupted drafts) and decode rows, some appending tokens."""
    works = []
    for i, sid in enumerate(ids):
        tokens = engine.committed_tokens(sid)
        if (i + round_) % 3 == 0:
            append = (7, 8) if (i + round_) % 4 == 0 else ()
            works.append(DecodeWork(sid, len(tokens), append))
            continue
        k = (i + 2 * round_) % 6
        block = drafter.draft(sid, tokens, k, engine.sessions.get(sid).params)
        if k and block.draft_probs is None and (i + round_) % 4 == 1:
            wrong = block.token_ids.clone()  # a wrong last token: partial acceptance under greedy
            wrong[-1] = (wrong[-1] + 1) % 256
            block = DraftBlock(wrong)
        works.append(VerifyWork(sid, len(tokens), block))
    return works


def test_batched_step_equals_sequential_calls(tiny_dir):
    sequential, batched = target_engine(tiny_dir), target_engine(tiny_dir)
    drafter = Drafter(tiny_dir)
    ids = open_sessions([sequential, batched], 8)
    accepted = 0
    for round_ in range(6):
        works = mixed_round(sequential, drafter, ids, round_)
        want = run_sequentially(sequential, works)
        got = run_target_batch(batched, works)
        assert all(same(g, w) for g, w in zip(got, want)), (round_, got, want)
        accepted += sum(r.num_accepted for r in got if not isinstance(r, (list, Exception)))
    for sid in ids:
        assert batched.committed_tokens(sid) == sequential.committed_tokens(sid)
    assert accepted > 0
    assert len({len(batched.committed_tokens(s)) for s in ids}) > 1  # rows at different positions


def test_a_bad_item_fails_alone(tiny_dir):
    sequential, batched = target_engine(tiny_dir), target_engine(tiny_dir)
    ids = open_sessions([sequential, batched], 3)
    pos = {sid: len(batched.committed_tokens(sid)) for sid in ids}
    no_mass = DraftBlock(torch.tensor([5]), torch.tensor([[6]]), torch.tensor([[1.0]]))
    works = [
        DecodeWork("s0", pos["s0"]),
        VerifyWork("s1", pos["s1"] + 1, DraftBlock(torch.tensor([1]))),  # wrong position
        VerifyWork("missing", 4, DraftBlock(torch.tensor([1]))),
        VerifyWork("s2", pos["s2"], DraftBlock(torch.tensor([1, 999]))),  # id outside the vocabulary
        VerifyWork("s1", pos["s1"], no_mass),  # drafted token without draft probability
        DecodeWork("s2", pos["s2"], room=CONTEXT),  # the budget does not fit the context
        DecodeWork("s0", pos["s0"] + 1, num_tokens=2),
        VerifyWork("s1", pos["s1"], DraftBlock(torch.tensor([3, 4]))),
        DecodeWork("s2", pos["s2"], (9,)),
    ]
    got = run_target_batch(batched, works)
    kinds = [type(r) for r in got]
    assert kinds[1:7] == [PositionMismatch, SessionNotFound, InvalidArgument, InvalidArgument,
                          ContextOverflow, InvalidArgument]
    good = [works[i] for i in (0, 7, 8)]
    assert [got[i] for i in (0, 7, 8)] == run_sequentially(sequential, good)
    for sid in ids:
        assert batched.committed_tokens(sid) == sequential.committed_tokens(sid)


def test_the_same_session_twice_runs_in_order(tiny_dir):
    sequential, batched = target_engine(tiny_dir), target_engine(tiny_dir)
    ids = open_sessions([sequential, batched], 2)
    p0, p1 = (len(batched.committed_tokens(s)) for s in ids)
    works = [DecodeWork("s0", p0), DecodeWork("s1", p1), DecodeWork("s0", p0 + 1, (3,)),
             VerifyWork("s0", p0 + 3, DraftBlock(torch.tensor([1, 2]))), DecodeWork("s1", p1 + 1)]
    got = run_target_batch(batched, works)
    assert not any(isinstance(r, Exception) for r in got)
    assert got == run_sequentially(sequential, works)
    assert batched.committed_tokens("s0") == sequential.committed_tokens("s0")


def test_more_sessions_than_slots(tiny_dir):
    """Seven sessions on three slots: every batch needs more rows than slots; rows wait for the next
    round of the batch (never evicting a row of their own forward) and results stay sequential."""
    sequential, batched = target_engine(tiny_dir), target_engine(tiny_dir, slots=3)
    drafter = Drafter(tiny_dir)
    ids = open_sessions([sequential, batched], 7, seed=1)
    for round_ in range(4):
        works = mixed_round(sequential, drafter, ids, round_)
        want = run_sequentially(sequential, works)
        got = run_target_batch(batched, works)
        assert not any(isinstance(r, Exception) for r in got), got
        assert all(same(g, w) for g, w in zip(got, want))
    assert batched.evictions > 0


def test_cache_full_only_for_the_row_without_a_slot(tiny_dir):
    batched = target_engine(tiny_dir, slots=1)
    batched.start_session("a", [1, 2, 3], PARAMS[0])
    batched.start_session("b", [4, 5], PARAMS[0])  # evicts a
    batched.sessions.get("b").in_use += 1  # a call on b is running elsewhere
    got = run_target_batch(batched, [DecodeWork("a", 4), DecodeWork("b", 3, (6,), num_tokens=0)])
    assert isinstance(got[0], CacheFull) and got[1] == []


# ---- draft side ----------------------------------------------------------------------------------


def draft_engine(path, slots: int = 16) -> DraftEngine:
    model = load_model(path, backend="native", num_slots=slots, max_context=CONTEXT)
    return DraftEngine(DraftModelProposer(model, top_m=8), max_draft_tokens=8)


def propose_round(engine: DraftEngine, ids: list[str], round_: int) -> list[ProposeWork]:
    """Accept a prefix of the last proposal, append one "target" token, draft k in 0..5."""
    works = []
    for i, sid in enumerate(ids):
        state = engine.sessions.get(sid)
        keep = state.committed + (i + round_) % (state.position - state.committed + 1)
        k = (i + round_) % 6
        works.append(ProposeWork(sid, keep, ((i * 7 + round_) % 256,), k, state.epoch))
    return works


def propose_sequentially(engine: DraftEngine, works) -> list:
    results = []
    for w in works:
        try:
            results.append(engine.propose(w.session_id, w.keep_position, w.append_token_ids,
                                          w.num_draft_tokens, w.parent_epoch))
        except Exception as exc:  # noqa: BLE001
            results.append(exc)
    return results


def same_proposal(a, b) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return same(a, b)
    x, y = a.block, b.block
    # A row's logits in a batched forward differ from its own forward's in the last bits (other
    # matmul shapes): the tokens are the same, the distributions equal to rounding.
    probs_equal = (x.draft_probs is None and y.draft_probs is None) or (
        torch.equal(x.draft_prob_ids, y.draft_prob_ids) and torch.allclose(x.draft_probs, y.draft_probs, atol=1e-5))
    return (a.epoch, a.position, a.block.token_ids.tolist()) == (b.epoch, b.position, b.block.token_ids.tolist()) \
        and probs_equal


@pytest.mark.parametrize("slots", [16, 3])
def test_batched_propose_equals_sequential(tiny_dir, slots):
    sequential, batched = draft_engine(tiny_dir), draft_engine(tiny_dir, slots)
    ids = open_sessions([sequential, batched], 7, seed=2)
    for round_ in range(5):
        works = propose_round(sequential, ids, round_)
        want = propose_sequentially(sequential, works)
        got = run_propose_batch(batched, works)
        assert not any(isinstance(r, Exception) for r in got), got
        assert all(same_proposal(g, w) for g, w in zip(got, want)), round_
    for sid in ids:
        assert batched.sessions.get(sid).tokens == sequential.sessions.get(sid).tokens


def test_batched_propose_bad_items_and_repeats(tiny_dir):
    sequential, batched = draft_engine(tiny_dir), draft_engine(tiny_dir)
    ids = open_sessions([sequential, batched], 2, seed=3)
    n0, n1 = (batched.sessions.get(s).position for s in ids)
    works = [ProposeWork("s0", n0, (1,), 3), ProposeWork("s1", n1, (2,), 2, parent_epoch=5),
             ProposeWork("s1", n1 + 1, (), 9), ProposeWork("nope", 1, (), 2),
             ProposeWork("s1", n1, (2,), 4), ProposeWork("s0", n0 + 2, (5,), 2, parent_epoch=1)]
    got = run_propose_batch(batched, works)
    assert [type(r).__name__ for r in got[1:4]] == ["EpochMismatch", "InvalidArgument", "SessionNotFound"]
    assert isinstance(got[1], EpochMismatch)
    want = propose_sequentially(sequential, works)
    assert all(same_proposal(g, w) for g, w in zip(got, want))


def test_ngram_proposer_through_the_batch():
    engines = [DraftEngine(NgramProposer()) for _ in range(2)]
    for engine in engines:
        engine.start_session("a", [1, 2, 3, 1, 2, 3, 1, 2], PARAMS[0])
        engine.start_session("b", [5, 6, 5, 6, 5], PARAMS[1])
    works = [ProposeWork("a", 8, (3,), 4), ProposeWork("b", 5, (6,), 3), ProposeWork("a", 14, (), 2)]
    got = run_propose_batch(engines[1], works)
    assert isinstance(got[2], PositionMismatch)  # keeps tokens never drafted (14 > its length 12)
    assert all(same_proposal(g, w) for g, w in zip(got, propose_sequentially(engines[0], works)))
    assert got[0].block.token_ids.tolist() == [1, 2, 3]  # what followed the latest "1 2 3"
