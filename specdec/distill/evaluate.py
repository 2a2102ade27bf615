"""How well a draft agrees with the target, measured on the target's own greedy answers.

Two numbers per category, both from one teacher-forced pass of the draft over prompt + target answer:
- agreement: the share of answer positions where the draft's argmax equals the target's greedy token;
- speculative acceptance (greedy, k drafted tokens per step): accepted / drafted. Under greedy
  verification, drafted token j counts only if tokens 1..j-1 were accepted, i.e. equal to the target's;
  so the draft's context is then exactly the teacher-forced one and the accepted count of a step starting
  at position i is the run of matches from i (at most k). The target then adds one token (the recovered or
  bonus token), and the next step starts after it. This is exact for greedy decoding, not an estimate.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch

from specdec.distill.data import Record
from specdec.proposers.copy_guess import CopyIndex, CopyRule


@torch.no_grad()
def match_vectors(
    draft: torch.nn.Module, records: list[Record], device: str, batch_tokens: int = 32768,
    head_ids: torch.Tensor | None = None,  # [N] token ids the draft may propose (reduced head); None: all
    context: bool = False,  # with head_ids: also every token already in the sequence (the proposer's rule)
    copy: CopyRule | None = None,  # DraftModelProposer's copy rule (specdec.proposers.copy_guess)
) -> list[np.ndarray]:
    """Per record, a bool array over answer tokens: draft argmax == the target's token."""
    draft.eval()
    order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))
    out: list[np.ndarray] = [np.zeros(0, dtype=bool)] * len(records)
    head = draft.get_output_embeddings().weight
    sub = head if head_ids is None else head[head_ids.to(head.device)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda") else _null()
    pos = 0
    while pos < len(order):
        longest = len(records[order[pos]].tokens)
        idx = [order[pos]]
        while pos + len(idx) < len(order):
            nxt = order[pos + len(idx)]
            if len(records[nxt].tokens) * (len(idx) + 1) > batch_tokens:
                break
            idx.append(nxt)
            longest = len(records[nxt].tokens)
        pos += len(idx)
        ids = torch.zeros(len(idx), longest, dtype=torch.long)
        mask = torch.zeros(len(idx), longest, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(records[i].tokens)] = torch.from_numpy(records[i].tokens)
            mask[row, :len(records[i].tokens)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with autocast:
            hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, i in enumerate(idx):
            r = records[i]
            h = hidden[row, r.prompt_len - 1:len(r.tokens) - 1].float()  # predicts the answer tokens
            scores = h @ sub.float().T
            pred = scores.argmax(-1)
            # The best score and the log-sum-exp of every column the draft scores: its confidence.
            best, total = scores.max(-1).values, torch.logsumexp(scores, -1)
            if head_ids is not None:
                pred = head_ids.to(pred.device)[pred]
                if context:
                    pred, best, total = _with_context(pred, best, total, h, head, head_ids, r)
            if copy is not None:
                pred = _with_copy(pred.cpu(), torch.exp(best - total).cpu(), copy, r)
            out[i] = (pred.cpu().numpy() == r.tokens[r.prompt_len:])
    return out


def _with_copy(pred: torch.Tensor, top: torch.Tensor, copy: CopyRule, r: Record) -> torch.Tensor:
    """The copy rule over teacher-forced predictions: at each answer position whose most likely
    token has probability `top` below the rule's threshold, the token that followed the latest
    earlier occurrence of the preceding n-gram, if any (greedy: the context is the target's text)."""
    guesses = torch.from_numpy(copy_guesses(r, copy))
    return torch.where((top < copy.below) & (guesses >= 0), guesses, pred)


def copy_guesses(r: Record, copy: CopyRule) -> np.ndarray:
    """[n]: the copy rule's token for each answer position (the reference text before it as the
    sequence), -1 where the preceding n-gram never occurred before."""
    index = CopyIndex(copy.ngram)
    index.sync(r.tokens[:r.prompt_len].tolist())
    guesses = np.full(len(r.tokens) - r.prompt_len, -1, dtype=np.int64)
    for a, token in enumerate(r.tokens[r.prompt_len:].tolist()):
        guess = index.guess(index.tokens[-copy.ngram:])
        guesses[a] = -1 if guess is None else guess
        index.append(token)
    return guesses


def _with_context(
    pred: torch.Tensor, best: torch.Tensor, total: torch.Tensor, h: torch.Tensor, head: torch.Tensor,
    head_ids: torch.Tensor, r: Record,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The argmax over the reduced head plus the tokens already in the sequence before each answer
    position (specdec.proposers.draft_model's context rows): a token first seen at index f is
    available to the predictions of positions after f. Returns the predictions, and `best` and
    `total` (the head's best score and log-sum-exp) with those context columns added."""
    tokens = torch.from_numpy(r.tokens.astype(np.int64))
    outside = ~torch.isin(tokens, head_ids.cpu())
    first: dict[int, int] = {}  # token -> sequence index where it first appears
    for index, token in zip(torch.nonzero(outside).flatten().tolist(), tokens[outside].tolist()):
        first.setdefault(token, index)
    if not first:
        return pred, best, total
    ids = torch.tensor(list(first), device=h.device)
    first_seen = torch.tensor(list(first.values()), device=h.device)  # [U]
    scores = h @ head[ids].float().T  # [n, U]
    predicted_at = torch.arange(r.prompt_len, len(r.tokens), device=h.device)  # sequence index of each answer token
    scores = scores.masked_fill(first_seen[None, :] >= predicted_at[:, None], float("-inf"))
    extra_best, extra_arg = scores.max(-1)
    return (torch.where(extra_best > best, ids[extra_arg], pred), torch.maximum(best, extra_best),
            torch.logaddexp(total, torch.logsumexp(scores, -1)))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def speculative_counts(matches: np.ndarray, k: int) -> tuple[int, int, int]:
    """(accepted, drafted, steps) of greedy speculative decoding with k draft tokens per step."""
    i, accepted, drafted, steps = 0, 0, 0, 0
    n = len(matches)
    while i < n:
        run = 0
        while run < k and i + run < n and matches[i + run]:
            run += 1
        accepted += run
        drafted += min(k, n - i)
        steps += 1
        i += run + 1
    return accepted, drafted, steps


def agreement_interval(matches: list[np.ndarray], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of the pooled agreement of these answers, by resampling whole answers (a percentile
    bootstrap). Tokens of one answer are not independent (a loop the draft predicts repeats for a hundred
    tokens), so the answers, not the tokens, are the unit: a Spec-Bench dev category of 5 prompts is
    known to +-0.03 to +-0.11, not to the +-0.03 its 1,000 tokens would suggest."""
    hits = np.array([m.sum() for m in matches], dtype=np.float64)
    tokens = np.array([len(m) for m in matches], dtype=np.float64)
    if len(matches) < 2 or tokens.sum() == 0:
        value = float(hits.sum() / max(tokens.sum(), 1))
        return [round(value, 4), round(value, 4)]
    picks = np.random.default_rng(seed).integers(0, len(matches), size=(resamples, len(matches)))
    shares = hits[picks].sum(axis=1) / np.maximum(tokens[picks].sum(axis=1), 1)
    return [round(float(q), 4) for q in np.percentile(shares, [2.5, 97.5])]


def summarize(records: list[Record], matches: list[np.ndarray], k: int = 4) -> dict:
    """Per category and overall: agreement (with its interval over answers), accepted/drafted at k,
    tokens per target step."""
    by_cat: dict[str, list[np.ndarray]] = defaultdict(list)
    for r, m in zip(records, matches):
        by_cat[r.category].append(m)
    result = {}
    for cat, ms in sorted(by_cat.items()):
        counts = np.array([speculative_counts(m, k) for m in ms]).sum(axis=0)
        tokens = sum(len(m) for m in ms)
        result[cat] = {
            "agreement": round(float(sum(m.sum() for m in ms) / max(tokens, 1)), 4),
            "agreement_ci95": agreement_interval(ms),
            f"acceptance_k{k}": round(float(counts[0] / max(counts[1], 1)), 4),
            f"tokens_per_step_k{k}": round(float((counts[0] + counts[2]) / max(counts[2], 1)), 3),
            "answers": len(ms),
            "tokens": int(tokens),
        }
    cats = [c for c in result]
    all_m = np.concatenate(matches) if matches else np.zeros(0, dtype=bool)
    result["overall_macro"] = {
        key: round(float(np.mean([result[c][key] for c in cats])), 4)
        for key in ("agreement", f"acceptance_k{k}", f"tokens_per_step_k{k}")
    } if cats else {}
    counts = np.array([speculative_counts(m, k) for m in matches]).sum(axis=0) if matches else np.zeros(3)
    result["overall_tokens"] = {
        "agreement": round(float(all_m.mean()) if all_m.size else 0.0, 4),
        "agreement_ci95": agreement_interval(matches),
        f"acceptance_k{k}": round(float(counts[0] / max(counts[1], 1)), 4),
        "tokens": int(all_m.size),
    }
    return result


def by_position(records: list[Record], matches: list[np.ndarray], edges: list[int]) -> dict:
    """Per category, agreement by the answer token's absolute position in its sequence, in buckets split
    at `edges` (e.g. 1024, 1280): a draft trained on records of at most N tokens has never attended
    across more than N positions, which shows here as a drop past N (long documents: summarization)."""
    bounds = [0, *sorted(edges), None]
    counts: dict[str, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r, m in zip(records, matches):
        position = r.prompt_len + np.arange(len(m))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            inside = (position >= lo) & (position < (np.inf if hi is None else hi))
            if inside.any():
                hits_tokens = counts[r.category][(lo, hi)]
                hits_tokens[0] += int(m[inside].sum())
                hits_tokens[1] += int(inside.sum())
    return {cat: {f"[{lo},{'' if hi is None else hi})": {"agreement": round(hits / tokens, 4), "tokens": tokens}
                  for (lo, hi), (hits, tokens) in sorted(buckets.items(), key=lambda item: item[0][0])}
            for cat, buckets in sorted(counts.items())}


def head_vocab(records: list[Record], size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens in `records` and the share of answer tokens they cover."""
    counts = np.bincount(np.concatenate([r.tokens[r.prompt_len:] for r in records]))
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(top)), float(counts[top].sum() / counts.sum())


def decode_step_ms(
    paths: dict[str, str], backend: str = "native", context: int = 300, repeats: int = 40, seed: int = 0,
    heads: dict[str, tuple[int, int]] | None = None, fused: frozenset[str] = frozenset(),
) -> dict[str, dict[str, float]]:
    """Median and minimum ms of one decode step (batch 1, `context` tokens cached) for each model.

    Uses the project's backends (specdec.models.loader). Models are timed interleaved, repetition by
    repetition, so a neighbour's load on a shared machine hits all of them alike; each timed step is undone
    with truncate so every repetition runs at the same position. heads[name] = (rows, context_rows): load
    that model with a reduced head of `rows` rows, scoring `context_rows` further ids beside it each step
    (the session's context tokens outside the head, as the draft proposer does). The models named in
    `fused` load as drafts are served on a CPU, with their decode step as one compiled loop
    (specdec.models.cpu_decode).
    """
    from specdec.models.loader import load_model

    heads = heads or {}
    models = {n: load_model(p, backend, dtype="float32", num_slots=1, max_context=context + 8,
                            head_vocab=heads.get(n, (None, 0))[0], fused_decode=n in fused) for n, p in paths.items()}
    prompt = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    extra = {}
    for name, model in models.items():
        head, rows = getattr(model, "head_token_ids", None), heads.get(name, (None, 0))[1]
        if head is not None and rows:
            outside = torch.ones(model.info.vocab_size, dtype=torch.bool)
            outside[head] = False
            extra[name] = {"extra_head_ids": [torch.nonzero(outside).flatten()[-rows:]]}  # rare ids: realistic
    slots = {}
    for name, model in models.items():
        slots[name] = model.allocate()
        model.forward([slots[name]], [prompt], [1])
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(repeats + 3):
        for name, model in models.items():
            start = time.perf_counter()
            model.forward([slots[name]], [[prompt[-1]]], [1], **extra.get(name, {}))
            times[name].append((time.perf_counter() - start) * 1000)
            model.truncate(slots[name], context)
    return {n: {"median_ms": round(float(np.median(t[3:])), 3), "min_ms": round(min(t[3:]), 3)}
            for n, t in times.items()}
