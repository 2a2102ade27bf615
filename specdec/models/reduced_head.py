"""A draft's reduced output head: which rows it keeps, and the flag that chooses it.

A draft checkpoint may list its vocabulary most frequent first (head_vocab.json); a head of its first
N rows scores N tokens instead of the whole vocabulary, which on a CPU is most of a small draft's
step. The draft proposer adds the session's own context tokens outside those rows
(specdec.proposers.draft_model), and samples from, and sends, exactly the distribution it scored, so
verification stays lossless. Light module: no torch at import (flags parse before models load).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.errors import InvalidArgument

LISTING = "head_vocab.json"


def parse_head_vocab(text: str) -> int | str | None:
    """A --head-vocab flag: "auto" (the checkpoint's recommendation), "full" or 0, or N rows."""
    if text in ("auto", "full"):
        return None if text == "full" else text
    try:
        rows = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto', 'full' or a number of rows, got {text!r}") from None
    if rows < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto', 'full' or a number of rows >= 0, got {rows}")
    return rows or None


def recommended_head_vocab(path: Path) -> int | None:
    """The head size a draft checkpoint recommends (head_vocab.json "recommended"), or None."""
    listing = Path(path) / LISTING
    return json.loads(listing.read_text()).get("recommended") if listing.is_file() else None


def reduced_head(path: Path, head_vocab: int | None):
    """The first head_vocab token ids of path/head_vocab.json (most frequent first), or None."""
    if not head_vocab:
        return None
    import torch

    listing = Path(path) / LISTING
    if not listing.is_file():
        raise InvalidArgument(f"{path} has no head_vocab.json: a reduced head needs its token list")
    token_ids = json.loads(listing.read_text())["token_ids"]
    if not 0 < head_vocab <= len(token_ids):
        raise InvalidArgument(f"head_vocab must be in [1, {len(token_ids)}] for {path}, got {head_vocab}")
    return torch.tensor(token_ids[:head_vocab], dtype=torch.long)
