"""The benchmark's lossless check in bf16 / fp16 (specdec/bench/ties.py): an output that parts from
plain decoding at batch 1 is re-scored by the target at its first divergence, and the report counts
a logit gap within the tie threshold as a numerical tie, anything else as unexplained."""

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
    wide = _result("spec", [4, 9, 9, 7], gap=0.5)
    wide.tie_threshold = 1.0  # bf16 at |logit| 32-64: four units in the last place
    rows = [_result("spec", [4, 4, 4, 4]), _result("spec", [4, 4, 7, 7], gap=0.01), wide,
            _result("spec", [4, 9, 9, 9], gap=0.5), _result("spec", [4, 4, 4, 8])]
    m = lossless(rows, reference)
    assert m["lossless_fraction"] == 0.2 and m["lossless_checked"] == 5
    assert m["numerical_ties"] == 2 and m["unexplained_differences"] == 2  # no gap: unexplained
    at_bound = _result("spec", [4, 9, 9, 7], gap=1.0)  # exactly four units: bf16 logits come in units
    at_bound.tie_threshold = 1.0
    assert lossless([at_bound], reference)["numerical_ties"] == 1


def test_the_tie_threshold_is_a_few_units_of_the_dtypes_precision_at_least_the_floor():
    from specdec.generation.equality import DEFAULT_TIE_THRESHOLD, tie_threshold

    assert tie_threshold("bfloat16", 40.0, 39.5) == 4 * 0.25  # bf16 unit at 32-64: 2**-7 * 32
    assert tie_threshold("torch.float16", 40.0) == 4 * 2.0 ** -10 * 32
    assert tie_threshold("bfloat16", 0.1) == DEFAULT_TIE_THRESHOLD  # small logits: the floor
    assert tie_threshold("float32", 40.0) == DEFAULT_TIE_THRESHOLD and tie_threshold("q4", 40.0) == DEFAULT_TIE_THRESHOLD
    assert tie_threshold("bfloat16", 40.0, units=8) == 8 * 0.25  # --tie-units / --canary-tie-units
    assert tie_threshold("bfloat16", 40.0, units=0) == DEFAULT_TIE_THRESHOLD


def test_the_tie_units_are_settings_that_refuse_what_means_nothing():
    import argparse

    from coordinator.canary_settings import add_canary_arguments, canary_settings_from_args
    from specdec.commands.bench import add_parser
    from specdec.generation.equality import TIE_ULPS
    from specdec.server.settings import ConfigError

    canary = argparse.ArgumentParser()
    add_canary_arguments(canary, environ={})
    assert canary_settings_from_args(canary.parse_args(["--canary"])).tie_units == TIE_ULPS
    assert canary_settings_from_args(canary.parse_args(["--canary", "--canary-tie-units", "6"])).tie_units == 6
    with pytest.raises(ConfigError, match="--canary-tie-units must be >= 0"):
        canary_settings_from_args(canary.parse_args(["--canary", "--canary-tie-units", "-1"]))
    cli = argparse.ArgumentParser()
    add_parser(cli.add_subparsers())
    assert cli.parse_args(["bench", "--tie-units", "6"]).tie_units == 6
    assert cli.parse_args(["bench"]).tie_units is None  # the runner's default: equality.TIE_ULPS
    with pytest.raises(SystemExit):
        cli.parse_args(["bench", "--tie-units", "nan"])


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
        scored = await ties.rescore(results, {"q1": PROMPT}, servicer.test_address, "float32")
    assert scored == 1
    assert [r.logit_gap for r in results[:2]] == [None, None] and results[3].logit_gap is None  # shorter only
    # The service loads the model again, and "auto" picks each row count's linear kernel by timing it at
    # load (kernel_calibration.py): the two loads may multiply with different kernels, whose float32
    # sums differ in the last bits (2e-5 on this gap of 4 once). A wrong position or token differs by far more.
    assert results[2].logit_gap == pytest.approx(float(logits[plain[2]] - logits[runner_up]), abs=1e-4)
    assert results[2].tie_threshold > 0
    # A batch-invariant target (--batch-invariant): no tie allowance, any divergence is a failure
    results[2].logit_gap = results[2].tie_threshold = None
    async with hosted(target_dir, TargetServicer, num_slots=2, max_context=64) as (_, servicer):
        assert await ties.rescore(results, {"q1": PROMPT}, servicer.test_address, "bfloat16", exact=True) == 1
    assert results[2].tie_threshold == 0.0 and results[2].logit_gap > 0


