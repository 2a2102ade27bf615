"""Tokenizer helpers on the default target's real tokenizer (SmolLM2, ChatML template)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from specdec.errors import IncompatibleModels, InvalidArgument
from specdec.models.tokenizer import (
    NotAppendable,
    StreamDecoder,
    check_compatible,
    encode_continuation,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
    vocab_fingerprint,
)


@pytest.fixture(scope="module")
def tokenizer(default_target_dir):
    return load_tokenizer(default_target_dir)


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_template_survives_conversion(tokenizer):
    assert "<|im_start|>" in tokenizer.chat_template
    ids = encode_prompt(tokenizer, "What is 2+2?")
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == encode_prompt(tokenizer, messages=[{"role": "user", "content": "What is 2+2?"}])


def test_plain_text_mode_skips_the_template(tokenizer):
    assert encode_prompt(tokenizer, "Once upon a time", plain_text=True) == _encode(tokenizer, "Once upon a time")


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}])
def test_exactly_one_of_prompt_and_messages(tokenizer, kwargs):
    with pytest.raises(InvalidArgument, match="exactly one"):
        encode_prompt(tokenizer, **kwargs)


def test_malformed_message_is_refused(tokenizer):
    with pytest.raises(InvalidArgument, match="'role' and 'content'"):
        encode_prompt(tokenizer, messages=[{"role": "user"}])


def test_messages_the_template_refuses_are_invalid_arguments(default_target_dir):
    tokenizer = load_tokenizer(default_target_dir)
    tokenizer.chat_template = (  # as Llama-2 / Mistral templates do for conversations out of order
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(InvalidArgument, match="chat template refused these messages: Unknown role: wizard"):
        encode_prompt(tokenizer, messages=[{"role": "wizard", "content": "hi"}])


def test_eos_ids_contain_im_end(tokenizer, default_target_dir):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in eos_token_ids(tokenizer, default_target_dir)
    assert im_end in eos_token_ids(tokenizer)


CONVERSATIONS = [
    (
        [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
        [{"role": "user", "content": "Tell me about Kyoto 日本."}],
    ),
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": " 4\n\n🤖"}],
        [{"role": "user", "content": "\nand 3+3?"}],
    ),
    (
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
        [{"role": "system", "content": "new rules"}, {"role": "user", "content": "b"}],
    ),
]


@pytest.mark.parametrize("previous, new", CONVERSATIONS)
def test_continuation_appends_exactly_the_new_turn(tokenizer, previous, new):
    """Session tokens (prompt, generated text, <|im_end|>) + continuation == whole conversation."""
    prompt = encode_prompt(tokenizer, messages=previous[:-1])
    generated = _encode(tokenizer, previous[-1]["content"]) + [tokenizer.eos_token_id]
    appended = encode_continuation(tokenizer, previous, new)
    assert prompt + generated + appended == encode_prompt(tokenizer, messages=previous + new)
    assert tokenizer.decode(appended).startswith("\n<|im_start|>")


def test_continuation_after_a_turn_cut_short(tokenizer):
    previous, new = CONVERSATIONS[0]
    session = encode_prompt(tokenizer, messages=previous[:-1]) + _encode(tokenizer, previous[-1]["content"])
    appended = encode_continuation(tokenizer, previous, new, ended_with_eos=False)
    assert appended[0] == tokenizer.eos_token_id  # the turn is closed first
    assert session + appended == encode_prompt(tokenizer, messages=previous + new)


def test_multi_turn_session_never_reprefills(tokenizer):
    conversation = [{"role": "user", "content": "First question?"}]
    session = encode_prompt(tokenizer, messages=conversation)
    for turn, (answer, question) in enumerate([("One.", "Second?"), ("Two ✓.", "Third?"), ("Three.", "Done.")]):
        conversation.append({"role": "assistant", "content": answer})
        session += _encode(tokenizer, answer) + [tokenizer.eos_token_id]
        appended = encode_continuation(tokenizer, conversation, [{"role": "user", "content": question}])
        conversation.append({"role": "user", "content": question})
        session += appended
        assert session == encode_prompt(tokenizer, messages=conversation), f"turn {turn}"


def test_continuation_refuses_a_template_that_rewrites_history(default_target_dir):
    tokenizer = load_tokenizer(default_target_dir)
    tokenizer.chat_template = (  # shows only the last two messages, like templates that drop old reasoning
        "{% for m in messages[-2:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    previous, new = CONVERSATIONS[0]
    with pytest.raises(NotAppendable, match="re-prefill"):
        encode_continuation(tokenizer, previous, new)


def test_continuation_needs_a_finished_assistant_turn(tokenizer):
    with pytest.raises(InvalidArgument, match="must end with the assistant turn"):
        encode_continuation(tokenizer, [{"role": "user", "content": "hi"}], [{"role": "user", "content": "?"}])


TEXT = "Héllo wörld! 🤖 日本語のテキスト, naïve café ✓ 🇯🇵 end"


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_decoder_round_trips_multibyte_text(tokenizer, chunk):
    ids = _encode(tokenizer, TEXT)
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    if chunk == 1:
        assert "" in pieces  # some character was split across tokens and held back


def test_stream_decoder_flushes_an_incomplete_character(tokenizer):
    ids = _encode(tokenizer, "a🤖")
    decoder = StreamDecoder(tokenizer)
    assert decoder.push(ids[:-1]) == "a"
    assert decoder.flush().endswith("\ufffd")


def test_stream_decoder_skips_special_tokens(tokenizer):
    decoder = StreamDecoder(tokenizer)
    assert decoder.push(_encode(tokenizer, "Done.") + [tokenizer.eos_token_id]) + decoder.flush() == "Done."


def _word_level_tokenizer(words, eos="</s>"):
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0], eos_token=eos)


def test_fingerprint_is_stable_and_sensitive(default_target_dir, tokenizer):
    assert vocab_fingerprint(load_tokenizer(default_target_dir)) == vocab_fingerprint(tokenizer)
    a = _word_level_tokenizer(["<unk>", "</s>", "hello", "world"])
    b = _word_level_tokenizer(["<unk>", "</s>", "world", "hello"])
    assert vocab_fingerprint(a) != vocab_fingerprint(b)


def test_check_compatible_accepts_the_same_tokenizer(default_target_dir, tokenizer):
    check_compatible(load_tokenizer(default_target_dir), tokenizer)


def test_check_compatible_refuses_a_mismatched_pair(tokenizer):
    draft = _word_level_tokenizer(["<unk>", "</s>", "hello", "world"])
    with pytest.raises(IncompatibleModels) as excinfo:
        check_compatible(draft, tokenizer)
    message = str(excinfo.value)
    assert "vocab size: draft 4, target 49152" in message
    assert "first differing token: id 0 is '<unk>' in the draft, '<|endoftext|>' in the target" in message
    assert "special token eos" in message


def test_check_compatible_names_a_special_token_difference(default_target_dir, tokenizer):
    draft = load_tokenizer(default_target_dir)
    draft.eos_token = "<|endoftext|>"
    with pytest.raises(IncompatibleModels, match="special token eos: draft \\['<\\|endoftext\\|>', 0\\]") as excinfo:
        check_compatible(draft, tokenizer)
    assert "vocab size" not in str(excinfo.value)
