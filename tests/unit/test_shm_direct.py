"""The shared-memory read without a lease (ShmTransport.read with a key): another process
rewrites one extent over and over, alternating two blocks the way a daemon and its writers do
(clear the header, copy the payload, write the sealed header); a reader that asks for one of
them gets either a miss or exactly that block's bytes, never the other's or a mix. Each test runs
on the native copy (kvstore.transport.native) and on the Python path."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.daemon.arena import ShmArena
from kvstore.extent import checksum
from kvstore.transport import native
from kvstore.transport.shm import ShmTransport

SIZE = 256 << 10
KX, KY = b"x" * 16, b"y" * 16
GX, GY = 11, 12


@pytest.fixture(autouse=True, params=["native", "python"])
def impl(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(native, "impl", None)
    elif native.impl is None:
        pytest.skip("the native copy is not built here")
    return request.param


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


WRITER = textwrap.dedent(
    """
    import sys, time, numpy as np
    from kvstore.daemon.arena import ShmArena
    from kvstore.extent import Sealer, checksum
    path, seconds = sys.argv[1], float(sys.argv[2])
    size = 256 << 10
    a = ShmArena(path, 1 << 20)
    sealer = Sealer(b"s" * 32)
    blocks = [(b"x" * 16, np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8), 11),
              (b"y" * 16, np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8), 12)]
    print("ready", flush=True)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        key, data, gen = blocks[i % 2]
        i += 1
        a.clear_header(0)
        a.array[64 : 64 + size] = data
        a.commit(sealer, 0, key, size, checksum(data), gen)
        if i % 3 == 0:
            time.sleep(0.0005)  # now and then a block lives a while before its extent is reused
    """
)


def test_reads_racing_a_rewriting_process_get_the_block_or_a_miss(tmp_path):
    path = tmp_path / "arena"
    arena = ShmArena(path, 1 << 20, create=True)
    x, y = block(1), block(2)
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "2.0"], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready"
        got = {KX: 0, KY: 0}
        misses = wrong = reads = 0
        out = np.empty(SIZE, np.uint8)
        while w.poll() is None and reads < 2_000_000:
            for key, data, gen in ((KX, x, GX), (KY, y, GY)):
                reads += 1
                if ShmTransport.read(arena, 0, SIZE, out, checksum(data), key, gen):
                    got[key] += 1
                    wrong += int(not np.array_equal(out, data))
                else:
                    misses += 1
        assert w.wait(60) == 0
    finally:
        w.kill()
        arena.close()
    assert wrong == 0
    assert got[KX] > 0 and got[KY] > 0 and misses > 0, (got, misses)


def test_a_block_named_by_another_key_or_generation_is_a_miss(tmp_path):
    from kvstore.extent import Sealer

    arena = ShmArena(tmp_path / "arena", 1 << 20, create=True)
    try:
        data = block(3)
        arena.array[64 : 64 + SIZE] = data
        arena.commit(Sealer(b"s" * 32), 0, KX, SIZE, checksum(data), GX)
        out = np.empty(SIZE, np.uint8)
        assert ShmTransport.read(arena, 0, SIZE, out, checksum(data), KX, GX)
        assert np.array_equal(out, data)
        assert not ShmTransport.read(arena, 0, SIZE, out, checksum(data), KY, GX)  # another key
        assert not ShmTransport.read(arena, 0, SIZE, out, checksum(data), KX, GX + 1)  # another generation
        assert not ShmTransport.read(arena, 0, SIZE - 1, out[:-1], checksum(data), KX, GX)  # another length
        arena.clear_header(0)  # invalidated (evicted, removed): the payload is still there
        assert not ShmTransport.read(arena, 0, SIZE, out, checksum(data), KX, GX)
        # A daemon serves the arena while it holds its lock; a client's mapping only probes.
        client = ShmArena(tmp_path / "arena", 1 << 20)
        assert not client.served()  # not yet: the daemon serves once its blocks are indexed
        arena.serve()
        assert client.served()
        arena.unserve()
        assert not client.served()
        arena.serve()
        arena.close()  # a daemon that stops (or dies) serves no more
        assert not client.served()
        client.close()
    finally:
        arena.close()


def test_a_second_daemon_cannot_attach_to_a_served_arena(tmp_path):
    arena = ShmArena(tmp_path / "arena", 1 << 20, create=True)
    try:
        with pytest.raises(OSError, match="already in use by another daemon"):
            ShmArena(tmp_path / "arena", 1 << 20, create=True)
    finally:
        arena.close()
    ShmArena(tmp_path / "arena", 1 << 20, create=True).close()  # free once the first let go