@pytest.mark.slow  # a whole bf16 benchmark run: about a minute on 2 cores
def test_a_bf16_run_scores_every_output_that_parts_from_plain_decoding(tmp_path):
    """The whole path in a bf16 benchmark on the CPU (tiny random models, real services): after the
    phases the target scores each divergence, and every differing output is counted as a tie or
    as unexplained (at batch 1 and under load)."""
    import json
    import math
    import os
    import subprocess
    import sys

    from service_procs import REPO

    from specdec.testing.tiny_models import make_tiny_model

    # Wider than the default tiny model, with longer prompts: its bf16 outputs part from plain
    # decoding at a few near-ties (two on the machine this was written on; the checks below hold
    # for any number).
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_tiny_model(target, variant="llama", hidden_size=256, num_layers=4, seed=0)
    make_tiny_model(draft, variant="llama", hidden_size=64, num_layers=2, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n" for i, t in
                               enumerate(["Why is the sea salty? " * 12, "Name three rivers and their seas. " * 10,
                                          "Count to ten, then back to one, slowly. " * 8])))
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--target", str(target), "--draft", str(draft),
         "--dtype", "bfloat16", "--prompts", str(prompts), "--max-new-tokens", "48", "--threads", "1",
         "--methods", "plain,specdec-draft,specdec-draft-target", "--k-policy", "fixed", "--concurrency", "1,3",
         "--concurrency-prompts", "3", "--concurrency-rounds", "1", "--timing-repeats", "1", "--no-progress",
         "--tie-units", "6", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["meta"]["dtype"] == "bfloat16" and isinstance(report["meta"]["rescored_divergences"], int)
    assert report["meta"]["tie_units"] == 6
    plain = {r["question_id"]: r["token_ids"] for r in report["requests"]
             if r["phase"] == "batch1" and r["method"] == "plain"}
    for r in report["requests"]:
        n = min(len(r["token_ids"]), len(plain[r["question_id"]]))
        if r["token_ids"][:n] != plain[r["question_id"]][:n]:  # parted from plain decoding: scored
            assert r["logit_gap"] is not None and r["tie_threshold"] >= 0.05, r
            # --tie-units 6: the 0.05 floor, or six bf16 units (a power of two each) of the larger logit
            units = r["tie_threshold"] / 6
            assert r["tie_threshold"] == 0.05 or units == 2.0 ** round(math.log2(units)), r
    for table in [report["batch1"]["overall"], *report["concurrency"].values()]:
        for name, m in table.items():
            if isinstance(m, dict) and m.get("lossless_checked"):
                differing = round((1 - m["lossless_fraction"]) * m["lossless_checked"])
                assert m["numerical_ties"] + m["unexplained_differences"] == differing, name


def test_each_divergence_is_listed_with_its_position_gap_and_whether_it_drafted():
    from specdec.bench.output import _never_speculated

    reference = [_result("plain", [4, 4, 4, 4], phase="batch1")]
    plain_only = _result("spec", [4, 4, 9, 9], gap=6.0)
    plain_only.tie_threshold, plain_only.round = 4.0, 1
    drafted = _result("spec", [4, 7, 7, 7], gap=0.5)
    drafted.tie_threshold, drafted.stats = 4.0, {"cycles": 3}
    m = lossless([plain_only, drafted, _result("spec", [4, 4, 4, 4])], reference)
    assert m["unexplained_differences"] == 1 and m["numerical_ties"] == 1
    assert m["divergences"] == [
        {"prompt": "q1", "round": 1, "position": 2, "logit_gap": 6.0, "tie_threshold": 4.0, "tie": False,
         "speculated": False},
        {"prompt": "q1", "round": 0, "position": 1, "logit_gap": 0.5, "tie_threshold": 4.0, "tie": True,
         "speculated": True}]
    text = _never_speculated(m["divergences"])
    assert "1 of them never speculated" in text
    assert "widest gap beyond the rule 6 against 4 (prompt q1, position 2, never speculated)" in text
    assert _never_speculated(m["divergences"][1:]) == ""  # a tie of a drafting request: nothing to add
