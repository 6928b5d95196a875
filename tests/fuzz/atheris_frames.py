#!/usr/bin/env python3
"""Coverage-guided fuzzing of the data port's frame parser with atheris (libFuzzer), for runs
longer than CI's property tests (tests/unit/test_frame_parser.py):

    pip install -e '.[fuzz]'
    python tests/fuzz/atheris_frames.py -max_total_time=600     # libFuzzer flags

Each input is one request frame (head, entries) checked as the daemon checks it, with and
without a ticket key. A crash is any exception other than FrameError, or an accepted entry
that breaks the parser's promises (outside its segment, over the block limit, a ticket that
does not sign it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports():
    from kvstore.daemon import dataport, entries  # noqa: F401 - instrumented for coverage
    from kvstore.transport import frames  # noqa: F401
    from tests.unit.test_frame_parser import KEY, _accepted_invariants, parse


def one(data: bytes) -> None:
    for key in (b"", KEY):
        got = parse(data, key)
        if got is not None:
            _accepted_invariants(*got, key)


def main() -> None:
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
