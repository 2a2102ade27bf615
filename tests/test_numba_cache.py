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


def _version_dir(root: pathlib.Path, name: str, mtime: float) -> pathlib.Path:
    path = root / name
    builds = path / ("models_" + "0" * 40)  # numba's folder per source directory, inside a version's
    builds.mkdir(parents=True)
    (builds / "cpu_attention._attend_item-61.py311.nbi").write_bytes(b"x")
    os.utime(path, (mtime, mtime))
    return path


def test_older_versions_are_pruned_keeping_the_current_and_the_two_newest_others(tmp_path):
    current = _version_dir(tmp_path, "c" * 16, 100)  # the oldest on disk, but the one in use
    newest, second, old, older = (_version_dir(tmp_path, name, t) for name, t in
                                  (("a" * 16, 500), ("b" * 16, 400), ("d" * 16, 300), ("e" * 16, 200)))
    legacy = tmp_path / ("models_" + "7bd5ca5565564de026005dc393eff5ec3a3e0dbb")  # before the versioned layout
    legacy.mkdir()
    unrelated = [tmp_path / "notes", tmp_path / ("f" * 15)]
    for path in unrelated:
        path.mkdir()
    (tmp_path / ("9" * 16)).write_text("a file, not a version directory")

    deleted = cpu_attention.prune_cache_dirs(str(current))

    assert sorted(deleted) == sorted(str(p) for p in (old, older, legacy))
    for kept in (current, newest, second, *unrelated, tmp_path / ("9" * 16)):
        assert kept.exists(), kept
    for gone in (old, older, legacy):
        assert not gone.exists(), gone
    assert cpu_attention.prune_cache_dirs(str(current)) == []  # nothing more to do


def test_a_missing_root_prunes_nothing(tmp_path):
    assert cpu_attention.prune_cache_dirs(str(tmp_path / "absent" / ("a" * 16))) == []


def test_loading_the_kernel_prunes_only_its_own_default_root(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    env["HOME"] = str(tmp_path)
    root = tmp_path / ".cache" / "specdec" / "numba"
    stale = [_version_dir(root, name, t) for name, t in (("1" * 16, 10), ("2" * 16, 20), ("3" * 16, 30))]
    used, _ = _compile_in_fresh_process(env)
    assert pathlib.Path(used).is_dir()
    assert [p.exists() for p in stale] == [False, True, True]  # the two newest others are kept

    chosen = tmp_path / "mine"
    mine = [_version_dir(chosen, name, t) for name, t in (("4" * 16, 10), ("5" * 16, 20), ("6" * 16, 30))]
    _compile_in_fresh_process({**env, "NUMBA_CACHE_DIR": str(chosen / ("7" * 16))})
    assert all(p.exists() for p in mine)  # a directory the user chose is never pruned
