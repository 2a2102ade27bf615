"""Token-id shards for distillation and the deterministic batching the trainer reads them with.

A shard is one .npz: all sequences' token ids concatenated (uint16 when the vocabulary fits, so a
million tokens take 2 MB and travel to and from the GPU machine easily), their offsets, prompt lengths
(the loss weights answers and prompts differently), and a category per sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Record:
    tokens: np.ndarray  # [T] prompt then answer
    prompt_len: int
    category: str
    kind: str  # "greedy" | "sampled" answer; "eval" for held-out reference answers


def save_shard(path: str | Path, records: list[Record]) -> None:
    lengths = np.array([len(r.tokens) for r in records], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.concatenate([r.tokens for r in records]) if records else np.zeros(0, dtype=np.int64)
    dtype = np.uint16 if flat.size == 0 or flat.max() < 65536 else np.int32
    path = Path(path)
    tmp = path.with_name("tmp-" + path.name)  # written whole, then renamed: readers never see half a shard
    np.savez(
        tmp, tokens=flat.astype(dtype), offsets=offsets,
        prompt_lens=np.array([r.prompt_len for r in records], dtype=np.int32),
        categories=np.array([r.category for r in records]), kinds=np.array([r.kind for r in records]),
    )
    tmp.replace(path)


def load_shard(path: str | Path) -> list[Record]:
    with np.load(path) as z:
        flat, offsets = z["tokens"].astype(np.int64), z["offsets"]
        return [
            Record(flat[offsets[i]:offsets[i + 1]], int(p), str(c), str(k))
            for i, (p, c, k) in enumerate(zip(z["prompt_lens"], z["categories"], z["kinds"]))
        ]


def load_dir(path: str | Path, pattern: str = "shard-*.npz") -> list[Record]:
    records = []
    for shard in sorted(Path(path).glob(pattern)):
        records.extend(load_shard(shard))
    return records


def split_holdout(records: list[Record], every: int = 100) -> tuple[list[Record], list[Record]]:
    """Every `every`-th record is held out (in-distribution check; never a substitute for Spec-Bench)."""
    train = [r for i, r in enumerate(records) if i % every != every - 1]
    held = [r for i, r in enumerate(records) if i % every == every - 1]
    return train, held


def epoch_batches(
    lengths: list[int], batch_tokens: int, seed: int, epoch: int, pool: int = 64
) -> list[list[int]]:
    """Batches of record indices for one epoch: shuffled, grouped by similar length within pools of
    `pool` batches (little padding), each holding at most `batch_tokens` padded tokens. A function of
    (lengths, seed, epoch) only, so a resumed run rebuilds the same epoch and skips the batches done."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mean_len = max(1, sum(lengths) // max(1, len(lengths)))
    window = max(1, pool * batch_tokens // mean_len)
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        current: list[int] = []
        longest = 0
        for i in chunk:
            longest_if_added = max(longest, lengths[i])
            if current and longest_if_added * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current, longest_if_added = [], lengths[i]
            current.append(i)
            longest = longest_if_added
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches
