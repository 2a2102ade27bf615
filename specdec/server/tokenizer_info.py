"""The tokenizer facts a model service reports in GetInfo, so the coordinator can check that a draft
and a target share a vocabulary and knows their end-of-sequence ids.

Light at import (the tokenizer code loads on first use), so a service's main module can import it
and still build its parser for `--help` quickly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class TokenizerFacts:
    """What GetInfo reports about a model's tokenizer; empty when there is none."""

    vocab_fingerprint: str = ""
    eos_token_ids: tuple[int, ...] = ()


def tokenizer_facts(directory: Path | None) -> TokenizerFacts:
    """Vocab fingerprint and eos ids of the tokenizer in `directory`; empty when it has none."""
    if directory is None or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        log.warning("no tokenizer in %s: GetInfo reports an empty vocab fingerprint", directory)
        return TokenizerFacts()
    from specdec.models.tokenizer import eos_token_ids, load_tokenizer, vocab_fingerprint

    tokenizer = load_tokenizer(directory)
    return TokenizerFacts(vocab_fingerprint(tokenizer), tuple(sorted(eos_token_ids(tokenizer, directory))))
