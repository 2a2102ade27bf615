"""Target-generated training data: user turns (Magpie), the target's answers, passage tasks.

One chunk = `prompts_per_chunk` seeded user-turn prefixes taken through three rounds on the target:
  1. the target writes the user turn (sampled at `user_temperature`);
  2. the target answers it (greedy, the traffic a greedy speculative decoder serves; a fraction sampled);
  3. long answers become passages for summarize / answer-from-passage / extract / translate prompts,
     which the target answers greedily too.
Each chunk is written as one shard as soon as it is done, so a time budget or a lost machine costs at
most one chunk, and a chunk's content depends only on (seed, chunk index).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specdec.distill.batched_llama import BatchedLlama, generate_batch
from specdec.distill.data import Record, save_shard
from specdec.distill.prompts import Seeds, load_specbench, magpie_prefixes, passage_tasks, prompt_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateConfig:
    out_dir: str
    seed: int = 0
    chunks: int = 1
    first_chunk: int = 0
    prompts_per_chunk: int = 2048
    max_user_tokens: int = 96
    max_answer_tokens: int = 320
    max_passage_answer_tokens: int = 256
    passage_fraction: float = 0.35  # passage prompts per chunk, relative to prompts_per_chunk
    summary_passages: int = 1  # a summarization task joins 1 to this many answers (longer documents)
    min_passage_tokens: int = 64
    sampled_fraction: float = 0.15  # answers sampled instead of greedy, for robustness off the greedy path
    user_temperature: float = 1.0
    user_top_p: float = 0.98
    answer_temperature: float = 0.7
    batch_size: int = 512
    max_batch_tokens: int = 512 * 640  # rows * (prompt + new tokens) per batch
    keep_unfinished_user_turns: bool = False  # tests with random-weight targets set this
    time_budget_s: float = 0.0  # stop before a chunk that would start after this (0: no limit)


def run_prompts(
    runner: BatchedLlama, prompts: list[list[int]], max_new: int, stop_ids: set[int], pad_id: int,
    temperature: float, top_p: float, generator: torch.Generator | None, batch_size: int,
    max_batch_tokens: int, desc: str,
) -> list[tuple[list[int], bool]]:
    """Generate for every prompt, batching prompts of similar length; results in input order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    pos = 0
    bar = tqdm(total=len(prompts), desc=desc, leave=False, mininterval=5)
    while pos < len(order):
        longest = len(prompts[order[min(pos + batch_size, len(order)) - 1]])
        rows = max(1, min(batch_size, max_batch_tokens // (longest + max_new)))
        idx = order[pos:pos + rows]
        for i, res in zip(idx, generate_batch(runner, [prompts[i] for i in idx], max_new, stop_ids, pad_id,
                                              temperature, top_p, generator)):
            results[i] = res
        pos += len(idx)
        bar.update(len(idx))
    bar.close()
    return results


def stop_and_pad_ids(tokenizer) -> tuple[set[int], int]:
    """Tokens that end a turn (EOS and the chat template's end-of-turn markers) and the pad id."""
    vocab = tokenizer.get_vocab()
    stop_ids = {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if t in vocab}
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return stop_ids, pad_id


def _strip_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens


def generate_chunk(
    runner: BatchedLlama, tokenizer, seeds: Seeds, cfg: GenerateConfig, chunk: int
) -> tuple[list[Record], dict]:
    rng = random.Random(cfg.seed * 1_000_003 + chunk)
    gen = torch.Generator(device=runner.device).manual_seed(cfg.seed * 1_000_003 + chunk)
    stop_ids, pad_id = stop_and_pad_ids(tokenizer)
    common = dict(stop_ids=stop_ids, pad_id=pad_id, generator=gen, batch_size=cfg.batch_size,
                  max_batch_tokens=cfg.max_batch_tokens)
    stats = {"chunk": chunk, "tokens_generated": 0}

    # Round 1: user turns.
    prefixes = magpie_prefixes(seeds, tokenizer, cfg.prompts_per_chunk, rng)
    prefix_ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prefixes]
    turns = run_prompts(runner, prefix_ids, cfg.max_user_tokens, temperature=cfg.user_temperature,
                        top_p=cfg.user_top_p, desc=f"chunk {chunk} user turns", **common)
    users, seen = [], set()
    for p, (new, stopped) in zip(prefixes, turns):
        stats["tokens_generated"] += len(new)
        text = (p.starter + tokenizer.decode(_strip_stop(new, stop_ids))).strip()
        if (stopped or cfg.keep_unfinished_user_turns) and len(text) >= 8 and text not in seen:
            seen.add(text)
            users.append((text, p.system, p.category))
    stats["user_turns"] = len(users)

    # Round 2: answers, mostly greedy.
    sampled = [rng.random() < cfg.sampled_fraction for _ in users]
    answer_prompts = [prompt_ids(tokenizer, text, system) for text, system, _ in users]
    records, sources, news_sources = [], [], []
    for is_sampled in (False, True):
        idx = [i for i, s in enumerate(sampled) if s == is_sampled]
        outs = run_prompts(runner, [answer_prompts[i] for i in idx], cfg.max_answer_tokens,
                           temperature=cfg.answer_temperature if is_sampled else 0.0, top_p=0.95,
                           desc=f"chunk {chunk} answers ({'sampled' if is_sampled else 'greedy'})", **common)
        for i, (new, stopped) in zip(idx, outs):
            stats["tokens_generated"] += len(new)
            records.append(Record(np.array(answer_prompts[i] + new), len(answer_prompts[i]), users[i][2],
                                  "sampled" if is_sampled else "greedy"))
            answer = _strip_stop(new, stop_ids)
            if not is_sampled and len(answer) >= cfg.min_passage_tokens:
                sources.append((users[i][0], tokenizer.decode(answer).strip()))
                if users[i][2] == "news":
                    news_sources.append(sources[-1])

    # Round 3: passage tasks over this chunk's own answers.
    tasks = passage_tasks(seeds, sources, int(cfg.prompts_per_chunk * cfg.passage_fraction), rng,
                          cfg.summary_passages, news_sources)
    task_prompts = [prompt_ids(tokenizer, text) for text, _ in tasks]
    outs = run_prompts(runner, task_prompts, cfg.max_passage_answer_tokens, temperature=0.0, top_p=1.0,
                       desc=f"chunk {chunk} passage tasks", **common)
    for (text, family), ids, (new, _) in zip(tasks, task_prompts, outs):
        stats["tokens_generated"] += len(new)
        records.append(Record(np.array(ids + new), len(ids), "passage_" + family, "greedy"))
    stats["records"] = len(records)
    stats["answer_tokens"] = int(sum(len(r.tokens) - r.prompt_len for r in records))
    stats["total_tokens"] = int(sum(len(r.tokens) for r in records))
    return records, stats


def generate_data(runner: BatchedLlama, tokenizer, seeds: Seeds, cfg: GenerateConfig) -> list[dict]:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"generate_config-{cfg.first_chunk:05d}.json").write_text(json.dumps(asdict(cfg), indent=2))
    start = time.time()
    all_stats = []
    for chunk in range(cfg.first_chunk, cfg.first_chunk + cfg.chunks):
        shard = out / f"shard-{chunk:05d}.npz"
        if shard.exists():
            log.info("chunk %d already done (%s)", chunk, shard)
            continue
        if cfg.time_budget_s and time.time() - start > cfg.time_budget_s:
            log.info("time budget reached before chunk %d", chunk)
            break
        t0 = time.time()
        records, stats = generate_chunk(runner, tokenizer, seeds, cfg, chunk)
        save_shard(shard, records)
        stats["seconds"] = round(time.time() - t0, 1)
        stats["generated_tokens_per_s"] = round(stats["tokens_generated"] / max(stats["seconds"], 1e-9))
        all_stats.append(stats)
        with open(out / "generate_log.jsonl", "a") as f:
            f.write(json.dumps(stats) + "\n")
        log.info("chunk %d: %s", chunk, stats)
    return all_stats


def generate_eval_set(
    runner: BatchedLlama, tokenizer, prompts_path: str, out_path: str, max_new_tokens: int = 256,
    batch_size: int = 256,
) -> list[Record]:
    """The target's greedy answers to held-out Spec-Bench-format prompts: the reference the draft's
    agreement is measured against. Evaluation only: never pass this file to training."""
    prompts = load_specbench(prompts_path)
    ids = [prompt_ids(tokenizer, p.text) for p in prompts]
    stop_ids, pad_id = stop_and_pad_ids(tokenizer)
    outs = run_prompts(runner, ids, max_new_tokens, stop_ids, pad_id, 0.0, 1.0, None, batch_size,
                       batch_size * 2048, desc="eval answers")
    records = [Record(np.array(i + new), len(i), p.category, "eval") for p, i, (new, _) in zip(prompts, ids, outs)]
    save_shard(out_path, records)
    return records
