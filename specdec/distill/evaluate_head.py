"""Chained evaluation of a draft head: greedy speculative decoding simulated over the target's own answers.

Setting (the same as specdec.distill.evaluate, so the numbers compare): a record is a prompt and the
target's greedy answer s[P..P+n-1]. Speculative steps start at answer index i = 0 and each drafts k tokens;
the target accepts the run of drafted tokens equal to its own, then adds one token (recovered or bonus), so
the next step starts at i + run + 1. Under greedy verification the committed tokens are always the
reference tokens, so everything can be computed from one pass over the reference sequence.

The head's j-th draft (j = 1..k) in the step starting at answer index i: the committed tokens are
s[< P+i]; the target has read s[< P+i-1] (the last committed token came out of its last forward, which
did not read it), so the last true feature is f_{P+i-2}. Draft 1 reads (f_{P+i-2}, s[P+i-1]); draft j > 1
reads the head's own predicted feature and draft j-1 (the reference token, since it only matters when it
was accepted). head.unrolled computes this for every base t = P+i-2 at once.

chains[i, j-1] = (draft j of the step starting at i == s[P+i+j-1]). Reported per category:
- first_token_agreement: share of answer indices with chains[i, 0] (teacher-forced top-1 agreement);
- alpha_j: P(draft j correct | drafts 1..j-1 correct), over every start i with draft j inside the answer;
- acceptance_k: accepted / drafted of the simulated run (a step near the end drafts min(k, n - i));
- tokens_per_step_k: (accepted + steps) / steps, the tokens each target step commits.
A standalone draft reads only tokens, so its chains are its teacher-forced matches: chains[i, j] = m[i+j]
(baseline_chains); then acceptance_k and tokens_per_step_k equal specdec.distill.evaluate.summarize's.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from specdec.distill.data import Record


def target_features(target, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last decoder layer output before its final norm, and after it (lm_head's input),
    both [B, T, H]. The pre-norm one is caught with a hook on the final norm."""
    caught = {}

    def catch(module, inputs, output) -> None:  # returns None: a forward hook's return value replaces the output
        caught["f"] = inputs[0]

    hook = target.model.norm.register_forward_hook(catch)
    try:
        normed = target.model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        hook.remove()
    return caught["f"], normed


def _length_batches(records: list[Record], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))
    batches, current = [], []
    for i in order:
        if current and len(records[i].tokens) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def head_chains(head, target, records: list[Record], k: int, device: str,
                batch_tokens: int = 16384) -> list[np.ndarray]:
    """Per record, chains [n, k] bool (module docstring) of the head drafting k tokens a step."""
    return chains_of(records, head_predictions(head, target, records, k, device, batch_tokens), k)


def chains_of(records: list[Record], predictions: list[tuple[np.ndarray, np.ndarray]], k: int) -> list[np.ndarray]:
    """head_predictions' chained drafts compared with the reference: chains [n, k] per record."""
    return [preds == reference_windows(r, k) for r, (preds, _) in zip(records, predictions)]


@torch.no_grad()
def head_predictions(head, target, records: list[Record], k: int, device: str,
                     batch_tokens: int = 16384) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per record, the head's k chained drafts from every answer index, [n, k] token ids, and its
    probability of each (the softmax's maximum), [n, k]."""
    head.eval()
    out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros((0, k), dtype=np.int64), np.zeros((0, k)))] * len(records)
    for idx in _length_batches(records, batch_tokens):
        width = max(len(records[i].tokens) for i in idx)
        ids = torch.zeros(len(idx), width + k - 1, dtype=torch.long)  # k-1 pad ids: the chains past the end
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(records[i].tokens)] = torch.from_numpy(records[i].tokens)
            mask[row, :len(records[i].tokens)] = 1
        ids, mask = ids.to(device), mask.to(device)
        features = head.pick(*target_features(target, ids[:, :width], mask))
        outputs = head.unrolled(features[:, :width - 1], ids[:, 1:], k)  # k x [B, width-1, H]
        for row, i in enumerate(idx):
            r = records[i]
            prompt, n = r.prompt_len, len(r.tokens) - r.prompt_len
            if prompt < 2:
                raise ValueError("a head needs at least 2 prompt tokens (one true feature before the answer)")
            bases = torch.arange(prompt - 2, prompt - 2 + n, device=device)
            probs = [head.logits(o[row, bases]).float().softmax(-1).max(-1) for o in outputs]
            out[i] = (torch.stack([p.indices for p in probs], dim=1).cpu().numpy(),
                      torch.stack([p.values for p in probs], dim=1).cpu().numpy())
    return out


def windows(x: np.ndarray, k: int, fill) -> np.ndarray:
    """[n, k] read-only view: row i is x[i], ..., x[i + k - 1], with `fill` past the end of x."""
    return np.lib.stride_tricks.sliding_window_view(np.concatenate([x, np.full(k - 1, fill, dtype=x.dtype)]), k)


def reference_windows(r: Record, k: int) -> np.ndarray:
    """[n, k]: the reference token each of the k drafts of the step starting at answer index i must
    equal, s[P+i+j] (-1 past the end)."""
    return windows(r.tokens[r.prompt_len:].astype(np.int64), k, -1)


