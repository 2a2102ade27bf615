"""The EAGLE-style draft head (specdec.distill.head, train_head, evaluate_head) on a tiny random target:
the one-forward unrolled drafting equals drafting step by step, an oracle head gets acceptance 1.0, the
chain metrics match hand counts and specdec.distill.evaluate's, training lowers the loss, is deterministic
under a seed and resumes exactly, and a checkpoint round-trips without the target's weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdec.distill.__main__ import main as distill_main
from specdec.distill.batched_llama import BatchedLlama, generate_batch
from specdec.distill.data import Record, save_shard
from specdec.distill.evaluate import summarize
from specdec.distill.evaluate_head import baseline_chains, chain_summary, head_chains, simulate, target_features
from specdec.distill.head import DraftHead, HeadConfig, load_head, save_head
from specdec.distill.train_head import HeadTrainConfig, HeadTrainer, losses_of
from specdec.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), variant="smollm", vocab_size=256, num_layers=2)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _greedy_records(target, count: int, seed: int, answer_len: int = 14) -> list[Record]:
    """Random prompts and the target's greedy answers (what make-eval and the greedy shards hold)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 256, size=int(rng.integers(3, 9))).tolist() for _ in range(count)]
    answers = generate_batch(BatchedLlama(target), prompts, answer_len, stop_ids=set(), pad_id=0)
    return [Record(np.array(p + a, dtype=np.int64), len(p), ("qa", "rag")[i % 2], "greedy")
            for i, (p, (a, _)) in enumerate(zip(prompts, answers))]


