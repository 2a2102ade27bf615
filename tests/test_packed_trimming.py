"""Draft trimming for a backend that packs ragged rows (specdec.engine.step_plan): a step costs the
tokens it feeds, so each drafted token is priced on its own; the plan is the best by brute force;
plain rows are told what their probe would keep; the native backend says which way it runs a batch
(lossless trimmed verification, packed or padded: test_batching_goodput.py)."""

from __future__ import annotations

import itertools

import pytest

from specdec.engine.batch import DecodeWork
from specdec.engine.goodput import DraftTrimmer
from specdec.engine.step_plan import RowSpec, packed_plan
from specdec.models.llama import LlamaModel
from specdec.models.loader import load_model
from specdec.types import VerifyOutcome
from tests.test_batching_goodput import ALPHA, BETA, teach, trimmer_with_cost, verify


def packed_goodput(rows: list[RowSpec], kept, alpha=ALPHA, beta=BETA, draft_step_s=0.0) -> float:
    gain = sum(sum(r.acceptance ** j for j in range(d + 1)) for r, d in zip(rows, kept))
    tokens = sum(r.base + d for r, d in zip(rows, kept))
    return gain / (alpha + beta * tokens + max(kept, default=0) * draft_step_s)


@pytest.mark.parametrize("draft_step_s", [0.0, 0.004, 0.03])
@pytest.mark.parametrize("acceptances", [(0.9, 0.6, 0.2), (0.95, 0.95, 0.95), (0.5, 0.45, 0.1), (0.99, 0.3, 0.8)])
def test_the_packed_plan_is_the_best_by_brute_force(acceptances, draft_step_s):
    rows = [RowSpec(1, 4, a) for a in acceptances] + [RowSpec(1, 0, 0.5), RowSpec(2, 0, 0.5)]
    plan = packed_plan(rows, ALPHA, BETA, margin=0.0, draft_step_s=draft_step_s)
    options = itertools.product(*(range(r.draft + 1) for r in rows))
    best = max(packed_goodput(rows, ks, draft_step_s=draft_step_s) for ks in options)
    assert packed_goodput(rows, plan.kept, draft_step_s=draft_step_s) == pytest.approx(best)
    assert plan.goodput == pytest.approx(best)


def test_a_packed_step_prices_each_row_by_its_own_tokens():
    """Among 15 plain rows one well-accepted draft pays for its own tokens (packed) but not for
    widening all 16 rows (padded); a poorly accepted one pays in neither."""
    for packed, lone_kept in ((True, 4), (False, 0)):
        trimmer = trimmer_with_cost(packed=packed)
        teach(trimmer, "good", 4, 4)
        teach(trimmer, "poor", 0, 4)
        plain = [DecodeWork(f"p{i}", 10) for i in range(15)]
        assert trimmer.trim([verify("good", 4), *plain])[0].draft.num_tokens == lone_kept
        assert trimmer.trim([verify("poor", 4), *plain])[0].draft.num_tokens == 0


def test_a_packed_step_fits_its_cost_to_the_tokens_it_fed():
    trimmer = DraftTrimmer(packed=True)
    padded = DraftTrimmer()
    for n in range(1, 13):
        works = [verify("v", 4)] + [DecodeWork(f"p{i}", 10) for i in range(n)]
        results = [VerifyOutcome(0, 4, 4, 0)] + [[0]] * n
        for t in (trimmer, padded):
            t.observe(works, results, ALPHA + BETA * (n + 5))  # the tokens fed: n + 5
    alpha, beta = trimmer.cost.fit()
    assert alpha == pytest.approx(ALPHA) and beta == pytest.approx(BETA)
    assert padded.cost.fit()[1] < BETA / 3  # against rows x 5 the slope comes out wrong


def test_each_packed_plain_row_is_told_what_its_probe_would_keep():
    """draft_limits match what trim keeps when that row is a verify of 8 instead, the others as
    they were, or, where that is more, when every plain row is one (up to the row's own small effect
    on the step's goodput)."""
    for beta, margin in ((BETA, 0.0), (BETA, 0.2), (0.002, 0.0), (0.05, 0.0)):
        trimmer = trimmer_with_cost(beta=beta, margin=margin, packed=True)
        for session_id, accepted in (("good", 4), ("fair", 2), ("poor", 0)):
            teach(trimmer, session_id, accepted, 4)
        others = [DecodeWork(f"p{i}", 10) for i in range(8)]
        for session_id in ("good", "fair", "poor", "new"):
            trimmer.trim([DecodeWork(session_id, 10), *others])
            told = trimmer.draft_limits[session_id]
            alone = trimmer.trim([verify(session_id, 8), *others])[0].draft.num_tokens
            together = trimmer.trim([verify(session_id, 8), *(verify(w.session_id, 8) for w in others)])
            kept = max(alone, together[0].draft.num_tokens)
            assert abs(told - kept) <= 1, (beta, margin, session_id, told, kept)
    drafting = packed_plan([RowSpec(1, 2, 0.9), RowSpec(1, 0, 0.5)], 0.0995, 0.0005, margin=0.0)
    assert drafting.kept == [2, 0] and drafting.goodput == pytest.approx(3.71 / 0.1015)
    assert drafting.limit(0.9, 8, 0.0, margin=0.0) == 8  # tokens cost nothing: the whole probe
    assert drafting.limit(0.01, 8, 0.0005, margin=0.0) == 0  # a token costs 0.018 of one
    assert drafting.limit(0.5, 8, 0.0005, margin=0.0) == 5  # 0.5^5 = 0.031 > 0.018 > 0.5^6 = 0.016
    # A target hosting the draft pays a draft pass per token past the plan's longest draft (2 here).
    assert drafting.limit(0.5, 8, 0.0005, margin=0.0, draft_step_s=0.004) == 2
    assert drafting.limit(0.9, 8, 0.0005, margin=0.0, draft_step_s=0.004) > 2  # worth its passes


def test_the_native_backend_says_how_it_runs_ragged_rows(tiny_dir):
    eager = load_model(tiny_dir, backend="native", num_slots=2, max_context=64)
    graphs = LlamaModel(tiny_dir, num_slots=2, max_context=64, cuda_graphs=True)  # uncaptured on a CPU
    hf = load_model(tiny_dir, backend="hf", num_slots=2, max_context=64)
    assert eager.packs_ragged_rows and not graphs.packs_ragged_rows and hf.packs_ragged_rows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from specdec.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("packed") / "target", vocab_size=256, seed=0)
