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


@torch.no_grad()
def match_vectors(
    draft: torch.nn.Module, records: list[Record], device: str, batch_tokens: int = 32768,
    head_ids: torch.Tensor | None = None,  # [N] token ids the draft may propose (reduced head); None: all
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
            pred = (h @ sub.float().T).argmax(-1)
            if head_ids is not None:
                pred = head_ids.to(pred.device)[pred]
            out[i] = (pred.cpu().numpy() == r.tokens[r.prompt_len:])
    return out


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


def summarize(records: list[Record], matches: list[np.ndarray], k: int = 4) -> dict:
    """Per category and overall: agreement, accepted/drafted at k, tokens per target step."""
    by_cat: dict[str, list[np.ndarray]] = defaultdict(list)
    for r, m in zip(records, matches):
        by_cat[r.category].append(m)
    result = {}
    for cat, ms in sorted(by_cat.items()):
        counts = np.array([speculative_counts(m, k) for m in ms]).sum(axis=0)
        tokens = sum(len(m) for m in ms)
        result[cat] = {
            "agreement": round(float(sum(m.sum() for m in ms) / max(tokens, 1)), 4),
            f"acceptance_k{k}": round(float(counts[0] / max(counts[1], 1)), 4),
            f"tokens_per_step_k{k}": round(float((counts[0] + counts[2]) / max(counts[2], 1)), 3),
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
        f"acceptance_k{k}": round(float(counts[0] / max(counts[1], 1)), 4),
        "tokens": int(all_m.size),
    }
    return result


def head_vocab(records: list[Record], size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens in `records` and the share of answer tokens they cover."""
    counts = np.bincount(np.concatenate([r.tokens[r.prompt_len:] for r in records]))
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(top)), float(counts[top].sum() / counts.sum())


def decode_step_ms(
    paths: dict[str, str], backend: str = "native", context: int = 300, repeats: int = 40, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Median and minimum ms of one decode step (batch 1, `context` tokens cached) for each model.

    Uses the project's backends (specdec.models.loader). Models are timed interleaved, repetition by
    repetition, so a neighbour's load on a shared machine hits all of them alike; each timed step is undone
    with truncate so every repetition runs at the same position.
    """
    from specdec.models.loader import load_model

    models = {n: load_model(p, backend, dtype="float32", num_slots=1, max_context=context + 8) for n, p in paths.items()}
    prompt = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    slots = {}
    for name, model in models.items():
        slots[name] = model.allocate()
        model.forward([slots[name]], [prompt], [1])
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(repeats + 3):
        for name, model in models.items():
            start = time.perf_counter()
            model.forward([slots[name]], [[prompt[-1]]], [1])
            times[name].append((time.perf_counter() - start) * 1000)
            model.truncate(slots[name], context)
    return {n: {"median_ms": round(float(np.median(t[3:])), 3), "min_ms": round(min(t[3:]), 3)}
            for n, t in times.items()}
