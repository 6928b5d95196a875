"""The native copy (kvstore/transport/copy.c through kvstore.transport.native) answers as the
Python path of ShmTransport.read_many on random runs: valid blocks, corrupted payloads, headers
of another key, generation, length or checksum, cleared headers, extents outside the arena,
buffers of another size, placements naming their own key, with and without header checks; and it
is built wherever it can be."""

from __future__ import annotations

import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.daemon.arena import ShmArena
from kvstore.extent import HEADER_SIZE, Sealer, checksum
from kvstore.transport import native
from kvstore.transport.shm import ShmTransport
from kvstore.wire import Placement

ARENA = 4 << 20
SLOT = 64 << 10  # extent stride in the test arena

needs_native = pytest.mark.skipif(native.impl is None, reason="the native copy is not built here")


def _python(arena, places, dests, keys, deadline, monkeypatch) -> int:  # noqa: ANN001
    with monkeypatch.context() as m:
        m.setattr(native, "impl", None)
        return ShmTransport.read_many(arena, places, dests, keys, deadline)


def _layout(arena: ShmArena, rng: np.random.Generator, n: int) -> tuple[list, list, list[bytes]]:
    """n committed blocks of random sizes in the arena: (placements, payloads, keys)."""
    sealer = Sealer(b"k" * 32)
    places, payloads, keys = [], [], []
    for i in range(n):
        off = i * SLOT
        length = int(rng.integers(0, SLOT - HEADER_SIZE))
        data = rng.integers(0, 256, length, dtype=np.uint8)
        key = rng.bytes(16)
        gen = int(rng.integers(0, 2**63))
        arena.array[off + HEADER_SIZE : off + HEADER_SIZE + length] = data
        arena.commit(sealer, off, key, length, checksum(data), gen)
        places.append(Placement(None, None, off, length, checksum(data), gen))
        payloads.append(data)
        keys.append(key)
    return places, payloads, keys


def _spoil(arena: ShmArena, places: list, dests: list, keys: list, rng: np.random.Generator) -> str:
    """One random fault at a random block (or none)."""
    i = int(rng.integers(0, len(places)))
    p = places[i]
    fault = str(
        rng.choice(["none", "payload", "key", "gen", "length", "csum", "cleared", "outside", "dest", "own_key"])
    )
    if fault == "payload" and p.length:
        arena.array[p.offset + HEADER_SIZE + int(rng.integers(0, p.length))] ^= 0xFF
    elif fault == "key":
        keys[i] = bytes(16)
    elif fault == "gen":
        places[i] = p._replace(gen=p.gen ^ 1)
    elif fault == "length" and p.length:
        places[i] = p._replace(length=p.length - 1)
        dests[i] = dests[i][:-1]
    elif fault == "csum":
        places[i] = p._replace(checksum=(p.checksum + 1) % 2**64)
    elif fault == "cleared":
        arena.clear_header(p.offset)
    elif fault == "outside":
        places[i] = p._replace(offset=int(rng.choice([-HEADER_SIZE, ARENA - HEADER_SIZE, ARENA, 2**62])))
    elif fault == "dest":
        dests[i] = np.empty(p.length + 1, np.uint8)
    elif fault == "own_key":  # the block is stored under the key the placement names
        places[i] = p._replace(key=keys[i])
        keys[i] = bytes(16)
    return fault


