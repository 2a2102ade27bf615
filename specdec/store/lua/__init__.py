"""Lua sources of the store's scripts. They are package data: load them by name, never by path."""

from importlib import resources


def load(*names: str) -> str:
    """The named scripts concatenated, in order (a shared prelude first, then the script)."""
    here = resources.files(__name__)
    return "\n".join(here.joinpath(name).read_text() for name in names)
