"""The benchmark's lossless check in bf16 / fp16 (specdec/bench/ties.py): an output that parts from
plain decoding at batch 1 is re-scored by the target at its first divergence, and the report counts
a logit gap below the tie threshold as a numerical tie, anything else as unexplained."""

from __future__ import annotations

import pytest

from inprocess_target import hosted
from service_procs import tiny_model_dir
from specdec.bench import ties
from specdec.bench.methods import RequestResult
from specdec.bench.report import lossless
from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model
from specdec.sampling.params import SamplingParams
from target_service.servicer import TargetServicer

PROMPT = [1, 5, 9, 12, 5, 9, 33, 7]


def _result(method: str, tokens: list[int], phase: str = "concurrency", gap: float | None = None) -> RequestResult:
    return RequestResult(method, "q1", "qa", tokens, len(PROMPT), 0.1, 1.0, phase=phase, logit_gap=gap)


def test_the_report_counts_ties_apart_from_unexplained_differences():
    reference = [_result("plain", [4, 4, 4, 4], phase="batch1")]
    rows = [_result("spec", [4, 4, 4, 4]), _result("spec", [4, 4, 7, 7], gap=0.01),
            _result("spec", [4, 9, 9, 9], gap=0.5), _result("spec", [4, 4, 4, 8])]
    m = lossless(rows, reference)
    assert m["lossless_fraction"] == 0.25 and m["lossless_checked"] == 4
    assert m["numerical_ties"] == 1 and m["unexplained_differences"] == 2  # no gap: unexplained


async def test_the_target_scores_each_divergence_at_its_first_differing_token(tmp_path):
    target_dir = tiny_model_dir(tmp_path, "target", seed=0)
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=2, max_context=64))
    position, first = engine.start_session("ref", PROMPT, SamplingParams())
    plain = [first, *engine.decode("ref", position, 5)]
    model = load_model(target_dir, backend="native", num_slots=1, max_context=64)
    logits = model.forward([model.allocate()], [PROMPT + plain[:2]], [1])[0][-1].float()
    runner_up = int(logits.topk(2).indices[1])
    results = [_result("plain", plain, phase="batch1"), _result("spec", list(plain)),
               _result("spec", plain[:2] + [runner_up] + plain[3:]), _result("spec", plain[:4])]
    async with hosted(target_dir, TargetServicer, num_slots=2, max_context=64) as (_, servicer):
        scored = await ties.rescore(results, {"q1": PROMPT}, servicer.test_address)
    assert scored == 1
    assert [r.logit_gap for r in results[:2]] == [None, None] and results[3].logit_gap is None  # shorter only
    assert results[2].logit_gap == pytest.approx(float(logits[plain[2]] - logits[runner_up]), abs=1e-5)
