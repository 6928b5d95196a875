#!/usr/bin/env python3
"""Regenerate the Python stubs of proto/kvstore/v1/*.proto into kvstore/v1/.

    python scripts/gen_proto.py            # rewrite kvstore/v1/
    python scripts/gen_proto.py --out DIR  # write DIR/kvstore/v1/ instead (freshness test)

kvstore/v1/ holds generated code only: never edit it by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # dev dependency

    sources = sorted((PROTO_ROOT / "kvstore" / "v1").glob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    # protoc resolves relative source names against -I.
    import os

    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    pkg = out / "kvstore" / "v1"
    init = pkg / "__init__.py"
    init.write_text('"""Generated from proto/kvstore/v1 by scripts/gen_proto.py. Do not edit."""\n')
    return sorted(pkg.glob("*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT, help="root to write kvstore/v1/ under")
    ns = ap.parse_args()
    files = generate(ns.out.resolve())
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
