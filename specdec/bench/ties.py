"""The lossless check in bf16 / fp16 (ARCHITECTURE.md, "What identical means").

A multi-token verify and a one-token decode sum in different orders, so in bf16 a near-tie between the
target's top two tokens can flip, and an output may part from plain decoding's without any bug. Where
an output of a run in a reduced precision differs from plain decoding's at batch 1, the target scores
both tokens at the first divergence (TargetService.ScoreTokens, after the shared prefix) and the gap
is kept on the request (RequestResult.logit_gap) with the tie threshold for the target's dtype
(equality.tie_threshold: a few units in the last place of the logits, at least 0.05):
report.lossless counts a gap within it as a numerical tie, anything else as unexplained. fp32 needs none of this: there equality is exact.
"""

from __future__ import annotations

from specdec.bench.methods import RequestResult
from specdec.generation.equality import TIE_ULPS, compare_outputs, tie_threshold
from specdec.server.settings import ClientSettings


async def rescore(results: list[RequestResult], prompt_ids: dict[str, list[int]], target_address: str,
                  dtype: str, units: float = TIE_ULPS, exact: bool = False) -> int:
    """Set logit_gap and tie_threshold (equality.tie_threshold for the target's dtype, `units` units
    in the last place) on every result that differs from plain decoding's at batch 1; how many
    divergences were scored. exact (a batch-invariant target, --batch-invariant): no tie allowance,
    threshold 0, since every row computes what a one-token decode computes and no near-tie can flip."""
    from target_service.client import connect

    reference: dict[str, list[int]] = {}
    for r in results:
        if r.phase == "batch1" and r.method == "plain":
            reference.setdefault(r.question_id, r.token_ids)
    gaps: dict[tuple, float] = {}  # the same divergence in several requests is scored once
    async with connect(target_address, ClientSettings(plaintext=True, timeout_s=120.0)) as target:
        for r in results:
            plain = reference.get(r.question_id)
            if plain is None or r.question_id not in prompt_ids or r.token_ids is plain:
                continue
            i = compare_outputs([], r.token_ids, plain).divergence
            if i is None or i >= min(len(r.token_ids), len(plain)):  # equal, or only shorter
                continue
            key = (r.question_id, i, r.token_ids[i])
            if key not in gaps:
                (candidate, reference_logit), _ = await target.score_tokens(
                    prompt_ids[r.question_id] + plain[:i], [r.token_ids[i], plain[i]])
                threshold = 0.0 if exact else tie_threshold(dtype, candidate, reference_logit, units=units)
                gaps[key] = abs(candidate - reference_logit), threshold
            r.logit_gap, r.tie_threshold = gaps[key]
    return len(gaps)
