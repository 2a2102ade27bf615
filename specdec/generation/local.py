"""The whole system in one process: target engine, draft engine, the loop, a tokenizer.

This is what `specdec generate` runs, and the reference the distributed path must match.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdec.engine.draft import DraftEngine
from specdec.engine.local import LocalDraft, LocalTarget
from specdec.engine.target import TargetEngine
from specdec.generation.loop import generate
from specdec.generation.session import GenerationResult, LoopSettings
from specdec.generation.stopping import FinishReason, StopChecker, trim_at_stop
from specdec.models.loader import load_model
from specdec.models.registry import resolve_model
from specdec.models.tokenizer import (
    StreamDecoder,
    check_compatible,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
)
from specdec.proposers.copy_guess import CopyRule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.sampling.params import SamplingParams


@dataclass(frozen=True)
class LocalSettings:
    target: str = "smollm2-135m-instruct"
    draft: str = "ngram"  # "none", "ngram", a registry name or a local HF directory
    backend: str = "native"
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool | None = None  # None: on for a CUDA device (specdec.models.cuda_graphs)
    num_slots: int = 4
    max_context: int | None = None
    num_draft_tokens: int = 4
    adaptive: bool = True  # adapt the draft length per session (specdec.generation.adaptive)
    pipelining: bool = False  # pipelined cycles (specdec.generation.pipeline); no overlap in one process
    pipeline_branches: int = 1  # branches per speculative draft (specdec.engine.alternatives)
    top_m: int = 64
    copy_below: float = 0.5  # the draft copies from the session's text where this unsure (copy_guess.py)
    draft_head_vocab: int | str | None = "auto"  # reduced draft output head (specdec.models.loader)


@dataclass
class LocalResult:
    text: str
    prompt_ids: list[int]
    generation: GenerationResult
    seconds: float
    first_token_seconds: float
    token_times: list[float] = field(default_factory=list)


def build_proposer(draft: str, settings: LocalSettings, target_tokenizer) -> object | None:
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramProposer()
    draft_dir = resolve_model(draft)
    check_compatible(load_tokenizer(draft_dir), target_tokenizer)
    model = load_model(draft_dir, backend=settings.backend, device=settings.device, dtype=settings.dtype,
                       head_vocab=settings.draft_head_vocab, cuda_graphs=settings.cuda_graphs,
                       num_slots=settings.num_slots, max_context=settings.max_context, fused_decode=True)
    return DraftModelProposer(model, top_m=settings.top_m, copy=CopyRule(settings.copy_below))


class LocalSystem:
    def __init__(self, settings: LocalSettings):
        self.settings = settings
        target_dir = resolve_model(settings.target)
        self.tokenizer = load_tokenizer(target_dir)
        self.eos_token_ids = eos_token_ids(self.tokenizer, target_dir)
        model = load_model(target_dir, backend=settings.backend, device=settings.device,
                           dtype=settings.dtype, num_slots=settings.num_slots, max_context=settings.max_context,
                           cuda_graphs=settings.cuda_graphs)
        self.target_engine = TargetEngine(model)
        proposer = build_proposer(settings.draft, settings, self.tokenizer)
        self.draft_engine = DraftEngine(proposer) if proposer is not None else None

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False) -> list[int]:
        if raw:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return encode_prompt(self.tokenizer, prompt, messages)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_sequences: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        speculate: bool = True,
    ) -> LocalResult:
        decoder = StreamDecoder(self.tokenizer)
        started = time.perf_counter()
        token_times: list[float] = []

        async def emit(tokens: list[int]) -> None:
            now = time.perf_counter()
            token_times.extend([now] * len(tokens))
            text = decoder.push(tokens)
            if on_text and text:
                on_text(text)

        detok = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        stop = StopChecker(max_new_tokens, self.eos_token_ids, stop_sequences, detok)
        session_id = uuid.uuid4().hex
        draft = LocalDraft(self.draft_engine) if (speculate and self.draft_engine) else None
        target = LocalTarget(self.target_engine)
        try:
            result = await generate(target, draft, session_id, prompt_ids, params, stop, emit,
                                    LoopSettings(num_draft_tokens=self.settings.num_draft_tokens,
                                                 adaptive=self.settings.adaptive,
                                                 pipelining=self.settings.pipelining,
                                                 pipeline_branches=self.settings.pipeline_branches))
        finally:
            self.target_engine.end_session(session_id)
            if self.draft_engine is not None:
                self.draft_engine.end_session(session_id)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if result.finish_reason is FinishReason.STOP_SEQUENCE:
            text = trim_at_stop(text, stop_sequences)
        first = token_times[0] - started if token_times else 0.0
        return LocalResult(text, list(prompt_ids), result, time.perf_counter() - started, first,
                           [t - started for t in token_times])
