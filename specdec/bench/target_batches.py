"""How full the target's batched steps were while a method served a concurrency level.

Under concurrency a method's throughput is its tokens over the target's busy time, and the busy time
is steps x what a step costs: the same tokens in steps of fewer rows take more steps. The target's
own metrics say it (specdec_target_batch_size: rows per step, by step kind; specdec_target_tokens:
tokens fed; specdec_target_step_seconds: the steps' durations), so the benchmark reads them before
and after each method's run and reports the difference: steps, rows per step, tokens per step, and
the mean step's milliseconds overall and by kind (decode, verify, mixed). A method that falls below
plain decoding while it decodes mostly plainly shows here whether its sessions kept out of step with
each other (more steps) or whether the same steps took longer (a step widened by a verify row pads
every row; a busier neighbour on the cores slows every step).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

PLAIN_STEPS = "specdec_target_stream_plain_steps"  # by why (specdec.engine.inner_length.PLAIN_REASONS)
EXPLORATIONS = "specdec_target_joint_explorations"
ROWS = "specdec_target_batch_size"
TOKENS = "specdec_target_tokens"
SECONDS = "specdec_target_step_seconds"
KINDS = ("decode", "verify", "mixed")


def snapshot(metrics_text: str) -> dict[str, float]:
    """The counters the report differences: batched steps, their rows and tokens, summed over step
    kinds (decode, verify, mixed), with each kind's steps and seconds apart too ("decode.steps", ...);
    prefills, one session each and the same for every method, apart."""
    totals = {"steps": 0.0, "rows": 0.0, "tokens": 0.0, "seconds": 0.0}
    totals.update({f"{kind}.{part}": 0.0 for kind in KINDS for part in ("steps", "seconds")})
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            kind = sample.labels.get("step")
            if kind == "prefill":
                continue
            if family.name == ROWS and sample.name == f"{ROWS}_count":
                totals["steps"] += sample.value
                if kind in KINDS:
                    totals[f"{kind}.steps"] += sample.value
            elif family.name == ROWS and sample.name == f"{ROWS}_sum":
                totals["rows"] += sample.value
            elif family.name == PLAIN_STEPS and sample.name == f"{PLAIN_STEPS}_total":
                why = f"plain_steps.{sample.labels.get('why')}"
                totals[why] = totals.get(why, 0.0) + sample.value
            elif family.name == EXPLORATIONS and sample.name == f"{EXPLORATIONS}_total":
                totals["joint_explorations"] = totals.get("joint_explorations", 0.0) + sample.value
            elif family.name == TOKENS and sample.name == f"{TOKENS}_total":
                totals["tokens"] += sample.value
            elif family.name == SECONDS and sample.name == f"{SECONDS}_sum":
                totals["seconds"] += sample.value
                if kind in KINDS:
                    totals[f"{kind}.seconds"] += sample.value
    return totals


def add_difference(into: dict, before: dict[str, float], after: dict[str, float]) -> None:
    """Accumulate after - before into `into` (rounds of one method and level add up)."""
    for key, value in after.items():
        into[key] = into.get(key, 0.0) + value - before.get(key, 0.0)


def summary(counts: dict) -> dict:
    """{steps, rows_per_step, tokens_per_step, step_ms, step_ms_by_kind} of accumulated counts (the
    milliseconds are absent from reports written before the step seconds were read)."""
    steps = counts.get("steps", 0.0)
    summary = {"steps": int(steps),
               "rows_per_step": counts["rows"] / steps if steps else None,
               "tokens_per_step": counts["tokens"] / steps if steps else None}
    if "seconds" in counts:
        summary["step_ms"] = 1e3 * counts["seconds"] / steps if steps else None
        summary["step_ms_by_kind"] = {
            kind: {"steps": int(counts[f"{kind}.steps"]),
                   "step_ms": 1e3 * counts[f"{kind}.seconds"] / counts[f"{kind}.steps"]}
            for kind in KINDS if counts.get(f"{kind}.steps")}
    # Streams drafting on the target: their steps that verified nothing, by why, and the trimmer's
    # joint explorations (round 41: what held a hosted batch plain was not recorded).
    plain = {key.split(".", 1)[1]: int(value) for key, value in counts.items()
             if key.startswith("plain_steps.") and value}
    if plain:
        summary["stream_plain_steps"] = plain
    if counts.get("joint_explorations"):
        summary["joint_explorations"] = int(counts["joint_explorations"])
    return summary