@pytest.fixture(scope="module")
def data(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("shards")
    save_shard(folder / "shard-00000.npz", _greedy_records(target, 48, seed=1))
    save_shard(folder / "eval.npz", _greedy_records(target, 6, seed=2, answer_len=10))
    return folder


def _head(target, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    return DraftHead(HeadConfig.from_target(target.config, "tiny")).attach(target).eval()


def _step_by_step(head: DraftHead, features: torch.Tensor, tokens: torch.Tensor, base: int,
                  k: int) -> list[torch.Tensor]:
    """Brute force: draft k tokens after base index `base` by running the head causally over its whole
    entry list each time (true entries 0..base, then its own predicted features)."""
    feats, ids, outs = list(features[:base + 1]), list(tokens[1:base + 2]), []
    for j in range(k):
        x = head.fc(torch.cat([head.embed(torch.stack(ids)), torch.stack(feats)], dim=-1))[None]
        positions = torch.arange(len(feats))[None]
        normed, keys, values = head.layer.keys_values(x, positions)
        causal = torch.ones(len(feats), len(feats), dtype=torch.bool).tril()
        out = head.layer(x, normed, positions, keys, values, causal)[0, -1]
        outs.append(out)
        feats.append(out)
        ids.append(tokens[base + 2 + j])
    return outs


@torch.no_grad()
def test_unrolled_forward_equals_drafting_step_by_step(target):
    head = _head(target)
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    features = head.pick(*target_features(target, tokens[None], torch.ones(1, 12, dtype=torch.long)))
    k = 3
    padded = torch.cat([tokens[1:], torch.zeros(k - 1, dtype=torch.long)])
    unrolled = head.unrolled(features[:, :11], padded[None], k)
    for base in (0, 4, 7):
        for j, out in enumerate(_step_by_step(head, features[0], tokens, base, k)):
            torch.testing.assert_close(unrolled[j][0, base], out, rtol=1e-5, atol=1e-5)


class _OracleHead(DraftHead):
    """Predicts every feature exactly: the target's own, read off the full sequence (whose first token,
    which unrolled is not given, is set beforehand)."""

    first_id = 0

    def unrolled(self, features, next_ids, passes):
        first = next_ids.new_full((next_ids.shape[0], 1), self.first_id)
        ids = torch.cat([first, next_ids], dim=1)  # ids[:, t] = x_t
        full = self.pick(*target_features(self.oracle_of[0], ids, torch.ones_like(ids)))
        return [full[:, p:p + features.shape[1]] for p in range(1, passes + 1)]


@torch.no_grad()
def test_target_features_leave_the_target_unchanged(target):
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    pre_norm, post_norm = target_features(target, ids, mask)
    plain = target(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(target.lm_head(post_norm), plain.logits)
    torch.testing.assert_close(target.model.norm(pre_norm), post_norm)
    assert not torch.allclose(pre_norm, post_norm)


@pytest.mark.parametrize("feature", ["post_norm", "pre_norm"])
def test_an_exact_head_is_always_accepted(target, data, feature):
    from specdec.distill.data import load_shard

    records = load_shard(data / "eval.npz")
    oracle = _OracleHead(HeadConfig.from_target(target.config, feature=feature)).attach(target)
    oracle.oracle_of = (target,)
    chains = []
    for r in records:  # one record a call: the oracle needs each sequence's first token
        oracle.first_id = int(r.tokens[0])
        chains += head_chains(oracle, target, [r], 4, "cpu")
    summary = chain_summary(records, chains, 4)
    for key in ("first_token_agreement", "alpha_1", "alpha_4", "acceptance_k4"):
        assert summary["overall_tokens"][key] == 1.0
    # 10 answer tokens a record: steps draft 4, 4 and 0 (the last token is the bonus of step 2): 10 / 2
    assert summary["overall_tokens"]["tokens_per_step_k4"] == 5.0
    random_head = chain_summary(records, head_chains(_head(target), target, records, 4, "cpu"), 4)
    assert random_head["overall_tokens"]["acceptance_k4"] < 0.5


def test_chain_metrics_by_hand():
    # n = 5 answer tokens, k = 2. Step at 0: drafts right, right -> 2 accepted, +1 bonus; step at 3:
    # draft wrong -> 0 accepted, +1; step at 4: 1 drafted (end), right -> 1 accepted. 3 / 5 drafted.
    chains = np.array([[1, 1], [0, 1], [1, 0], [0, 1], [1, 0]], dtype=bool)
    assert simulate(chains) == (3, 5, 3)
    m = chain_summary([Record(np.arange(7), 2, "qa", "eval")], [chains], k=2)["qa"]
    assert m["first_token_agreement"] == 0.6
    assert m["alpha_1"] == 0.6
    assert m["alpha_2"] == 0.5  # starts 0, 2 (start 4 has no second draft): 1 of 2
    assert m["acceptance_k2"] == 0.6 and m["tokens_per_step_k2"] == 2.0


def test_baseline_chains_reproduce_evaluate_summarize():
    rng = np.random.default_rng(0)
    records = [Record(np.arange(40 + i), 5, ("a", "b")[i % 2], "eval") for i in range(8)]
    matches = [rng.random(len(r.tokens) - r.prompt_len) < 0.7 for r in records]
    reference = summarize(records, matches, k=4)
    mine = chain_summary(records, baseline_chains(matches, 4), k=4)
    for cat in ("a", "b"):
        assert mine[cat]["acceptance_k4"] == reference[cat]["acceptance_k4"]
        assert mine[cat]["tokens_per_step_k4"] == reference[cat]["tokens_per_step_k4"]
        assert mine[cat]["first_token_agreement"] == reference[cat]["agreement"]


def _config(data, out, **kw) -> HeadTrainConfig:
    defaults = dict(data_dir=str(data), out_dir=str(out), max_steps=6, batch_tokens=256, max_len=64, passes=2,
                    lr=3e-3, warmup_steps=2, log_every=1, eval_every=0, save_every=0, holdout_every=1000,
                    device="cpu", seed=5)
    return HeadTrainConfig(**{**defaults, **kw})


def test_training_lowers_the_loss(data, tmp_path, target):
    HeadTrainer(_config(data, tmp_path, max_steps=40, lr=1e-2), target).train()
    losses = losses_of(tmp_path / "train_log.jsonl")
    assert len(losses) == 40
    assert losses[-5:].mean() < 0.8 * losses[:5].mean()


def test_training_is_deterministic_and_resumes(data, tmp_path, target):
    HeadTrainer(_config(data, tmp_path / "a"), target).train()
    HeadTrainer(_config(data, tmp_path / "b"), target).train()
    assert HeadTrainer(_config(data, tmp_path / "c", stop_at_step=3), target).train()["stopped"]
    resumed = HeadTrainer(_config(data, tmp_path / "c"), target)
    assert resumed.step == 3
    resumed.train()
    a, b, c = (load_file(str(tmp_path / n / "head" / "model.safetensors")) for n in "abc")
    assert all(torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]) for key in a)
    assert np.array_equal(losses_of(tmp_path / "a" / "train_log.jsonl"), losses_of(tmp_path / "b" / "train_log.jsonl"))
    other = HeadTrainer(_config(data, tmp_path / "d", seed=6), target)
    other.train()
    d = load_file(str(tmp_path / "d" / "head" / "model.safetensors"))
    assert not torch.equal(a["fc.weight"], d["fc.weight"])


@torch.no_grad()
def test_checkpoint_roundtrip_holds_only_the_head(target, tmp_path):
    head = _head(target, seed=3)
    save_head(head, tmp_path / "h")
    weights = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert all(key.startswith(("fc.", "layer.")) for key in weights)  # no embedding, norm or lm_head
    assert json.loads((tmp_path / "h" / "config.json").read_text())["target"] == "tiny"
    back = load_head(tmp_path / "h", target).eval()
    features = torch.randn(2, 7, target.config.hidden_size)
    ids = torch.randint(0, 256, (2, 9))
    for x, y in zip(head.unrolled(features, ids, 3), back.unrolled(features, ids, 3)):
        assert torch.equal(x, y)


def test_cli_trains_and_evaluates_a_head(target_dir, data, tmp_path):
    out = tmp_path / "run"
    assert distill_main(["train-head", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                         "--eval", str(data / "eval.npz"), "--max-steps", "3", "--batch-tokens", "256",
                         "--max-len", "64", "--eval-every", "0", "--device", "cpu", "--dtype", "float32"]) == 0
    result = tmp_path / "eval.json"
    assert distill_main(["evaluate-head", "--head", str(out / "head"), "--target", str(target_dir), "--eval",
                         str(data / "eval.npz"), "--draft", str(target_dir), "--combine", "--json-out", str(result),
                         "--device", "cpu"]) == 0
    summary = json.loads(result.read_text())
    assert set(summary) == {"head", "draft", "head+draft", "head+draft+copy"}
    assert 0.0 <= summary["head+draft+copy"]["overall_tokens"]["acceptance_k4"] <= 1.0
    assert summary["draft"]["overall_tokens"]["acceptance_k4"] == 1.0  # the target as its own draft
    assert "alpha_4" in summary["head"]["qa"]


def test_cost_head_times_both_steps(target_dir, capsys):
    assert distill_main(["cost-head", "--target", str(target_dir), "--head-rows", "0", "64", "--repeats", "3",
                         "--context", "20"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("rows_all", "rows_64"):
        assert result[key]["head"]["median_ms"] > 0 and result[key]["target"]["median_ms"] > 0


def test_the_more_confident_drafter_proposes_and_the_copy_rule_fills_in_where_both_are_unsure():
    """specdec.distill.combined on hand-made predictions: prompt 1 2 3 1, answer 2 3 9 9 (the copy
    rule has nothing after 3 1, which never occurred earlier; after 1 2 it guesses 3, after 2 3 it
    guesses 1); k = 2 chained drafts per step."""
    from specdec.distill.combined import combined_chains
    from specdec.distill.evaluate import copy_guesses
    from specdec.proposers.copy_guess import CopyRule

    record = Record(np.array([1, 2, 3, 1, 2, 3, 9, 9]), 4, "qa", "eval")
    copy = CopyRule(below=0.5, ngram=2)
    assert copy_guesses(record, copy).tolist() == [-1, 3, 1, -1]
    # head: [n, k] chained drafts and confidences; draft: teacher-forced [n]
    head = (np.array([[2, 7], [7, 9], [9, 9], [9, 0]]), np.array([[0.9, 0.9], [0.3, 0.3], [0.3, 0.3], [0.3, 0.3]]))
    draft = (np.array([5, 3, 9, 8]), np.array([0.6, 0.4, 0.8, 0.2]))
    [chains] = combined_chains([record], [head], [draft], 2)
    # step at 0: head (0.9) says 2, right; draft 3 for index 1 (0.4) loses to head's 0.9 "7": wrong
    # step at 1: draft 3 (0.4 > 0.3) right; then draft 9 (0.8) right. step at 2: draft 9 right; head 9 (0.3 > 0.2) right
    # step at 3: head 9 (0.3 > 0.2) right; past the end: wrong
    assert chains.tolist() == [[True, False], [True, True], [True, True], [True, False]]
    [copied] = combined_chains([record], [head], [(np.array([5, 8, 9, 8]), np.array([0.1, 0.1, 0.8, 0.2]))], 2, copy)
    # index 1: both unsure (0.3, 0.1), the copy rule's 3 is right; index 3: both unsure, no copy guess: head's 9
    assert copied[1].tolist() == [True, True] and copied[3].tolist() == [True, False]
