"""Tiny random-weight Hugging Face models and a byte-level tokenizer for fast, deterministic tests.

`make_tiny_model` builds a model with transformers' own config and model classes and saves it with
save_pretrained, so what the tests load is exactly what a real HF directory looks like. Weights are
redrawn from a seeded generator after construction: transformers' default init is not guaranteed stable
across releases, and it zeroes biases and sets norm weights to one, which would let a backend that
ignores them pass. The draw is scaled so attention is far from uniform (a wrong mask shows up).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VARIANTS = ("llama", "llama3", "qwen2", "mistral", "smollm")

# The tiny tokenizer: byte b has id b for every byte that can occur in UTF-8 (0x00-0xF4), then specials.
NUM_BYTE_TOKENS = 0xF5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
TINY_TOKENIZER_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
TINY_BOS_ID = NUM_BYTE_TOKENS + 1  # <|im_start|>
TINY_EOS_ID = NUM_BYTE_TOKENS + 2  # <|im_end|>
TINY_PAD_ID = NUM_BYTE_TOKENS  # <|endoftext|>
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_model(
    directory: str | Path,
    variant: str = "llama",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    tokenizer: bool = True,
    shard_size: str | None = None,
    **config_overrides,
) -> Path:
    """Save a random-weight model of `variant` to `directory` (fp32 safetensors) and return the path.

    tie_word_embeddings None takes the variant's usual choice (tied for smollm, untied otherwise).
    tokenizer=True also saves make_tiny_tokenizer's tokenizer there when vocab_size leaves room for it.
    shard_size (e.g. "100KB") writes a sharded checkpoint with an index. config_overrides go to the
    config class as they are (e.g. sliding_window=16).
    """
    directory = Path(directory)
    config = _config(variant, vocab_size, hidden_size, num_layers, tie_word_embeddings, config_overrides)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if tokenizer and vocab_size >= TINY_TOKENIZER_SIZE:
        make_tiny_tokenizer(directory, vocab_size)
    return directory


def _config(variant, vocab_size, hidden_size, num_layers, tie, overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    head_dim = 16
    heads = max(hidden_size // head_dim, 2)
    specials = (
        dict(bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID)
        if vocab_size >= TINY_TOKENIZER_SIZE else {}
    )
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size + 16,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
        head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=bool(tie) if tie is not None else variant == "smollm", **specials,
    )
    if variant == "llama":
        common.update(rope_theta=10_000.0)
    elif variant == "llama3":
        # original_max_position_embeddings small enough that the scaling changes frequencies the
        # tests' short sequences actually use.
        common.update(rope_theta=500_000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    elif variant == "smollm":
        common.update(rope_theta=100_000.0, num_key_value_heads=1)
    elif variant == "mistral":
        common.update(rope_theta=1_000_000.0, sliding_window=4096)  # >= max context: never applies
    elif variant == "qwen2":
        common.update(rope_theta=1_000_000.0, use_sliding_window=False, sliding_window=4096)
    common.update(overrides)
    cls = {"mistral": MistralConfig, "qwen2": Qwen2Config}.get(variant, LlamaConfig)
    return cls(**common)


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * noise)  # not all ones: a backend that skips the weight must fail
        elif name.endswith(".bias"):
            param.copy_(0.5 * noise)  # HF inits biases to zero; random ones catch a dropped bias
        elif "embed_tokens" in name or "lm_head" in name:
            param.copy_(noise)
        else:
            param.copy_(noise * 1.5 / param.shape[-1] ** 0.5)  # enough gain for peaked attention


def make_tiny_tokenizer(directory: str | Path, vocab_size: int = 256) -> Path:
    """Save a byte-level tokenizer (ids 0..244 = bytes, then specials) loadable by AutoTokenizer.

    Every string encodes (all bytes UTF-8 can produce have a token) and the vocabulary is
    TINY_TOKENIZER_SIZE (249), so it fits a model with vocab_size >= 249. eos is <|im_end|>; the chat
    template is ChatML, as SmolLM2 and Qwen2 use.
    """
    if vocab_size < TINY_TOKENIZER_SIZE:
        raise ValueError(f"the tiny tokenizer needs vocab_size >= {TINY_TOKENIZER_SIZE}, got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(NUM_BYTE_TOKENS)}
    vocab.update({tok: NUM_BYTE_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE,
    )
    directory = Path(directory)
    fast.save_pretrained(directory)
    return directory


def _byte_alphabet() -> list[str]:
    # GPT-2's byte-to-printable-character map, which the ByteLevel pre-tokenizer and decoder use.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
