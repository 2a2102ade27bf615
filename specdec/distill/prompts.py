"""Prompts for self-distillation: Magpie-style user-turn prefixes, passage tasks, Spec-Bench loading.

Magpie (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing") feeds an instruct model its chat template up to the start of a user turn; sampling from there
yields user requests from the model's own distribution. We steer it with a seed corpus (a task starter,
a topic, a language), so the requests cover the kinds of work a speculative decoder serves, and then reuse
the target's answers as passages for long-context tasks (summarize, answer from a passage, extract).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

# Share of each starter family among generated user turns. "open" is plain Magpie (no steering).
# The Spec-Bench families that dominate its prompt mix (translation, qa, math word problems) get more.
# "news" asks for articles and reports: their answers are the passages summarization tasks prefer, because
# Spec-Bench's summarization prompts are news articles of ~600 tokens (the shipped draft's weakest category
# at 0.57 agreement was trained on single answers of at most 320 tokens as passages).
# Recipe v3 moves share to the categories that stayed below 0.7 agreement after v1 and v2 (qa, stem,
# writing, math) and adds starters in the form of their prompts: capitalised trivia questions, multi-part
# STEM questions on a science topic (the seeds' stem_topics), writing tasks with a constraint, geometry and
# counting problems (docs/DISTILLATION.md, "Recipe v3").
STARTER_WEIGHTS = {
    "open": 0.15, "writing": 0.09, "roleplay": 0.03, "reasoning": 0.04, "math": 0.07, "math_word": 0.08,
    "coding": 0.05, "extraction": 0.03, "stem": 0.12, "humanities": 0.04, "translation": 0.07,
    "summarization": 0.02, "qa": 0.13, "advice": 0.03, "news": 0.05,
}
PASSAGE_TASK_WEIGHTS = {"summarization": 0.4, "rag": 0.33, "extraction": 0.09, "translation": 0.09, "rewriting": 0.09}
NEWS_SOURCE_PREFERENCE = 0.7  # a summarization task's first passage is a "news" answer this often, if any
CUSTOM_SYSTEM_FRACTION = 0.1  # user turns written under a persona system prompt (roleplay-like variety)
_SENTINEL = "\u0000SPLIT\u0000"


@dataclass(frozen=True)
class Seeds:
    system_prompts: list[str]
    topics: list[str]
    languages: list[str]
    names: list[str]
    items: list[str]
    starters: dict[str, list[str]]
    passage_tasks: dict[str, list[str]]
    stem_topics: list[str] = field(default_factory=list)  # {stem_topic}; falls back to the general topics


@dataclass(frozen=True)
class UserPrefix:
    text: str  # chat-template text up to and including the starter; the target continues it
    starter: str  # the part of the user turn already written
    system: str | None  # None: the template's default system prompt
    category: str


def load_seeds(path: str | Path | None = None) -> Seeds:
    """The seed corpus: `path`, or the project's default specdec/data/prompts/seeds.json."""
    if path is None:
        text = resources.files("specdec").joinpath("data/prompts/seeds.json").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    raw = json.loads(text)
    return Seeds(**{k: raw[k] for k in Seeds.__dataclass_fields__ if k in raw})


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


def user_turn_prefix(tokenizer, system: str | None) -> str:
    """The chat template's text before a user turn's content (system prompt included)."""
    text = tokenizer.apply_chat_template(chat_messages(_SENTINEL, system), tokenize=False)
    return text.split(_SENTINEL)[0]


def prompt_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat ending where the assistant's answer starts."""
    text = tokenizer.apply_chat_template(chat_messages(user, system), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _fill(template: str, seeds: Seeds, rng: random.Random) -> str:
    n1, n2 = rng.randint(2, 30), rng.randint(2, 20)
    name, name2 = rng.sample(seeds.names, 2)
    return template.format(
        topic=rng.choice(seeds.topics), lang=rng.choice(seeds.languages), name=name, name2=name2,
        item=rng.choice(seeds.items), n1=n1, n2=n2, n3=rng.randint(20, 900),
        stem_topic=rng.choice(seeds.stem_topics or seeds.topics),
    )


def magpie_prefixes(seeds: Seeds, tokenizer, n: int, rng: random.Random) -> list[UserPrefix]:
    families = list(STARTER_WEIGHTS)
    weights = [STARTER_WEIGHTS[f] for f in families]
    prefixes = []
    for _ in range(n):
        family = rng.choices(families, weights)[0]
        starter = _fill(rng.choice(seeds.starters[family]), seeds, rng)
        system = rng.choice(seeds.system_prompts) if rng.random() < CUSTOM_SYSTEM_FRACTION else None
        if starter and rng.random() < 0.5:
            starter += " "  # half end in a space, so the target's next token is a word start, not a suffix
        prefixes.append(UserPrefix(user_turn_prefix(tokenizer, system) + starter, starter, system, family))
    return prefixes


def passage_tasks(
    seeds: Seeds, sources: list[tuple[str, str]], n: int, rng: random.Random,
    summary_passages: int = 1, news_sources: list[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """Long-context prompts built from (question, answer) pairs: the answers serve as passages.

    Returns (user text, category) pairs. RAG prompts join 1-3 passages and ask one passage's question;
    summarization prompts join 1 to `summary_passages`, led by a `news_sources` article when there are some.
    """
    if not sources:
        return []
    families = list(PASSAGE_TASK_WEIGHTS)
    weights = [PASSAGE_TASK_WEIGHTS[f] for f in families]
    tasks = []
    for _ in range(n):
        family = rng.choices(families, weights)[0]
        template = rng.choice(seeds.passage_tasks[family])
        # Both counts are drawn for every task, whatever its family: chunks depend on this draw order.
        rag_count, summary_count = rng.randint(1, 3), rng.randint(1, max(1, summary_passages))
        count = {"rag": rag_count, "summarization": summary_count}.get(family, 1)
        group = rng.sample(sources, min(len(sources), count))
        if family == "summarization" and news_sources and rng.random() < NEWS_SOURCE_PREFERENCE:
            group[0] = rng.choice(news_sources)
        question, _ = group[0]
        rng.shuffle(group)
        passage = " ".join(answer for _, answer in group)
        sentences = group[0][1].split(". ")
        sentence = ". ".join(sentences[: rng.randint(1, 2)]).strip()
        text = template.format(
            passage=passage, question=question, sentence=sentence, lang=rng.choice(seeds.languages)
        )
        tasks.append((text, family))
    return tasks


@dataclass(frozen=True)
class EvalPrompt:
    question_id: str
    category: str
    text: str


def load_specbench(path: str | Path) -> list[EvalPrompt]:
    """First turns of a Spec-Bench-format jsonl file (question_id, category, turns)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append(EvalPrompt(str(r["question_id"]), r["category"], r["turns"][0]))
    return rows
