"""A benchmark report on disk: JSON, gzip-compressed where the name ends in .gz.

A report keeps every request's tokens and text (lossless checks, re-scoring), about 0.4 MB of JSON for
a CPU run and up to 2 MB for a GPU run at load; gzip takes it to a thirteenth. The reports kept in
docs/bench are compressed (`*.json.gz`): uncompressed they had grown to 196 MB of the repository's
234 MB working tree, past what travels to a GPU machine in one call (64 MiB).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def is_compressed(path: Path) -> bool:
    return path.suffix == ".gz"


def read_report(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if is_compressed(path) else data)


def write_report(path: Path, report: dict) -> None:
    text = (json.dumps(report, indent=1) + "\n").encode()
    # mtime=0: the same report gives the same bytes (no timestamp in the gzip header).
    path.write_bytes(gzip.compress(text, compresslevel=9, mtime=0) if is_compressed(path) else text)


def plot_path(report_path: Path) -> Path:
    """The report's default plot: its name with .png for .json / .json.gz."""
    stem = report_path.with_suffix("") if is_compressed(report_path) else report_path
    return stem.with_suffix(".png")