@needs_native
@pytest.mark.parametrize("seed", range(40))
def test_native_and_python_agree_on_random_runs(tmp_path: Path, seed: int, monkeypatch):
    rng = np.random.default_rng(seed)
    arena = ShmArena(tmp_path / "arena", ARENA, create=True)
    try:
        n = int(rng.integers(1, ARENA // SLOT))
        places, payloads, keys = _layout(arena, rng, n)
        dests = [np.empty(p.length, np.uint8) for p in places]
        fault = _spoil(arena, places, dests, keys, rng)
        checked = keys if rng.random() < 0.7 else None
        want = _python(arena, places, [d.copy() for d in dests], checked, math.inf, monkeypatch)
        got = native.impl.read_many(arena.array, HEADER_SIZE, places, dests, checked, math.inf, b"KVB1\x02\x00\x00\x00")
        assert got == ShmTransport.read_many(arena, places, [d.copy() for d in dests], checked, math.inf)
        assert got == want, fault
        for i in range(got):  # what was loaded is the block's bytes
            assert np.array_equal(dests[i], payloads[i]), i
        if fault == "none" or (fault in ("key", "gen", "cleared", "own_key") and checked is None):
            assert got == n
    finally:
        arena.close()


@needs_native
def test_a_run_stops_at_its_deadline_and_bad_arguments_are_typed_errors(tmp_path: Path):
    rng = np.random.default_rng(7)
    arena = ShmArena(tmp_path / "arena", ARENA, create=True)
    try:
        places, _, keys = _layout(arena, rng, 4)
        dests = [np.empty(p.length, np.uint8) for p in places]
        assert ShmTransport.read_many(arena, places, dests, keys, time.monotonic() - 1) == 0
        assert ShmTransport.read_many(arena, places, dests, keys, time.monotonic() + 60) == 4
        with pytest.raises(TypeError):
            ShmTransport.read_many(arena, [(1, 2)], dests, keys, math.inf)
        with pytest.raises(ValueError):
            ShmTransport.read_many(arena, places, dests, [b"short"] * 4, math.inf)
        read_only = [np.frombuffer(bytes(p.length), np.uint8) for p in places]
        with pytest.raises((BufferError, ValueError, TypeError)):
            ShmTransport.read_many(arena, places, read_only, keys, math.inf)
        # Values no wire row can hold are blocks that fail, not errors.
        for bad in ({"checksum": 2**64}, {"offset": -1}, {"offset": 2**64}, {"gen": 2**70}, {"length": -5}):
            assert ShmTransport.read_many(arena, [places[0]._replace(**bad)] + places[1:], dests, keys, math.inf) == 0
        assert (
            ShmTransport.read_many(arena, places[:1] + [places[1]._replace(offset=2**63)], dests, keys, math.inf) == 1
        )
    finally:
        arena.close()


def test_the_native_copy_is_built_where_it_can_be():
    """A machine with a C compiler and xxhash.h (scripts/setup.sh installs libxxhash-dev as root)
    must have it: a build that broke would otherwise only show as slower reads."""
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    header = any(Path(d, "xxhash.h").exists() for d in ("/usr/include", "/usr/local/include"))
    if not (shutil.which("cc") or shutil.which("gcc")) or not header or not include.exists():
        pytest.skip("no C compiler, xxhash.h or Python.h here")
    assert native.impl is not None, "kvstore/transport/copy.c was not built: pip install -e . shows why"
    assert native.name().startswith("_copy")


@needs_native
@pytest.mark.parametrize(
    "length", [4095, 4096, 4097, 8193, 12289, 16383, 16385, 65536 + 7, (1 << 20) + 1, (3 << 20) + 4097, 5 << 20]
)
def test_blocks_copied_chunk_by_chunk_are_verified_whole(tmp_path: Path, length: int, monkeypatch):
    """Blocks over a chunk (4-16 KiB, from the L1 cache's size) are copied and checksummed chunk
    by chunk: lengths around every possible chunk size, and every byte still counts."""
    rng = np.random.default_rng(length)
    arena = ShmArena(tmp_path / "arena", 8 << 20, create=True)
    try:
        data = rng.integers(0, 256, length, dtype=np.uint8)
        arena.array[HEADER_SIZE : HEADER_SIZE + length] = data
        key = rng.bytes(16)
        arena.commit(Sealer(b"k" * 32), 0, key, length, checksum(data), 3)
        place = Placement(None, None, 0, length, checksum(data), 3)
        out = np.empty(length, np.uint8)
        assert ShmTransport.read_many(arena, [place], [out], [key], math.inf) == 1
        assert np.array_equal(out, data)
        # A flipped byte anywhere is caught.
        for at in sorted({0, 4095 % length, 4096 % length, 12288 % length, length // 2, length - 1}):
            arena.array[HEADER_SIZE + at] ^= 0x01
            assert ShmTransport.read_many(arena, [place], [out], None, math.inf) == 0, at
            assert _python(arena, [place], [out], None, math.inf, monkeypatch) == 0
            arena.array[HEADER_SIZE + at] ^= 0x01
        assert ShmTransport.read_many(arena, [place], [out], None, math.inf) == 1
    finally:
        arena.close()


@pytest.mark.parametrize("writable", [True, False])
def test_buffer_checks_answer_the_same_with_and_without_the_native_copy(writable: bool, monkeypatch):
    """byte_views takes a list of 1-D uint8 arrays as it is after one native check; anything else
    goes through byte_view, with the same views or the same errors as without it."""
    from kvstore.client.buffers import byte_views
    from kvstore.errors import InvalidArgument

    ro = np.ones(8, np.uint8)
    ro.flags.writeable = False
    cases = [
        [np.ones(8, np.uint8), np.zeros(3, np.uint8)],
        [np.ones(8, np.uint8)[::2]],
        [np.ones((2, 4), np.uint8)],
        [np.ones(4, np.float16)],
        [np.ones(4, np.int8)],
        [ro],
        [bytearray(5)],
        [b"abc"],
        [memoryview(bytearray(6)).cast("B", (2, 3))],
        [],
        [np.ones(2, np.uint8), 7],
    ]

    def run() -> list:
        out = []
        for c in cases:
            try:
                out.append([(v.dtype.str, v.size, v.tobytes()) for v in byte_views(c, writable)])
            except InvalidArgument as e:
                out.append(str(e))
        return out

    want = run()
    with monkeypatch.context() as m:
        m.setattr(native, "impl", None)
        assert run() == want
    first = cases[0]
    if native.impl is not None:
        assert byte_views(first, writable)[0] is first[0]  # taken as is
    assert isinstance(want[1], str) and isinstance(want[-1], str)
    assert isinstance(want[5], str) if writable else not isinstance(want[5], str)


@needs_native
def test_the_avx2_build_is_chosen_only_where_the_cpu_has_avx2():
    """The default build answers for the CPU (it runs anywhere), the same as /proc/cpuinfo; the
    AVX2 build is used only where it says yes."""
    base = pytest.importorskip("kvstore.transport._copy")
    assert base.has_avx2() == native._cpuinfo_avx2()
    if native.name() == "_copy_avx2":
        assert base.has_avx2()