def baseline_chains(matches: list[np.ndarray], k: int) -> list[np.ndarray]:
    """Chains of a standalone draft from its teacher-forced matches (its drafts depend on tokens only)."""
    return [windows(m.astype(bool), k, False).copy() for m in matches]


def simulate(chains: np.ndarray) -> tuple[int, int, int]:
    """(accepted, drafted, steps) of greedy speculative decoding whose step at answer index i drafts the
    chain chains[i] ([n, k] bool)."""
    n, k = chains.shape
    i = accepted = drafted = steps = 0
    while i < n:
        width = min(k, n - i)
        run = 0
        while run < width and chains[i, run]:
            run += 1
        accepted, drafted, steps = accepted + run, drafted + width, steps + 1
        i += run + 1
    return accepted, drafted, steps


def _prefix_counts(chains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For j = 1..k: how many starts have draft j inside the answer with drafts 1..j-1 right (denominator
    of alpha_j), and how many of those have draft j right too (numerator)."""
    n, k = chains.shape
    right_so_far = np.cumprod(chains, axis=1).astype(bool)  # [n, k] drafts 1..j all right
    inside = np.arange(n)[:, None] + np.arange(k)[None, :] < n  # draft j+1 of start i is inside
    before = np.concatenate([np.ones((n, 1), dtype=bool), right_so_far[:, :-1]], axis=1)
    return (before & inside).sum(0), (right_so_far & inside).sum(0)


def _metrics(chains: list[np.ndarray], k: int) -> dict:
    total = np.zeros(3, dtype=np.int64)
    tried, right = np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    first, tokens = 0, 0
    for c in chains:
        if not len(c):
            continue
        total += np.array(simulate(c))
        t, r = _prefix_counts(c)
        tried, right = tried + t, right + r
        first, tokens = first + int(c[:, 0].sum()), tokens + len(c)
    accepted, drafted, steps = total
    return {
        "first_token_agreement": round(first / max(tokens, 1), 4),
        **{f"alpha_{j + 1}": round(float(right[j] / max(tried[j], 1)), 4) for j in range(k)},
        f"acceptance_k{k}": round(float(accepted / max(drafted, 1)), 4),
        f"tokens_per_step_k{k}": round(float((accepted + steps) / max(steps, 1)), 3),
        "tokens": tokens,
    }


def chain_summary(records: list[Record], chains: list[np.ndarray], k: int = 4) -> dict:
    """Per category, the mean of categories (overall_macro) and all tokens pooled (overall_tokens)."""
    by_category: dict[str, list[np.ndarray]] = defaultdict(list)
    for r, c in zip(records, chains):
        by_category[r.category].append(c)
    result = {cat: _metrics(cs, k) for cat, cs in sorted(by_category.items())}
    keys = [key for key in next(iter(result.values()), {}) if key != "tokens"]
    result["overall_macro"] = {key: round(float(np.mean([result[c][key] for c in by_category])), 4) for key in keys}
    result["overall_tokens"] = _metrics(chains, k)
    return result


@torch.no_grad()
def head_step_ms(head, target, context: int = 300, repeats: int = 40, head_rows: int | None = None,
                 seed: int = 0) -> dict[str, dict[str, float]]:
    """Median and minimum ms of one drafting step of the head (batch 1, `context` entries cached: fc, the
    new entry's keys, attention over context + 1 keys, MLP, and the frozen norm / lm_head, or only its
    first `head_rows` rows) and of one target decode step (HF forward with a cache of `context` tokens),
    timed interleaved in plain PyTorch on whatever device the modules are on (meant for the CPU)."""
    import time

    from transformers import DynamicCache

    from specdec.models.hf_backend import cache_kwarg

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, min(1000, head.cfg.vocab_size), (1, context), generator=gen)
    hidden = head.cfg.hidden_size
    cached = head.layer.keys_values(torch.randn(1, context, hidden, generator=gen), torch.arange(context)[None])[1:]
    feature, token = torch.randn(1, 1, hidden, generator=gen), prompt[:, -1:]
    rows = target.get_output_embeddings().weight[:head_rows] if head_rows else None
    mask = torch.ones(1, context + 1, dtype=torch.bool)

    def head_step():
        x = head.fc(torch.cat([head.embed(token), feature], dim=-1))
        positions = torch.tensor([[context]])
        normed, k, v = head.layer.keys_values(x, positions)
        g = head.layer(x, normed, positions, torch.cat([cached[0], k], 2), torch.cat([cached[1], v], 2), mask)
        if rows is None:
            return head.logits(g).argmax(-1)
        return (head._frozen[1](g) if head.cfg.feature == "pre_norm" else g) @ rows.T

    cache = DynamicCache()
    with_cache = {cache_kwarg(target): cache}
    target(input_ids=prompt, use_cache=True, **with_cache)

    def target_step():
        target(input_ids=token, use_cache=True, **with_cache)
        cache.crop(-1)  # every repetition at the same position

    times: dict[str, list[float]] = {"head": [], "target": []}
    for _ in range(repeats + 3):
        for name, step in (("head", head_step), ("target", target_step)):
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1000)
    return {n: {"median_ms": round(float(np.median(t[3:])), 3), "min_ms": round(min(t[3:]), 3)}
            for n, t in times.items()}
