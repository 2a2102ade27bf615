"""numba's disk cache for the CPU loops: one directory per version of the loops' sources.

numba keys a cached build on its own file alone, while cpu_decode's draft step inlines cpu_attention's
loop: with one shared directory a change to cpu_attention.py alone left the old attention inside the
cached draft step (the file it is keyed on had not changed)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from specdec.models import cpu_attention

pytest.importorskip("numba")


def test_the_default_directory_changes_with_every_kernel_source(monkeypatch, tmp_path):
    base = cpu_attention.default_cache_dir(str(tmp_path))
    assert base == cpu_attention.default_cache_dir(str(tmp_path))  # stable while nothing changes
    assert os.path.dirname(base) == str(tmp_path)
    read = pathlib.Path.read_bytes
    for name in cpu_attention.KERNEL_SOURCES:
        edited = lambda path, name=name: read(path) + (b"\n# edited\n" if path.name == name else b"")  # noqa: E731
        monkeypatch.setattr(pathlib.Path, "read_bytes", edited)
        assert cpu_attention.default_cache_dir(str(tmp_path)) != base, name
    monkeypatch.setattr(pathlib.Path, "read_bytes", read)
    assert cpu_attention.default_cache_dir(str(tmp_path)) == base


COMPILE = """
import os, sys
from specdec.models import cpu_attention
assert cpu_attention._kernel() is not None
print(os.environ["NUMBA_CACHE_DIR"])
print(cpu_attention.default_cache_dir())
"""


def _compile_in_fresh_process(env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_fresh_process_caches_its_builds_in_the_versioned_directory(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    env["HOME"] = str(tmp_path)
    used, versioned = _compile_in_fresh_process(env)
    assert used == versioned
    assert used.startswith(str(tmp_path / ".cache" / "specdec" / "numba"))
    assert any(name.endswith(".nbi") for _, _, files in os.walk(used) for name in files)


def test_a_cache_directory_the_user_set_is_kept(tmp_path):
    chosen = tmp_path / "mine"
    used, _ = _compile_in_fresh_process({**os.environ, "NUMBA_CACHE_DIR": str(chosen)})
    assert used == str(chosen)
    assert any(name.endswith(".nbi") for _, _, files in os.walk(chosen) for name in files)
