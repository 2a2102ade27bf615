"""Benchmark prompts in the Spec-Bench format: one JSON object a line with `question_id`, `category`
and `turns` (the user turns; single-turn runs use turns[0]).

The project ships a small set of its own (specdec/data/bench_prompts.jsonl, two per category);
any other file of this format, such as the Spec-Bench dev split, is read at run time through a flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from specdec.errors import InvalidArgument


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    text: str  # turns[0]


def default_prompt_file() -> Path:
    return Path(str(resources.files("specdec"))) / "data" / "bench_prompts.jsonl"


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    path = Path(path) if path else default_prompt_file()
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts.append(Prompt(str(row["question_id"]), str(row["category"]), str(row["turns"][0])))
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise InvalidArgument(
                    f"{path}:{number} is no Spec-Bench row (question_id, category, turns: [text, ...]): {exc}"
                ) from None
    if not prompts:
        raise InvalidArgument(f"{path} holds no prompts")
    return prompts


def select_prompts(
    prompts: Sequence[Prompt],
    categories: Sequence[str] = (),
    per_category: int | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """Keep the named categories (all when empty), the first `per_category` of each in file order,
    then the first `limit` overall, taken round-robin over categories so every category is in."""
    known = sorted({p.category for p in prompts})
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise InvalidArgument(f"unknown categories {unknown}; this prompt file has {known}")
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        if not categories or prompt.category in categories:
            by_category.setdefault(prompt.category, []).append(prompt)
    if per_category is not None:
        by_category = {c: ps[:per_category] for c, ps in by_category.items()}
    chosen: list[Prompt] = []
    depth = max((len(ps) for ps in by_category.values()), default=0)
    for i in range(depth):  # round-robin: prompt i of every category, then prompt i + 1
        chosen += [ps[i] for ps in by_category.values() if i < len(ps)]
    return chosen[:limit] if limit is not None else chosen
