"""The engine's commands for the ``kvstore`` CLI, found through the ``kvstore.commands`` entry
point group (see ``pyproject.toml``), so that ``kvstore`` itself never imports the engine.

A command plugin has ``help``, ``add_arguments(parser)`` and ``run(ns, cfg) -> int``.
"""

from __future__ import annotations

import argparse
from typing import Any


class EngineCommand:
    help = "the inference engine: router + prefill/decode workers (+ an embedded store)"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        from engine.serve import add_arguments

        add_arguments(p)

    @staticmethod
    def run(ns: argparse.Namespace, cfg: Any) -> int:
        from engine.serve import main

        return main(ns)


class DemoCommand:
    """Replaces the store-only demo's model with the engine (``kvstore demo``)."""

    help = "the embedded store with the torch engine: a short multi-turn workload that shows prefix reuse"

    @staticmethod
    def run(ns: argparse.Namespace, cfg: Any) -> int | None:
        from engine.demo import run

        return run(sessions=ns.sessions, turns=ns.turns, seed=ns.seed)


engine = EngineCommand()
demo = DemoCommand()
