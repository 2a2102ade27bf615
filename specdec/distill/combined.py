"""A draft head and a standalone draft drafting together, evaluated offline (greedy, chained).

The head (EAGLE-style, on the target's features) is better on reasoning-like text, the standalone
draft at copying and in chains (docs/DISTILLATION.md). Here, at each drafted position, the one more
confident of its own token proposes it; where even that one is unsure, the copy rule
(specdec.proposers.copy_guess) may replace it with a token copied from the sequence. Every choice
depends on the drafts' own distributions and the sequence only, so serving this would stay lossless.

Chains as in evaluate_head (its module docstring): under greedy verification only accepted prefixes
matter, and their tokens are the reference tokens, so the head's j-th chained draft and the
standalone draft's teacher-forced prediction at the same position are what each would propose there.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.distill.data import Record
from specdec.distill.evaluate import copy_guesses
from specdec.distill.evaluate_head import reference_windows, windows
from specdec.proposers.copy_guess import CopyRule


@torch.no_grad()
def draft_predictions(draft, records: list[Record], device: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per record, the standalone draft's teacher-forced greedy token at each answer position, [n],
    and its probability, [n]."""
    draft.eval()
    out = []
    for r in records:
        ids = torch.from_numpy(r.tokens.astype(np.int64))[None].to(device)
        probs = draft(input_ids=ids).logits[0, r.prompt_len - 1:len(r.tokens) - 1].float().softmax(-1)
        best = probs.max(-1)
        out.append((best.indices.cpu().numpy(), best.values.cpu().numpy()))
    return out


def combined_chains(records: list[Record], head: list[tuple[np.ndarray, np.ndarray]],
                    draft: list[tuple[np.ndarray, np.ndarray]], k: int,
                    copy: CopyRule | None = None) -> list[np.ndarray]:
    """Per record, chains [n, k] of the combined drafter: head_predictions' and draft_predictions'
    outputs, the more confident proposing, then the copy rule where its confidence is below the rule's."""
    chains = []
    for r, (head_ids, head_conf), (draft_ids, draft_conf) in zip(records, head, draft):
        draft_ids_w, draft_conf_w = windows(draft_ids, k, -2), windows(draft_conf, k, 0.0)
        pick = np.where(head_conf >= draft_conf_w, head_ids, draft_ids_w)
        if copy is not None:
            guesses = windows(copy_guesses(r, copy), k, -1)
            unsure = (np.maximum(head_conf, draft_conf_w) < copy.below) & (guesses >= 0)
            pick = np.where(unsure, guesses, pick)
        chains.append(pick == reference_windows(r, k))
    return chains
