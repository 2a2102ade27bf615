"""The replay proposer's pure pieces (specdec/proposers/replay.py): each prompt's alpha, and how a
session finds the reference it follows. Its losslessness and its runs in the benchmark are in
test_bench.py."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import InvalidArgument
from specdec.proposers.replay import ReplayProposer, reference_alphas


def test_a_spread_gives_each_prompt_its_own_alpha_around_the_named_one():
    alphas = reference_alphas(5, 0.7, 0.2, seed=0)
    assert sorted(alphas) == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9]) and np.mean(alphas) == pytest.approx(0.7)
    assert alphas == reference_alphas(5, 0.7, 0.2, seed=0)  # runs repeat
    assert {tuple(reference_alphas(5, 0.7, 0.2, seed=s)) for s in range(6)} != {tuple(alphas)}  # seeded order
    assert reference_alphas(4, 0.9, 0.3, seed=1).count(1.0) == 2  # clipped to [0, 1]: 0.6, 0.8, 1.0, 1.0
    assert reference_alphas(3, 0.6, 0.0, seed=0) == [0.6] * 3 and reference_alphas(1, 0.6, 0.4, seed=0) == [0.6]
    with pytest.raises(InvalidArgument, match="spread must be in"):
        ReplayProposer(None, [], 0.6, spread=-0.1)


def test_the_replay_remembers_a_session_that_left_every_reference(monkeypatch):
    """Off every reference, a session's longer sequences are not searched for again; rolled back to
    a reference's prefix, it follows that reference again."""
    proposer = ReplayProposer(None, [[1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]], 0.5)
    searched = []
    real = ReplayProposer._extends
    monkeypatch.setattr(ReplayProposer, "_extends", staticmethod(lambda ref, ids: searched.append(1) or real(ref, ids)))
    assert proposer._reference("s", [1, 2, 3]) == 0
    assert proposer._reference("s", [1, 2, 7]) is None
    searched.clear()
    assert proposer._reference("s", [1, 2, 7, 8]) is None and not searched  # extends a miss: no search
    assert proposer._reference("s", [1, 2, 9]) == 1 and searched  # rolled back, then another way: found
    assert proposer._reference("s", [1, 2, 9, 9]) == 1
