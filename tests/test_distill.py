"""specdec.distill on tiny random models: batched generation equals HF greedy, data generation, training
(determinism under a seed, resume), the exported checkpoint loads with transformers, and the metrics."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.distill.__main__ import main as distill_main
from specdec.distill.batched_llama import BatchedLlama, generate_batch
from specdec.distill.data import Record, epoch_batches, load_dir, load_shard, save_shard
from specdec.distill.draft import DraftSpec
from specdec.distill.evaluate import agreement_interval, by_position, speculative_counts, summarize
from specdec.distill.generate import GenerateConfig, generate_data
from specdec.distill.prompts import load_seeds, magpie_prefixes, passage_tasks
from specdec.distill.train import TrainConfig, Trainer
from specdec.testing.tiny_models import make_tiny_model

DRAFT = "h64-l1-i128-kv1"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), variant="smollm", vocab_size=256, num_layers=2)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return AutoTokenizer.from_pretrained(target_dir)


def _gen_config(out, **kw):
    defaults = dict(out_dir=str(out), seed=3, chunks=2, prompts_per_chunk=6, max_user_tokens=12,
                    max_answer_tokens=16, max_passage_answer_tokens=8, min_passage_tokens=4, batch_size=4,
                    max_batch_tokens=4 * 400, keep_unfinished_user_turns=True)
    return GenerateConfig(**{**defaults, **kw})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target, tokenizer):
    out = tmp_path_factory.mktemp("data")
    generate_data(BatchedLlama(target), tokenizer, load_seeds(), _gen_config(out))
    return out


@torch.no_grad()
def _hf_greedy(model, prompt, n):
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        tok = int(model(ids).logits[0, -1].argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


def test_batched_generation_equals_hf_greedy_with_left_padding(target):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    results = generate_batch(BatchedLlama(target), prompts, 10, stop_ids=set(), pad_id=0)
    for prompt, (new, stopped) in zip(prompts, results):
        assert new == _hf_greedy(target, prompt, 10)
        assert not stopped


def test_batched_generation_stops_at_stop_token(target):
    prompt = [20, 21, 22]
    reference = _hf_greedy(target, prompt, 8)
    stop = reference[3]
    (new, stopped), = generate_batch(BatchedLlama(target), [prompt], 8, stop_ids={stop}, pad_id=0)
    assert stopped and new == reference[:reference.index(stop) + 1]


def test_sampling_is_seeded(target):
    runner = BatchedLlama(target)
    draw = lambda: generate_batch(runner, [[1, 2, 3]] * 3, 8, set(), 0, temperature=1.0, top_p=0.9,
                                  generator=torch.Generator().manual_seed(7))
    assert draw() == draw()


def test_magpie_prefixes_and_passage_tasks(tokenizer):
    seeds = load_seeds()
    prefixes = magpie_prefixes(seeds, tokenizer, 50, random.Random(0))
    assert all(p.text.endswith(p.starter) and "<|im_start|>user\n" in p.text for p in prefixes)
    assert len({p.category for p in prefixes}) > 5
    tasks = passage_tasks(seeds, [("Q one?", "Answer one. More."), ("Q two?", "Answer two.")], 20, random.Random(0))
    assert all("Answer" in text for text, _ in tasks)


def test_stem_topic_starters_use_the_seeds_stem_topics_or_fall_back_to_topics(tokenizer):
    seeds = load_seeds()
    starters = {**seeds.starters, "stem": ["In the field of {stem_topic}, what is"]}
    steered = dataclasses.replace(seeds, starters=starters)
    texts = {p.starter.strip() for p in magpie_prefixes(steered, tokenizer, 400, random.Random(2)) if p.category == "stem"}
    assert texts and all(any(t == f"In the field of {s}, what is" for s in seeds.stem_topics) for t in texts)
    without = dataclasses.replace(steered, stem_topics=[])  # an older seed corpus: the general topics fill it
    texts = {p.starter.strip() for p in magpie_prefixes(without, tokenizer, 400, random.Random(2)) if p.category == "stem"}
    assert texts and all(any(t == f"In the field of {s}, what is" for s in seeds.topics) for t in texts)


def test_summaries_join_passages_and_prefer_news_articles():
    seeds = load_seeds()
    sources = [(f"Q{i}?", f"Answer {i}. More of it.") for i in range(20)]
    news = [("Write a news article", "NEWS story. Details.")]
    tasks = [text for text, family in passage_tasks(seeds, sources, 400, random.Random(1), summary_passages=3,
                                                     news_sources=news) if family == "summarization"]
    assert len(tasks) > 50
    led_by_news = sum("NEWS story" in t for t in tasks) / len(tasks)
    assert 0.55 < led_by_news < 0.85  # NEWS_SOURCE_PREFERENCE = 0.7
    joined = [t.count("More of it") + t.count("NEWS story") for t in tasks]
    assert min(joined) == 1 and max(joined) == 3
    single = passage_tasks(seeds, sources, 200, random.Random(1))  # the defaults: one passage, no news
    assert all(t.count("More of it") == 1 for t, family in single if family == "summarization")


def test_generate_data_writes_shards_deterministically(data_dir, tmp_path, target, tokenizer):
    records = load_dir(data_dir)
    assert len(list(data_dir.glob("shard-*.npz"))) == 2 and records
    assert all(0 < r.prompt_len < len(r.tokens) for r in records)
    assert {r.kind for r in records} <= {"greedy", "sampled"}
    assert any(r.category.startswith("passage_") for r in records)
    again = tmp_path / "again"
    generate_data(BatchedLlama(target), tokenizer, load_seeds(), _gen_config(again))
    for a, b in zip(records, load_dir(again), strict=True):
        assert np.array_equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len


def test_shard_roundtrip(tmp_path):
    records = [Record(np.array([1, 2, 3, 70000]), 2, "qa", "greedy"), Record(np.array([5]), 1, "x", "eval")]
    save_shard(tmp_path / "shard-00000.npz", records)
    back = load_shard(tmp_path / "shard-00000.npz")
    assert [r.tokens.tolist() for r in back] == [[1, 2, 3, 70000], [5]]
    assert [(r.prompt_len, r.category, r.kind) for r in back] == [(2, "qa", "greedy"), (1, "x", "eval")]


def test_epoch_batches_respect_budget_and_cover_each_record_once():
    lengths = [random.Random(i).randint(5, 60) for i in range(200)]
    batches = epoch_batches(lengths, 256, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(max(lengths[i] for i in b) * len(b) <= 256 for b in batches)
    assert batches == epoch_batches(lengths, 256, seed=1, epoch=0)
    assert batches != epoch_batches(lengths, 256, seed=1, epoch=1)


def _train_config(data_dir, out, max_steps, **kw):
    return TrainConfig(data_dir=str(data_dir), out_dir=str(out), drafts=(DRAFT,), max_steps=max_steps,
                       batch_tokens=256, max_len=64, warmup_steps=2, eval_every=0, save_every=2, log_every=1,
                       device="cpu", holdout_every=5, **kw)


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / DRAFT / "model.safetensors"))


def test_training_is_deterministic_and_resumes(data_dir, tmp_path, target, tokenizer):
    straight = tmp_path / "straight"
    Trainer(_train_config(data_dir, straight, 4), target, tokenizer).train()
    twin = tmp_path / "twin"
    Trainer(_train_config(data_dir, twin, 4), target, tokenizer).train()
    resumed = tmp_path / "resumed"
    Trainer(_train_config(data_dir, resumed, 4, stop_at_step=2), target, tokenizer).train()  # interrupted
    trainer = Trainer(_train_config(data_dir, resumed, 4), target, tokenizer)
    assert trainer.step == 2
    trainer.train()
    a, b, c = _weights(straight), _weights(twin), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], c[k]) for k in a)
    log = [json.loads(line) for line in (straight / "train_log.jsonl").read_text().splitlines()]
    losses = [r[DRAFT]["loss"] for r in log if "lr" in r]
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_reload_data_waits_for_the_generators_first_shard(data_dir, tmp_path, target, tokenizer):
    """A trainer started beside generate-data (--reload-data) finds no shard yet: it waits, not fails."""
    import shutil
    import threading

    late = tmp_path / "late"
    late.mkdir()
    first = sorted(data_dir.glob("shard-*.npz"))[0]
    writer = threading.Timer(1.0, lambda: shutil.copy(first, late / first.name))
    writer.start()
    trainer = Trainer(_train_config(late, tmp_path / "waited", 1, reload_data=True), target, tokenizer)
    writer.join()
    assert len(trainer.train_records) + len(trainer.held_records) == len(load_shard(first))
    with pytest.raises(FileNotFoundError, match="no shard"):  # without a generator, an empty directory is an error
        Trainer(_train_config(tmp_path / "empty", tmp_path / "none", 1), target, tokenizer)
    with pytest.raises(FileNotFoundError, match="no shard"):  # and the wait is bounded
        Trainer(_train_config(tmp_path / "empty", tmp_path / "none", 1, reload_data=True, first_shard_wait_s=0.2),
                target, tokenizer)


def test_training_can_start_from_a_trained_draft(data_dir, tmp_path, target, tokenizer):
    first = tmp_path / "first"
    Trainer(_train_config(data_dir, first, 3, lr=1e-2), target, tokenizer).train()
    saved = _weights(first)
    fresh = Trainer(_train_config(data_dir, tmp_path / "fresh", 1), target, tokenizer).drafts[DRAFT].state_dict()
    warm = Trainer(_train_config(data_dir, tmp_path / "warm", 1, init_from=str(first / DRAFT)), target, tokenizer)
    start = warm.drafts[DRAFT].state_dict()
    assert all(torch.equal(start[k], saved[k].float()) for k in saved)
    assert not torch.equal(fresh["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="is not a"):
        Trainer(TrainConfig(data_dir=str(data_dir), out_dir=str(tmp_path / "other"), drafts=("h128-l2-i256-kv1",),
                            init_from=str(first / DRAFT), device="cpu"), target, tokenizer)


def test_loss_decreases_with_soft_labels(data_dir, tmp_path, target, tokenizer):
    cfg = _train_config(data_dir, tmp_path / "run", 30, lr=1e-2)
    trainer = Trainer(cfg, target, tokenizer)
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    kl = [r[DRAFT]["kl"] for r in log if "lr" in r]
    assert np.mean(kl[-5:]) < np.mean(kl[:5])


def test_cli_end_to_end_and_checkpoint_loads(target_dir, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                               enumerate([("qa", "Who wrote it?"), ("math", "What is 2+2?"), ("qa", "Where?")])))
    assert distill_main(["generate-data", "--target", str(target_dir), "--out", str(data), "--chunks", "1",
                         "--prompts-per-chunk", "4", "--max-user-tokens", "8", "--max-answer-tokens", "8",
                         "--max-passage-answer-tokens", "4", "--batch-size", "4", "--device", "cpu",
                         "--dtype", "float32"]) == 0
    # A random target rarely ends its user turns; the CLI keeps only finished ones, so top up the data.
    if not load_dir(data):
        save_shard(data / "shard-00000.npz", [Record(np.arange(10, 40), 10, "qa", "greedy")] * 4)
    eval_file = tmp_path / "eval.npz"
    assert distill_main(["make-eval", "--target", str(target_dir), "--prompts", str(prompts), "--out",
                         str(eval_file), "--max-new-tokens", "6", "--device", "cpu"]) == 0
    assert distill_main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(run),
                         "--draft", DRAFT, "--eval", str(eval_file), "--max-steps", "2", "--batch-tokens", "128",
                         "--eval-every", "1", "--device", "cpu", "--dtype", "float32"]) == 0
    draft = AutoModelForCausalLM.from_pretrained(run / DRAFT)
    assert draft.config.vocab_size == 256 and draft.config.tie_word_embeddings
    assert draft.dtype == torch.bfloat16  # stored in bf16: half the bytes
    assert AutoTokenizer.from_pretrained(run / DRAFT).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>user")
    out_json = tmp_path / "result.json"
    assert distill_main(["evaluate", "--draft", str(run / DRAFT), "--eval", str(eval_file), "--device", "cpu",
                         "--head-vocab", "16", "--json-out", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert set(result["full_head"]) >= {"qa", "math", "overall_macro", "overall_tokens"}
    assert 0.0 <= result["head_16"]["overall_tokens"]["agreement"] <= 1.0
    first = tmp_path / "first.json"  # only each answer's first 2 tokens scored
    assert distill_main(["evaluate", "--draft", str(run / DRAFT), "--eval", str(eval_file), "--device", "cpu",
                         "--answer-tokens", "2", "--by-position", "4,8", "--json-out", str(first)]) == 0
    answers = [len(r.tokens) - r.prompt_len for r in load_shard(eval_file)]
    scored = json.loads(first.read_text())["full_head"]
    assert scored["overall_tokens"]["tokens"] == sum(min(n, 2) for n in answers)
    # The position buckets split the same scored tokens, category by category.
    assert sum(b["tokens"] for cat in scored["by_position"].values() for b in cat.values()) == sum(min(n, 2) for n in answers)
    assert result["full_head"]["overall_tokens"]["tokens"] == sum(answers)


def test_distill_help_lists_steps(capsys):
    with pytest.raises(SystemExit):
        distill_main(["--help"])
    text = capsys.readouterr().out
    assert all(step in text for step in ("generate-data", "make-eval", "train", "evaluate", "cost"))


@pytest.mark.parametrize("matches,k,expected", [
    ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 4, (8, 8, 2)),  # 4 accepted + the target's bonus token, twice
    ([0, 0, 0], 4, (0, 6, 3)),  # each step's first token is rejected; drafts stop at the answer's end
    ([1, 0, 1, 1], 2, (3, 4, 2)),  # step 1: accept 1, reject; step 2 starts after the recovered token
])
def test_speculative_counts(matches, k, expected):
    assert speculative_counts(np.array(matches, dtype=bool), k) == expected


def test_summarize_per_category():
    records = [Record(np.arange(6), 2, "a", "eval"), Record(np.arange(5), 1, "b", "eval")]
    matches = [np.array([1, 1, 0, 1], dtype=bool), np.array([0, 0, 0, 0], dtype=bool)]
    result = summarize(records, matches, k=2)
    assert result["a"]["agreement"] == 0.75 and result["b"]["agreement"] == 0.0
    assert result["overall_tokens"]["agreement"] == 0.375
    assert result["overall_macro"]["agreement"] == 0.375
    assert result["a"]["answers"] == 1 and result["a"]["agreement_ci95"] == [0.75, 0.75]  # one answer: no spread


def test_agreement_interval_resamples_answers_not_tokens():
    # Five answers of 200 tokens, agreeing 0.5-0.9: the pooled 0.7 is known only to the answers' spread.
    answers = [np.arange(200) < 200 * share for share in (0.5, 0.6, 0.7, 0.8, 0.9)]
    lo, hi = agreement_interval(answers)
    assert lo < 0.62 and hi > 0.78 and lo < 0.7 < hi  # a token-level interval would be about +-0.03
    assert agreement_interval(answers) == [lo, hi]  # deterministic (a fixed seed)
    same = [np.arange(200) < 140] * 5
    assert agreement_interval(same) == [0.7, 0.7]  # identical answers: no spread at all


def test_by_position_buckets_answer_tokens_by_absolute_position():
    # Record a: prompt of 2, answer positions 2..5; record b (other category): prompt 1, positions 1..4.
    records = [Record(np.arange(6), 2, "a", "eval"), Record(np.arange(5), 1, "b", "eval")]
    matches = [np.array([1, 1, 0, 1], dtype=bool), np.array([0, 1, 1, 1], dtype=bool)]
    result = by_position(records, matches, [3, 5])
    assert result["a"] == {"[0,3)": {"agreement": 1.0, "tokens": 1}, "[3,5)": {"agreement": 0.5, "tokens": 2},
                           "[5,)": {"agreement": 1.0, "tokens": 1}}
    assert result["b"] == {"[0,3)": {"agreement": 0.5, "tokens": 2}, "[3,5)": {"agreement": 1.0, "tokens": 2}}


@pytest.mark.parametrize("text", ["0,10", "10,5", "10,10", "a,b", ""])
def test_position_edges_refuse_what_cannot_split(text):
    from specdec.commands.distill import _position_edges
    with pytest.raises(argparse.ArgumentTypeError):
        _position_edges(text)


def test_draft_spec_parsing():
    spec = DraftSpec.parse("h256-l3-i768-kv2")
    assert (spec.hidden, spec.layers, spec.intermediate, spec.kv_heads) == (256, 3, 768, 2)
    assert spec.name == "h256-l3-i768-kv2"
    with pytest.raises(ValueError):
        DraftSpec.parse("h250-l3-i768-kv2")


def test_cli_default_draft_shape_matches_the_trainer():
    from specdec.commands.distill import DEFAULT_DRAFT as cli_default
    from specdec.distill.draft import DEFAULT_DRAFT

    assert cli_default == DEFAULT_DRAFT
