"""How well the draft's confidence predicts that the target agrees with its token.

    python scripts/draft_confidence_calibration.py [--per-category 2] [--max-new-tokens 96]

The target answers the first turn of `--per-category` Spec-Bench dev prompts of each category greedily
(transformers, float32); the draft then reads each answer teacher-forced, and at every answer position
its confidence (its probability of its own greedy token, full vocabulary) is set against whether that
token is the target's. Printed: the share of tokens and the agreement per confidence bin, and above
each threshold. Agreement at a position is the chance that a first drafted token there is accepted
(docs/BENCHMARKS.md, round 33).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.models.registry import resolve_model

BINS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="smollm2-135m-draft")
    parser.add_argument("--prompts", type=Path, default=Path("../shared/data/specbench/dev.jsonl"))
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = resolve_model(args.target), resolve_model(args.draft)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    by_category: dict[str, list[dict]] = defaultdict(list)
    for line in args.prompts.read_text().splitlines():
        record = json.loads(line)
        by_category[record.get("category", "")].append(record)
    confidences, agreed = [], []
    for records in by_category.values():
        for record in records[: args.per_category]:
            messages = [{"role": "user", "content": record["turns"][0]}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]
            with torch.no_grad():
                answer = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
                start = prompt.shape[1]
                probs = draft(answer).logits[0, start - 1:-1].float().softmax(-1)
            confidence, token = probs.max(-1)
            confidences += confidence.tolist()
            agreed += (token == answer[0, start:]).tolist()
    confidence, agreed = torch.tensor(confidences), torch.tensor(agreed, dtype=torch.float)
    print(f"{len(confidence)} answer tokens, {len(by_category)} categories; agreement {agreed.mean():.3f}")
    for low, high in zip(BINS, BINS[1:]):
        inside = (confidence >= low) & (confidence < high)
        rate = f"{agreed[inside].mean():.3f}" if inside.any() else "-"
        print(f"confidence [{low:.2f}, {min(high, 1.0):.2f}): share {inside.float().mean():.3f}, agreement {rate}")
    for low in (0.5, 0.6, 0.7, 0.8, 0.9):
        above = confidence >= low
        print(f"confidence >= {low}: share {above.float().mean():.3f}, agreement {agreed[above].mean():.3f}")


if __name__ == "__main__":
    main()
