"""The daemon's segments on real files: the SSD segment (round trips, compression, pending
writes and commits, journal recovery, damage detection) and the DRAM arena's sealed headers."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstore.daemon import ssd as ssd_mod
from kvstore.daemon import ssd_map
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.codec import F_LZ4, F_SHUFFLE2, compress, shuffle2, unshuffle2
from kvstore.daemon.ssd import REC_SIZE, SsdSegment
from kvstore.errors import ResourceExhausted
from kvstore.extent import HEADER_SIZE, Sealer, checksum, scan

MB = 1 << 20


def payloads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(96 * 1024).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return {
        "fp16": x.astype(np.float16).view(np.uint8),
        "bf16": bf16.view(np.uint8),
        "fp32": x.view(np.uint8),
        "random": rng.integers(0, 256, 300_001, dtype=np.uint8),
        "zeros": np.zeros(200_000, np.uint8),
        "tiny": np.arange(100, dtype=np.uint8),
        "smooth_bf16": (np.linspace(0, 1, 64 * 1024, dtype=np.float32).view(np.uint32) >> 16)
        .astype(np.uint16)
        .view(np.uint8),
    }


def store(seg: SsdSegment, offset: int, key: bytes, raw: np.ndarray, gen: int) -> int:
    """Writes and commits one block (what a put that the service commits does); returns its extent bytes."""
    size = seg.write(offset, key, raw, checksum(raw), gen)
    b = seg.commit(offset, key, gen)
    assert b is not None and (b.key, b.offset, b.size, b.length, b.gen) == (key, offset, size, raw.size, gen)
    return size


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("name", list(payloads()))
def test_write_read_roundtrip_every_payload(tmp_path, name, direct):
    seg = SsdSegment(tmp_path, 2, 16 * MB, direct_io=direct)
    raw = payloads()[name]
    key = name.encode().ljust(16, b"_")
    store(seg, 4096 * 3, key, raw, gen=7)
    st, out = seg.read(4096 * 3, key, raw.size)
    assert st.ok and np.array_equal(out, raw)
    dest = np.empty_like(raw)
    st, _ = seg.read(4096 * 3, key, raw.size, out=dest, gen=7)
    assert st.ok and np.array_equal(dest, raw)
    seg.close()


def test_compression_only_where_it_pays(tmp_path):
    p = payloads()
    assert compress(p["random"], "auto") == (0, None)
    assert compress(p["zeros"], "off") == (0, None)
    flags, data = compress(p["zeros"], "auto")
    assert flags & F_LZ4 and len(data) < 2000
    flags, data = compress(p["smooth_bf16"], "auto")
    assert flags & F_LZ4 and len(data) < p["smooth_bf16"].size * 0.9
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    size = store(seg, 0, b"z" * 16, p["zeros"], gen=1)
    assert size == 4096  # 200 kB of zeros in one page
    assert seg.counters["compressed"] == 1
    assert seg.inventory().size.tolist() == [4096]


def test_shuffle_round_trip_odd_length():
    raw = np.random.default_rng(1).integers(0, 256, 10_001, dtype=np.uint8)
    out = np.empty_like(raw)
    unshuffle2(shuffle2(raw), out)
    assert np.array_equal(out, raw)
    assert F_SHUFFLE2 != F_LZ4


def test_wrong_key_length_or_gen_is_a_mismatch_not_data(tmp_path):
    seg = SsdSegment(tmp_path, 2, 4 * MB)
    raw = payloads()["fp32"]
    store(seg, 0, b"a" * 16, raw, gen=5)
    assert seg.read(0, b"a" * 16, raw.size, gen=5)[0].ok
    assert seg.read(0, b"b" * 16, raw.size)[0].reason == "mismatch"
    assert seg.read(0, b"a" * 16, raw.size - 1)[0].reason == "mismatch"
    assert seg.read(0, b"a" * 16, raw.size, gen=4)[0].reason == "mismatch"
    assert seg.read(8 * MB, b"a" * 16, raw.size)[0].reason == "mismatch"
    with pytest.raises(ValueError, match="outside segment"):
        seg.write(4 * MB - 4096, b"c" * 16, raw, checksum(raw), 6)


def _fill(seg: SsdSegment, n: int) -> dict[bytes, tuple[int, np.ndarray]]:
    rng = np.random.default_rng(7)
    blocks = {}
    for i in range(n):
        raw = rng.integers(0, 256, 20_000 + i, dtype=np.uint8)
        key = i.to_bytes(16, "little")
        off = i * 6 * 4096
        store(seg, off, key, raw, gen=100 + i)
        blocks[key] = (off, raw)
    return blocks


def test_recovery_after_reopen_keeps_committed_blocks_and_drops_invalidated_ones(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    blocks = _fill(seg, 20)
    victim = next(iter(blocks))
    assert seg.invalidate(blocks[victim][0], victim, 100)
    assert not seg.invalidate(blocks[victim][0], victim, 100)  # already gone
    assert victim not in seg.inventory().key_bytes()
    seg.close()  # as after a crash: nothing flushed beyond what the OS has
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover()
    assert discarded == 0
    assert set(found.key_bytes()) == set(blocks) - {victim}
    assert found.gen.tolist() == list(range(101, 120))  # oldest first, generations kept
    assert seg.inventory() == found
    for b in found.rows():
        st, out = seg.read(b.offset, b.key, b.length, gen=b.gen)
        assert st.ok and np.array_equal(out, blocks[b.key][1])
    # The journal was compacted to the live set.
    assert REC_SIZE == 68
    assert os.path.getsize(seg.journal_path) == 19 * REC_SIZE
    assert seg.journal_path.read_bytes()[:4] == b"KVJ2"


def test_written_but_not_committed_block_is_pending_only(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    a, b = np.full(5000, 1, np.uint8), np.full(5000, 2, np.uint8)
    store(seg, 0, b"a" * 16, a, gen=1)
    seg.write(4096 * 4, b"b" * 16, b, checksum(b), 2)
    assert seg.inventory().key_bytes() == [b"a" * 16]
    # A commit must name the pending write exactly.
    assert seg.commit(4096 * 4, b"b" * 16, 3) is None
    assert seg.commit(4096 * 4, b"x" * 16, 2) is None
    assert seg.commit(4096 * 8, b"b" * 16, 2) is None
    assert seg.counters["commits"] == 1
    assert len(seg.inventory()) == 1
    seg.close()  # the writer never committed (it died, or the service refused the put)
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover()
    assert found.key_bytes() == [b"a" * 16] and discarded == 0
    assert seg.commit(4096 * 4, b"b" * 16, 2) is None  # the pending write did not survive either


def test_commit_is_idempotent_and_invalidate_drops_a_pending_write(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    raw = np.full(5000, 3, np.uint8)
    store(seg, 0, b"a" * 16, raw, gen=1)
    size = os.path.getsize(seg.journal_path)
    again = seg.commit(0, b"a" * 16, 1)  # a retried commit answers the committed block
    assert again is not None and again.gen == 1
    assert os.path.getsize(seg.journal_path) == size
    seg.write(4096 * 4, b"b" * 16, raw, checksum(raw), 2)
    assert not seg.invalidate(4096 * 4, b"b" * 16, 9)
    assert seg.invalidate(4096 * 4, b"b" * 16, 2)  # an aborted put: nothing journaled
    assert seg.commit(4096 * 4, b"b" * 16, 2) is None
    assert os.path.getsize(seg.journal_path) == size
    assert seg.inventory().key_bytes() == [b"a" * 16]


def test_invalidate_with_a_stale_gen_keeps_the_newer_block(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    old, new = np.full(8000, 1, np.uint8), np.full(8000, 2, np.uint8)
    key = b"k" * 16
    store(seg, 0, key, old, gen=10)
    assert seg.invalidate(0, key, 10)
    store(seg, 0, key, new, gen=11)  # the extent is reused by a newer write of the same key
    assert not seg.invalidate(0, key, 10)  # a late tombstone for the old block
    assert [(b.key, b.gen) for b in seg.inventory().rows()] == [(key, 11)]
    st, out = seg.read(0, key, new.size, gen=11)
    assert st.ok and np.array_equal(out, new)
    assert seg.read(0, key, new.size, gen=10)[0].reason == "mismatch"
    seg.close()
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover()
    assert [(b.key, b.gen) for b in found.rows()] == [(key, 11)] and discarded == 0


def test_commit_on_a_full_journal_is_resource_exhausted_and_appends_nothing(tmp_path, monkeypatch):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    raw = np.full(5000, 4, np.uint8)
    store(seg, 0, b"a" * 16, raw, gen=1)
    seg.write(4096 * 4, b"b" * 16, raw, checksum(raw), 2)
    size = os.path.getsize(seg.journal_path)
    real_write = os.write

    def full(fd, data):  # a file system that takes half a record, then is full
        if fd == seg._jfd:
            return real_write(fd, bytes(data)[: len(data) // 2])
        return real_write(fd, data)

    monkeypatch.setattr(ssd_mod.os, "write", full)
    with pytest.raises(ResourceExhausted, match="no space"):
        seg.commit(4096 * 4, b"b" * 16, 2)
    assert os.path.getsize(seg.journal_path) == size  # the torn half record was cut off
    assert seg.inventory().key_bytes() == [b"a" * 16]
    assert seg.counters["journal_full"] == 1
    # A DEL that cannot be journaled clears the header instead: no recovery adopts the block.
    assert seg.invalidate(0, b"a" * 16, 1)
    assert len(seg.inventory()) == 0
    assert seg.read(0, b"a" * 16, raw.size)[0].reason == "mismatch"
    monkeypatch.undo()
    # Once there is room again, the still pending write can be committed.
    assert seg.commit(4096 * 4, b"b" * 16, 2) is not None
    seg.close()
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover()
    assert found.key_bytes() == [b"b" * 16]
    assert discarded == 1  # a's ADD record is there, its header is not


def test_segment_secret_file_and_a_lost_secret(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    secret = tmp_path / "ssd.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    _fill(seg, 3)
    seg.close()
    # Reopened with the same secret file: everything is adopted.
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    assert len(seg.recover()[0]) == 3
    seg.close()
    # With another secret (the file was lost): nothing old is adopted, fail safe.
    seg = SsdSegment(tmp_path, 2, 16 * MB, sealer=Sealer(os.urandom(32)))
    found, discarded = seg.recover()
    assert len(found) == 0 and discarded == 3


def test_torn_journal_tail_and_flipped_payload_byte_are_discarded(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    blocks = _fill(seg, 10)
    seg.close()
    # A torn tail: the last record is cut in half.
    size = os.path.getsize(tmp_path / "ssd-2.journal")
    os.truncate(tmp_path / "ssd-2.journal", size - 30)
    # A flipped byte in block 3's payload.
    off3 = blocks[(3).to_bytes(16, "little")][0]
    with open(tmp_path / "ssd-2.data", "r+b") as f:
        f.seek(off3 + HEADER_SIZE + 500)
        b = f.read(1)
        f.seek(off3 + HEADER_SIZE + 500)
        f.write(bytes([b[0] ^ 1]))
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover(verify=True)
    keys = set(found.key_bytes())
    assert (9).to_bytes(16, "little") not in keys  # its record was torn
    assert (3).to_bytes(16, "little") not in keys  # its bytes were damaged
    assert len(found) == 8 and discarded == 1
    # New records follow the whole ones, and survive another reopen.
    raw = np.ones(5000, np.uint8)
    store(seg, 15 * MB, b"n" * 16, raw, gen=500)
    seg.close()
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover()
    assert len(found) == 9 and discarded == 0


def test_flipped_byte_found_at_read_time(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    blocks = _fill(seg, 3)
    key = (1).to_bytes(16, "little")
    off = blocks[key][0]
    with open(tmp_path / "ssd-2.data", "r+b") as f:
        f.seek(off + HEADER_SIZE + 10)
        f.write(b"\xff\xfe")
    st, out = seg.read(off, key, blocks[key][1].size)
    assert not st.ok and st.reason == "checksum" and out is None
    assert seg.counters["checksum_failures"] == 1


def test_durable_mode_round_trip(tmp_path):
    seg = SsdSegment(tmp_path, 2, 4 * MB, durability="durable")
    raw = payloads()["bf16"]
    store(seg, 0, b"d" * 16, raw, gen=1)
    assert seg.read(0, b"d" * 16, raw.size, gen=1)[0].ok
    with pytest.raises(ValueError, match="durability"):
        SsdSegment(tmp_path / "x", 2, 4 * MB, durability="sometimes")


# ---- the DRAM arena -----------------------------------------------------------------------------


def test_arena_invalidate_with_a_wrong_gen_leaves_the_newer_block(tmp_path):
    sealer = Sealer(os.urandom(32))
    arena = ShmArena(tmp_path / "arena", MB, create=True)
    key, off = b"k" * 16, 4096
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    arena.array[off + HEADER_SIZE : off + HEADER_SIZE + data.size] = data  # the writer's copy
    assert len(scan(arena.array, sealer).blocks) == 0  # not committed yet: nothing to adopt
    assert arena.commit(sealer, off, key, data.size, checksum(data), gen=1)
    assert arena.invalidate(sealer, off, key, 1)
    assert len(scan(arena.array, sealer).blocks) == 0
    # The extent is reused by a newer write of the same key; a late invalidation of gen 1 misses it.
    assert arena.commit(sealer, off, key, data.size, checksum(data), gen=2)
    assert not arena.invalidate(sealer, off, key, 1)
    assert not arena.invalidate(sealer, off, b"x" * 16, 2)
    assert not arena.invalidate(Sealer(os.urandom(32)), off, key, 2)
    h = sealer.parse(arena.view, off)
    assert h is not None and h.gen == 2
    assert [(b.offset, b.key, b.gen) for b in scan(arena.array, sealer).blocks.rows()] == [(off, key, 2)]
    assert arena.invalidate(sealer, off, key, 2)
    assert len(scan(arena.array, sealer).blocks) == 0
    # Extents that do not fit are refused.
    assert not arena.commit(sealer, MB - HEADER_SIZE, key, 1, 0, gen=3)
    assert not arena.invalidate(sealer, MB, key, 3)
    arena.close()


# ---- random operation sequences, then a crash ---------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_then_a_crash_recover_exactly_the_committed_blocks(tmp_path, seed, monkeypatch):
    """Writes into free extents, commits (some never made), retried commits, removals with
    current and stale generations, reuse of freed extents, journal compactions, and damage to a
    few committed blocks' headers: after a crash (the process gone, its files as the OS has them), recovery adopts
    exactly the committed blocks that are whole, oldest first, and the segment answers for
    them as before."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(SsdSegment, "__init__", _small_compaction(SsdSegment.__init__, int(rng.integers(20, 200))))
    monkeypatch.setattr(ssd_map, "_MERGE_MIN", int(rng.integers(1, 30)))  # the block map merges often
    slots, stride = 48, 3 * 4096
    seg = SsdSegment(tmp_path, 2, slots * stride, direct_io=bool(seed % 2))
    model: dict[int, tuple] = {}  # offset -> (key, length, checksum, gen): what is committed
    gen = 0
    for _ in range(int(rng.integers(50, 400))):
        off = int(rng.integers(slots)) * stride
        op = rng.random()
        if op < 0.6 and off not in model:  # the service writes only into extents it holds free
            gen += 1
            key = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
            raw = rng.integers(0, 4, int(rng.integers(1, 9000)), dtype=np.uint8)  # compressible at times
            seg.write(off, key, raw, checksum(raw), gen)
            if rng.random() < 0.8:
                assert seg.commit(off, key, gen) is not None
                model[off] = (key, raw.size, checksum(raw), gen)
            else:  # written, never committed: the old block stays committed
                assert seg.commit(off, key, gen + 1) is None
        elif op < 0.85 and off in model:
            key, _, _, g = model[off]
            stale = rng.random() < 0.3
            assert seg.invalidate(off, key, g - 1 if stale else g) == (not stale)
            if not stale:
                del model[off]
        elif off in model:  # a retried commit answers the committed block and appends nothing
            key, _, _, g = model[off]
            size = os.path.getsize(seg.journal_path)
            assert seg.commit(off, key, g) is not None and os.path.getsize(seg.journal_path) == size
        assert seg.committed_gen(off) == (model[off][3] if off in model else None)
    assert _rows(seg.inventory()) == _expected(model)
    damaged = sorted(model)[:: max(1, len(model) // 3)][:2] if model else []
    with open(seg.path, "r+b") as f:
        for off in damaged:  # one byte of the header's key: the block is no longer the one recorded
            f.seek(off + 10)
            f.write(bytes([f.read(1)[0] ^ 1]))
    # The crash: nothing more is written; a new process opens the files.
    seg2 = SsdSegment(tmp_path, 2, slots * stride)
    found, discarded = seg2.recover(verify=bool(seed % 3))
    for off in damaged:
        del model[off]
    assert _rows(found) == _expected(model) and discarded == len(damaged)
    assert seg2.inventory() == found
    assert os.path.getsize(seg2.journal_path) == len(model) * REC_SIZE  # compacted to the live set
    for off, (key, length, csum, g) in model.items():
        assert seg2.holds(off, key, length, g) and seg2.committed_gen(off) == g
        st, out = seg2.read(off, key, length, gen=g)
        assert st.ok and checksum(out) == csum
    for off in range(0, slots * stride, stride):
        if off not in model:
            assert seg2.committed_gen(off) is None
    seg.close()
    seg2.close()


def _small_compaction(init, every: int):  # noqa: ANN001, ANN202
    """SsdSegment.__init__ with journal compaction due after ``every`` records."""

    def wrapped(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(self, *a, **kw)
        self._compact_at = every

    return wrapped


def _rows(blocks) -> list[tuple]:  # noqa: ANN001
    return [(b.offset, b.key, b.length, b.checksum, b.gen) for b in blocks.rows()]


def _expected(model: dict[int, tuple]) -> list[tuple]:
    rows = [(off, key, length, csum, gen) for off, (key, length, csum, gen) in model.items()]
    return sorted(rows, key=lambda r: r[4])
