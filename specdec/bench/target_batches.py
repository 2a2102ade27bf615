"""How full the target's batched steps were while a method served a concurrency level.

Under concurrency a method's throughput is its tokens over the target's busy time, and the busy time
is steps x what a step costs: the same tokens in steps of fewer rows take more steps. The target's
own metrics say it (specdec_target_batch_size: rows per step, by step kind; specdec_target_tokens:
tokens fed), so the benchmark reads them before and after each method's run and reports the
difference: steps, rows per step, tokens per step. A method that falls below plain decoding while it
decodes mostly plainly shows here whether its sessions kept out of step with each other.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

ROWS = "specdec_target_batch_size"
TOKENS = "specdec_target_tokens"


def snapshot(metrics_text: str) -> dict[str, float]:
    """The counters the report differences: batched steps, their rows and tokens, summed over step
    kinds (decode, verify, mixed); prefills, one session each and the same for every method, apart."""
    totals = {"steps": 0.0, "rows": 0.0, "tokens": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.labels.get("step") == "prefill":
                continue
            if family.name == ROWS and sample.name == f"{ROWS}_count":
                totals["steps"] += sample.value
            elif family.name == ROWS and sample.name == f"{ROWS}_sum":
                totals["rows"] += sample.value
            elif family.name == TOKENS and sample.name == f"{TOKENS}_total":
                totals["tokens"] += sample.value
    return totals


def add_difference(into: dict, before: dict[str, float], after: dict[str, float]) -> None:
    """Accumulate after - before into `into` (rounds of one method and level add up)."""
    for key in ("steps", "rows", "tokens"):
        into[key] = into.get(key, 0.0) + after[key] - before[key]


def summary(counts: dict) -> dict:
    """{steps, rows_per_step, tokens_per_step} of accumulated counts."""
    steps = counts.get("steps", 0.0)
    return {"steps": int(steps),
            "rows_per_step": counts["rows"] / steps if steps else None,
            "tokens_per_step": counts["tokens"] / steps if steps else None}
