"""The peers: Hugging Face `generate` in this process, transformers eager, fp32, greedy.

hf-greedy is the peers' own baseline; hf-assisted passes the same draft as `assistant_model` (with
transformers' default assistant settings, recorded in the report); hf-pld passes
`prompt_lookup_num_tokens`. Acceptance is counted by wrapping the candidate generators for the
duration of a call: how many tokens each cycle proposed and how many of them the target matched.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import torch

from specdec.bench.methods import RequestResult
from specdec.bench.prompts import Prompt


class _FirstTokenClock:
    """A generate() streamer that notes when the first generated token arrives (the first put()
    carries the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_at is None:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


@contextlib.contextmanager
def count_candidates(stats: dict) -> Iterator[None]:
    """Count drafted and accepted tokens per cycle of HF assisted / prompt-lookup decoding."""
    from transformers.generation import candidate_generator as cg

    patched = []

    def wrap_get(cls):
        original = cls.__dict__["get_candidates"]

        def get_candidates(self, input_ids, *args, **kwargs):
            if "assistant_settings" not in stats and hasattr(self, "assistant_generation_config"):
                cfg = self.assistant_generation_config  # what transformers really drafts with
                stats["assistant_settings"] = {
                    "num_assistant_tokens": getattr(self, "num_assistant_tokens", None),
                    "num_assistant_tokens_schedule": getattr(cfg, "num_assistant_tokens_schedule", None),
                    "assistant_confidence_threshold": getattr(cfg, "assistant_confidence_threshold", None)}
            candidate_ids, logits = original(self, input_ids, *args, **kwargs)
            stats["_last_drafted"] = int(candidate_ids.shape[-1] - input_ids.shape[-1])
            return candidate_ids, logits
        return original, get_candidates

    def wrap_update(cls):
        original = cls.__dict__["update_candidate_strategy"]

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            drafted = stats.pop("_last_drafted", 0)
            accepted = min(int(num_matches), drafted)
            stats["cycles"] += 1
            stats["drafted"] += drafted
            stats["accepted"] += accepted
            stats["recovered"] += int(accepted < drafted)  # a rejection ended the cycle
            stats["bonus"] += int(0 < drafted == accepted)
            grow = drafted - len(stats["drafted_by_position"])
            stats["drafted_by_position"] += [0] * max(0, grow)
            stats["accepted_by_position"] += [0] * max(0, grow)
            for i in range(drafted):
                stats["drafted_by_position"][i] += 1
                stats["accepted_by_position"][i] += int(i < accepted)
            return original(self, input_ids, scores, num_matches)
        return original, update_candidate_strategy

    stats.update(cycles=0, drafted=0, accepted=0, recovered=0, bonus=0, drafted_by_position=[],
                 accepted_by_position=[])
    for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):
        original, wrapped = wrap_get(cls)
        patched.append((cls, "get_candidates", original))
        setattr(cls, "get_candidates", wrapped)
    for cls in (cg.CandidateGenerator, cg.AssistedCandidateGenerator):
        original, wrapped = wrap_update(cls)
        patched.append((cls, "update_candidate_strategy", original))
        setattr(cls, "update_candidate_strategy", wrapped)
    try:
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)
        stats.pop("_last_drafted", None)


class HFPeers:
    def __init__(self, target_dir: Path, draft_dir: Path | None, eos_token_ids, pld_tokens: int,
                 device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        # Target and draft on one device: assisted generation runs both in this process.
        self.device, self.dtype = device, dtype
        load = lambda d: AutoModelForCausalLM.from_pretrained(  # noqa: E731
            str(d), dtype=getattr(torch, dtype), attn_implementation="eager").to(device).eval()
        self.target = load(target_dir)
        self.draft = load(draft_dir) if draft_dir is not None else None
        self.eos_token_ids = sorted(eos_token_ids)
        self.pld_tokens = pld_tokens
        pad = self.target.generation_config.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]

    def settings(self) -> dict:
        """What the peers ran with, for the report."""
        out = {"attn_implementation": "eager", "dtype": self.dtype, "device": self.device,
               "prompt_lookup_num_tokens": self.pld_tokens}
        if self.draft is not None:
            out["assistant"] = "transformers' defaults; what it used is in each hf-assisted request's " \
                               "stats.assistant_settings"
        return out

    def method(self, name: str) -> "HFMethod":
        return HFMethod(name, self)


class HFMethod:
    def __init__(self, name: str, peers: HFPeers):
        if name == "hf-assisted" and peers.draft is None:
            raise ValueError("hf-assisted needs a draft model")
        self.name, self.peers = name, peers

    async def run(self, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int) -> RequestResult:
        peers = self.peers
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=peers.device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                      eos_token_id=peers.eos_token_ids, pad_token_id=peers.pad_token_id,
                      attention_mask=torch.ones_like(input_ids))
        if self.name == "hf-assisted":
            kwargs["assistant_model"] = peers.draft
        elif self.name == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = peers.pld_tokens
        clock = _FirstTokenClock()
        stats: dict = {}
        counting = count_candidates(stats) if self.name != "hf-greedy" else contextlib.nullcontext()
        started = time.perf_counter()
        with torch.inference_mode(), counting:
            output = peers.target.generate(input_ids, streamer=clock, **kwargs)
        ended = time.perf_counter()
        tokens = output[0, len(prompt_ids):].tolist()
        if tokens and tokens[-1] in peers.eos_token_ids:
            reason = "eos"
        else:
            reason = "length"
        if "cycles" in stats:
            stats["mean_accepted_length"] = ((stats["accepted"] + stats["cycles"]) / stats["cycles"]
                                             if stats["cycles"] else 0.0)
        return RequestResult(self.name, prompt.question_id, prompt.category, tokens, len(prompt_ids),
                             (clock.first_at or ended) - started, ended - started, started, reason, stats)

    async def close(self) -> None:
        pass
