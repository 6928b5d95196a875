"""The store's package stands alone: nothing under kvstore/ imports the engine (the engine's
commands reach the CLI through the ``kvstore.commands`` entry point group)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kvstore_imports_nothing_from_engine():
    offenders = []
    for path in (ROOT / "kvstore").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "engine" or n.startswith("engine.")]
    assert not offenders, offenders


def test_engine_commands_are_entry_points():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="kvstore.commands")}
    assert eps.get("engine") == "engine.cli:engine" and eps.get("demo") == "engine.cli:demo"
