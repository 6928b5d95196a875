"""The data port's remembered header checks (DataPort._header, through the Sealer's memory of the
headers it sealed or checked): whatever the bytes at an extent's offset become (rewritten for
another block, cleared, forged, put back), the answer is the one a fresh check of those bytes
gives (a Sealer of the same secret that remembers nothing)."""

from __future__ import annotations

import numpy as np

from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.extent import HEADER_SIZE, Sealer, checksum


def test_remembered_headers_answer_as_a_fresh_check(tmp_path):
    sealer = Sealer(b"s" * 32)
    port = DataPort("127.0.0.1", 0, dict, sealer)
    arena = ShmArena(tmp_path / "arena", 1 << 20, create=True)
    rng = np.random.default_rng(3)
    try:
        seen = []
        for step in range(400):
            off = int(rng.integers(0, 4)) * 8192
            what = int(rng.integers(0, 5))
            if what == 0:  # a block committed there
                n = int(rng.integers(1, 4000))
                arena.view[off + HEADER_SIZE : off + HEADER_SIZE + n] = rng.bytes(n)
                csum = checksum(arena.array[off + HEADER_SIZE : off + HEADER_SIZE + n])
                assert arena.commit(sealer, off, rng.bytes(16), n, csum, step)
                seen.append((off, bytes(arena.view[off : off + HEADER_SIZE])))
            elif what == 1:  # invalidated
                arena.clear_header(off)
            elif what == 2:  # bytes no daemon sealed (a writer's scribble)
                arena.view[off : off + HEADER_SIZE] = rng.bytes(HEADER_SIZE)
            elif what == 3 and seen:  # an old header put back where it was sealed, or elsewhere
                old_off, raw = seen[int(rng.integers(0, len(seen)))]
                arena.view[off : off + HEADER_SIZE] = raw
            for o in range(0, 4 * 8192, 8192):
                fresh = Sealer(b"s" * 32)
                assert port._header(arena, o) == fresh.parse(arena.view, o), (step, o)
    finally:
        port.stop()
        arena.close()
