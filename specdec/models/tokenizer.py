"""Tokenizer helpers: prompts through the chat template, multi-turn appends, end-of-sequence ids,
draft/target compatibility, and incremental detokenization for streaming.

Draft and target exchange token ids, never text, so what must agree between them is the id -> token
map and the special tokens (`check_compatible`); the target's tokenizer alone turns prompts into ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specdec.errors import IncompatibleModels, InvalidArgument

# End-of-turn markers of common chat templates. A template that writes one of them ends every turn
# with it, so generation must stop there even where the config names another eos (a GGUF converted
# with eos = <|endoftext|> but an <|im_end|> template, say).
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


class NotAppendable(InvalidArgument):
    """The chat template renders the longer conversation with a different prefix (some templates drop
    earlier reasoning or move the system prompt), so the new turn cannot be appended: re-prefill with
    encode_prompt() of the whole conversation instead."""


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    add_generation_prompt: bool = True,
    plain_text: bool = False,
) -> list[int]:
    """Token ids of a prompt (one user message) or a conversation, through the chat template if any.

    plain_text=True (or a tokenizer without a template) encodes `prompt` as it is, with the tokenizer's
    own special tokens (BOS where the tokenizer adds one); `messages` always need a template.
    """
    if (prompt is None) == (messages is None):
        raise InvalidArgument("give exactly one of prompt (text) or messages (a chat), not both or neither")
    if plain_text or not has_chat_template(tokenizer):
        if messages is not None:
            raise InvalidArgument("messages need a chat template; this tokenizer has none, send a prompt")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    return _encode_text(tokenizer, _render(tokenizer, messages, add_generation_prompt))


def encode_continuation(
    tokenizer: PreTrainedTokenizerBase,
    previous_messages: list[dict],
    new_messages: list[dict],
    add_generation_prompt: bool = True,
    ended_with_eos: bool = True,
) -> list[int]:
    """The tokens to append for new_messages after a finished assistant turn: never a re-prefill.

    previous_messages must end with the assistant message just generated. The session then holds the
    prompt, the generated tokens and, if generation stopped on it (ended_with_eos), the end-of-turn
    token. The result is whatever the template writes after that point: for SmolLM2
    "\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n".

    Equality with a fresh encoding of the whole conversation holds token for token where the generated
    tokens are the canonical tokenization of their text (tests/test_tokenizer.py checks SmolLM2's
    template); where the model generated a non-canonical split, the session keeps the tokens it actually
    generated, which is what the model saw. Raises NotAppendable when the template does not render the
    longer conversation as an extension of the shorter one.
    """
    if not previous_messages or previous_messages[-1].get("role") != "assistant":
        raise InvalidArgument("previous_messages must end with the assistant turn that was just generated")
    if not has_chat_template(tokenizer):
        raise InvalidArgument("multi-turn appends need a chat template; this tokenizer has none")
    previous = _render(tokenizer, previous_messages, add_generation_prompt=False)
    full = _render(tokenizer, previous_messages + new_messages, add_generation_prompt)
    if not full.startswith(previous):
        raise NotAppendable(
            "the chat template renders the earlier turns differently once new messages follow; "
            "re-prefill the whole conversation"
        )
    cut = _end_of_generated_text(tokenizer, previous_messages, previous)
    if ended_with_eos:  # the end-of-turn token is in the session already
        marker = next((m for m in (tokenizer.eos_token, *_END_OF_TURN_MARKERS)
                       if m and previous.startswith(m, cut)), "")
        cut += len(marker)
    return _encode_text(tokenizer, full[cut:])


def _end_of_generated_text(tokenizer, previous_messages: list[dict], previous: str) -> int:
    """Where, in the rendered previous conversation, the generated assistant text ends."""
    prompt = _render(tokenizer, previous_messages[:-1], add_generation_prompt=True)
    content = previous_messages[-1]["content"]
    if previous.startswith(prompt):
        rest = previous[len(prompt):]
        for written in (content, content.strip()):  # some templates trim the content
            if rest.startswith(written):
                return len(prompt) + len(written)
    raise NotAppendable(
        "the chat template does not write the assistant turn as generation prompt + generated text; "
        "re-prefill the whole conversation"
    )


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> set[int]:
    """Every id that ends generation: generation_config.json and config.json eos ids, the tokenizer's
    eos, and the end-of-turn marker the chat template writes (SmolLM2: <|im_end|>, id 2)."""
    ids: set[int] = set()
    if model_dir is not None:
        for name in ("generation_config.json", "config.json"):
            ids |= _ids_from_json(Path(model_dir) / name, "eos_token_id")
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    ids |= {vocab[marker] for marker in _END_OF_TURN_MARKERS if marker in template and marker in vocab}
    return ids


def _ids_from_json(path: Path, key: str) -> set[int]:
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return set()
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the sorted id -> token map and the special tokens: equal fingerprints, same ids."""
    payload = {"vocab": sorted((i, t) for t, i in tokenizer.get_vocab().items()),
               "special": _special_tokens(tokenizer)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def check_compatible(
    draft_tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Raise IncompatibleModels naming what differs, unless both map every id to the same token."""
    if vocab_fingerprint(draft_tokenizer) == vocab_fingerprint(target_tokenizer):
        return
    problems = []
    draft_vocab = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    target_vocab = {i: t for t, i in target_tokenizer.get_vocab().items()}
    if len(draft_vocab) != len(target_vocab):
        problems.append(f"vocab size: draft {len(draft_vocab)}, target {len(target_vocab)}")
    first = next((i for i in sorted(set(draft_vocab) | set(target_vocab))
                  if draft_vocab.get(i) != target_vocab.get(i)), None)
    if first is not None:
        problems.append(f"first differing token: id {first} is {draft_vocab.get(first, '(absent)')!r} "
                        f"in the draft, {target_vocab.get(first, '(absent)')!r} in the target")
    draft_special, target_special = _special_tokens(draft_tokenizer), _special_tokens(target_tokenizer)
    for key in sorted(set(draft_special) | set(target_special)):
        if draft_special.get(key) != target_special.get(key):
            problems.append(f"special token {key}: draft {draft_special.get(key)!r}, "
                            f"target {target_special.get(key)!r}")
    raise IncompatibleModels(
        "draft and target tokenizers differ (they must map every token id to the same token): "
        + "; ".join(problems)
    )


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    special: dict[str, object] = {}
    for role in ("bos", "eos", "unk", "pad"):
        token = getattr(tokenizer, f"{role}_token", None)
        special[role] = None if token is None else [str(token), getattr(tokenizer, f"{role}_token_id")]
    special["all"] = sorted(str(t) for t in tokenizer.all_special_tokens)
    return special


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> str:
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise InvalidArgument(f"a chat message is a dict with string 'role' and 'content', got {message!r}")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as exc:  # raise_exception() in the template: roles, order, content rules
        raise InvalidArgument(f"the target's chat template refused these messages: {exc}") from exc


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The rendered template already holds every special token it wants (a BOS, say): add none.
    return tokenizer.encode(text, add_special_tokens=False)


class StreamDecoder:
    """Incremental detokenizer: push() token ids as they are accepted, get the newly completed text.

    Decoding each token alone breaks characters whose UTF-8 bytes span tokens, and tokenizers that
    drop a leading space at the start of a sequence. So it decodes a short window that begins one
    complete push back (prefix_offset) and returns what the window adds beyond the text already
    returned. A window ending in an incomplete character (decoded as U+FFFD) returns the text before
    it and keeps the character until a later push completes it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # text of ids up to here is fully returned
        self._partial = 0  # characters returned beyond read_offset's text (before an incomplete one)

    def push(self, token_ids: list[int] | int) -> str:
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        done = len(self._decode(self._prefix_offset, self._read_offset)) + self._partial
        window = self._decode(self._prefix_offset, len(self._ids))
        complete = window.rstrip("\ufffd")
        new = complete[done:]
        if complete == window and new:
            self._prefix_offset, self._read_offset, self._partial = self._read_offset, len(self._ids), 0
        else:
            self._partial += len(new)
        return new

    def flush(self) -> str:
        """Whatever text is held back (an incomplete character decodes as U+FFFD); call at the end."""
        done = len(self._decode(self._prefix_offset, self._read_offset)) + self._partial
        window = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        self._partial = 0
        return window[done:]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
