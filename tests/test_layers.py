"""Architecture rules, enforced: layer direction (import-linter) and a pure verification module."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sampling_math_is_pure():
    """The verification math imports no grpc, redis or asyncio (ARCHITECTURE.md)."""
    banned = {"grpc", "redis", "asyncio"}
    for path in (ROOT / "specdec" / "sampling").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"
