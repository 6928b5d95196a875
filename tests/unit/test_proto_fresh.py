"""The committed stubs in kvstore/v1 are exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) is needed to regenerate stubs")
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "kvstore" / "v1").iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in (REPO / "kvstore" / "v1").iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ: run python scripts/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run python scripts/gen_proto.py"


def test_import_kvstore_needs_no_torch():
    code = "import sys, kvstore, kvstore.client, kvstore.cli; assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
