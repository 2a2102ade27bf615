"""The target's tokenizer on the coordinator: a turn's input -> token ids, token ids -> text.

The coordinator loads only the tokenizer of the target model (--tokenizer), never its weights:
it renders prompts and chat turns, detokenizes the stream, and checks stop sequences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from specdec.models.tokenizer import (
    StreamDecoder,
    encode_continuation,
    encode_prompt,
    eos_token_ids,
    has_chat_template,
    load_tokenizer,
    vocab_fingerprint,
)

from coordinator.requests import GenerateRequest


class PromptEncoder:
    def __init__(self, tokenizer, eos_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_ids)
        self.vocab_fingerprint = vocab_fingerprint(tokenizer)

    @staticmethod
    def load(name_or_dir: str) -> "PromptEncoder":
        """A tokenizer directory (or model directory), or a registry name / hub id of the target."""
        path = Path(name_or_dir).expanduser()
        if not path.is_dir():
            from specdec.models.registry import resolve_model

            path = resolve_model(name_or_dir)
        tokenizer = load_tokenizer(path)
        return PromptEncoder(tokenizer, eos_token_ids(tokenizer, path))

    def first_turn(self, request: GenerateRequest) -> tuple[list[int], list[dict] | None]:
        """Token ids of a new session's input, and the chat so far (None for a raw session)."""
        if request.prompt is not None and (request.raw or not has_chat_template(self.tokenizer)):
            return encode_prompt(self.tokenizer, prompt=request.prompt, plain_text=True), None
        messages = self._new_messages(request)
        return encode_prompt(self.tokenizer, messages=messages), messages

    def next_turn(
        self,
        request: GenerateRequest,
        history: list[dict] | None,
        assistant_ids: Sequence[int],
        ended_with_eos: bool,
    ) -> tuple[list[int], list[dict] | None]:
        """Tokens to append after the previous turn's output (no re-prefill), and the chat so far.

        The previous assistant message is the text of its generated tokens; the chat template
        writes what follows it (end of turn if it did not end on EOS, the new messages, the
        generation prompt)."""
        if request.prompt is not None and (request.raw or not has_chat_template(self.tokenizer)):
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
            return ids, None  # raw text leaves the chat: later chat turns start a fresh template
        new = self._new_messages(request)
        if history is None:
            return encode_prompt(self.tokenizer, messages=new), new
        previous = [*history, {"role": "assistant", "content": self.detokenize(assistant_ids)}]
        ids = encode_continuation(self.tokenizer, previous, new, ended_with_eos=ended_with_eos)
        return ids, previous + new

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.tokenizer)

    @staticmethod
    def _new_messages(request: GenerateRequest) -> list[dict]:
        if request.messages is not None:
            return [dict(m) for m in request.messages]
        return [{"role": "user", "content": request.prompt}]
