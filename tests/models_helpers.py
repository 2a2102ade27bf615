"""Shared by the model backend tests: tiny model directories, transformers reference logits, error metric."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from specdec.testing.tiny_models import make_tiny_model

# (name, make_tiny_model arguments): every native variant, tied and untied embeddings.
TINY_CASES = {
    "llama": dict(variant="llama"),
    "llama-tied": dict(variant="llama", tie_word_embeddings=True),
    "llama3": dict(variant="llama3"),
    "qwen2": dict(variant="qwen2"),
    "qwen2-tied": dict(variant="qwen2", tie_word_embeddings=True),
    "mistral": dict(variant="mistral"),
    "smollm": dict(variant="smollm"),
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: scale-free, and one bad logit is enough to fail."""
    return ((got - want).abs().max() / want.abs().max()).item()


def tiny_dir(root: Path, case: str, **extra) -> Path:
    """The directory of a tiny model (built once per root, case and arguments)."""
    key = (str(root), case, repr(sorted(extra.items())))
    if key not in _BUILT:
        _BUILT[key] = make_tiny_model(Path(root) / f"{case}-{len(_BUILT)}", **TINY_CASES[case], **extra)
    return _BUILT[key]


_BUILT: dict[tuple, Path] = {}


@lru_cache(maxsize=None)
def reference_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def reference_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one sequence: [len(tokens), vocab]."""
    return reference_model(path)(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, vocab: int = 256, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
