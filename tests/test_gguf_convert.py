"""GGUF conversion details that do not need the 98 MB checkpoint (tests/test_registry.py converts it)."""

from transformers import AutoTokenizer, LlamaConfig

from specdec.models.gguf_convert import align_special_tokens
from specdec.models.tokenizer import vocab_fingerprint
from specdec.testing.tiny_models import TINY_BOS_ID, TINY_EOS_ID, TINY_PAD_ID, make_tiny_tokenizer


def test_the_configs_eos_and_pad_win_over_a_misread_tokenizer(tmp_path):
    """transformers 5.17 reads SmolLM2's GGUF tokenizer with eos = the bos token and no pad; the
    config from the same file is right, and the fingerprint must not depend on the version."""
    make_tiny_tokenizer(tmp_path, 256)
    right = AutoTokenizer.from_pretrained(tmp_path)
    misread = AutoTokenizer.from_pretrained(tmp_path)
    misread.eos_token = misread.convert_ids_to_tokens(TINY_BOS_ID)
    misread.pad_token = None
    assert vocab_fingerprint(misread) != vocab_fingerprint(right)
    config = LlamaConfig(bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID)
    align_special_tokens(misread, config)
    assert (misread.eos_token_id, misread.pad_token_id) == (TINY_EOS_ID, TINY_PAD_ID)
    assert vocab_fingerprint(misread) == vocab_fingerprint(right)
    align_special_tokens(right, config)  # already right: unchanged
    assert vocab_fingerprint(right) == vocab_fingerprint(misread)
