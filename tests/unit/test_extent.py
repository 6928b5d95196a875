"""Unit tests for kvstore.extent: the self-describing header and the segment scan."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import xxhash

from kvstore import extent
from kvstore.extent import ALIGN, CLEARED, HEADER_SIZE, MAGIC, checksum, extent_size, pack_header, parse_header, scan


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def write_extent(seg: np.ndarray, off: int, k: bytes, data: bytes, seq: int) -> None:
    """The documented writer protocol: clear the magic, write the payload, then the header."""
    assert off % ALIGN == 0
    seg[off : off + HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)
    seg[off + HEADER_SIZE : off + HEADER_SIZE + len(data)] = np.frombuffer(data, np.uint8)
    seg[off : off + HEADER_SIZE] = np.frombuffer(pack_header(k, len(data), checksum(data), seq), np.uint8)


def new_segment(n_align: int) -> np.ndarray:
    return np.zeros(n_align * ALIGN, dtype=np.uint8)


# ---- header -------------------------------------------------------------------------------------


def test_constants():
    assert HEADER_SIZE == 64
    assert ALIGN % 4 == 0
    assert len(CLEARED) == HEADER_SIZE and not any(CLEARED)
    assert MAGIC == b"KVB1"


@pytest.mark.parametrize(
    ("length", "size"),
    [(0, ALIGN), (1, ALIGN), (ALIGN - HEADER_SIZE, ALIGN), (ALIGN - HEADER_SIZE + 1, 2 * ALIGN), (4096, 4096 + ALIGN)],
)
def test_extent_size(length, size):
    assert extent_size(length) == size
    assert extent_size(length) % ALIGN == 0
    assert extent_size(length) >= HEADER_SIZE + length


def test_pack_parse_round_trip():
    k = key(0xDEADBEEF)
    raw = pack_header(k, 12345, 0xFFFF_FFFF_FFFF_FFFF, seq=987654321, flags=3)
    assert len(raw) == HEADER_SIZE
    assert raw[:4] == MAGIC
    h = parse_header(raw)
    assert h is not None
    assert h.key == k
    assert h.length == 12345
    assert h.checksum == 0xFFFF_FFFF_FFFF_FFFF
    assert h.seq == 987654321
    assert h.flags == 3
    assert h.offset == 0


def test_parse_at_offset_reports_offset():
    buf = bytearray(3 * ALIGN)
    raw = pack_header(key(5), 10, 42, seq=7)
    buf[ALIGN : ALIGN + HEADER_SIZE] = raw
    h = parse_header(buf, ALIGN)
    assert h is not None and h.offset == ALIGN and h.key == key(5) and h.seq == 7
    assert parse_header(buf, 0) is None


def test_pack_default_seq_is_increasing_time():
    a = parse_header(pack_header(key(1), 1, 1))
    b = parse_header(pack_header(key(1), 1, 1))
    assert a is not None and b is not None
    assert a.seq > 0 and b.seq >= a.seq


def test_parse_accepts_numpy_buffer():
    seg = new_segment(2)
    write_extent(seg, ALIGN, key(9), b"hello", seq=1)
    h = parse_header(seg, ALIGN)
    assert h is not None and h.key == key(9) and h.length == 5 and h.checksum == checksum(b"hello")


@pytest.mark.parametrize("pos", range(HEADER_SIZE))
def test_header_crc_detects_any_flipped_byte(pos):
    raw = bytearray(pack_header(key(1), 1000, 77, seq=5))
    raw[pos] ^= 0x01
    assert parse_header(bytes(raw)) is None


def test_parse_refuses_short_buffer():
    raw = pack_header(key(1), 10, 1, seq=1)
    assert parse_header(raw[:-1]) is None
    assert parse_header(b"") is None


def test_parse_refuses_cleared_header():
    assert parse_header(CLEARED) is None


def test_parse_refuses_other_version_even_with_valid_crc():
    body = struct.pack("<4sHH16sQQQQ4x", MAGIC, 2, 0, key(1), 10, 1, 1, 10)
    raw = body + struct.pack("<I", xxhash.xxh32_intdigest(body))
    assert parse_header(raw) is None
    # The same bytes with version 1 are accepted (so it is the version that was refused).
    body1 = struct.pack("<4sHH16sQQQQ4x", MAGIC, 1, 0, key(1), 10, 1, 1, 10)
    assert parse_header(body1 + struct.pack("<I", xxhash.xxh32_intdigest(body1))) is not None


def test_checksum_is_xxh3_64_and_accepts_buffers():
    data = payload(1000, 1)
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    assert checksum(np.frombuffer(data, np.uint8)) == checksum(data)
    assert checksum(memoryview(data)) == checksum(data)
    flipped = bytearray(data)
    flipped[500] ^= 0x80
    assert checksum(bytes(flipped)) != checksum(data)


# ---- scan ---------------------------------------------------------------------------------------


def test_scan_empty_segment_finds_nothing():
    res = scan(new_segment(16))
    assert res.extents == [] and res.discarded == 0


def test_scan_finds_all_whole_extents_oldest_first():
    seg = new_segment(64)
    written = []
    off = 0
    seqs = [5, 2, 9, 1, 7, 3]
    for i, seq in enumerate(seqs):
        data = payload(100 + 300 * i, i)
        write_extent(seg, off, key(i), data, seq)
        written.append((off, key(i), data, seq))
        off += extent_size(len(data))
    res = scan(seg)
    assert res.discarded == 0
    assert [h.seq for h in res.extents] == sorted(seqs)
    by_off = {h.offset: h for h in res.extents}
    assert set(by_off) == {w[0] for w in written}
    for o, k, data, seq in written:
        h = by_off[o]
        assert h.key == k and h.length == len(data) and h.checksum == checksum(data) and h.seq == seq
        assert bytes(seg[o + HEADER_SIZE : o + HEADER_SIZE + h.length]) == data


def test_scan_with_gaps_between_extents():
    seg = new_segment(32)
    write_extent(seg, 0, key(1), b"a" * 10, 1)
    write_extent(seg, 10 * ALIGN, key(2), b"b" * 1000, 2)
    write_extent(seg, 31 * ALIGN, key(3), b"c" * (ALIGN - HEADER_SIZE), 3)  # fills the last slot exactly
    res = scan(seg)
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(1)), (10 * ALIGN, key(2)), (31 * ALIGN, key(3))]
    assert res.discarded == 0


def test_scan_zero_length_extent():
    seg = new_segment(2)
    write_extent(seg, ALIGN, key(1), b"", 1)
    res = scan(seg)
    assert [(h.offset, h.length) for h in res.extents] == [(ALIGN, 0)]


def test_scan_discards_flipped_payload_byte_when_verifying():
    seg = new_segment(16)
    write_extent(seg, 0, key(1), payload(500, 1), 1)
    write_extent(seg, 4 * ALIGN, key(2), payload(500, 2), 2)
    seg[4 * ALIGN + HEADER_SIZE + 250] ^= 0xFF
    res = scan(seg, verify=True)
    assert [h.key for h in res.extents] == [key(1)]
    assert res.discarded == 1
    # Without verification the header alone is trusted.
    res = scan(seg, verify=False)
    assert [h.key for h in res.extents] == [key(1), key(2)]
    assert res.discarded == 0


def test_scan_discards_payload_not_yet_written():
    """A writer that crashed after the header of a previous block was cleared leaves no valid extent;
    one that wrote a header whose payload is stale is caught by the checksum."""
    seg = new_segment(8)
    data = payload(300, 3)
    seg[0:HEADER_SIZE] = np.frombuffer(pack_header(key(1), len(data), checksum(data), 1), np.uint8)
    res = scan(seg)  # payload bytes are still zeros
    assert res.extents == [] and res.discarded == 1


def test_scan_discards_torn_header():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    # A second write, torn: cleared, payload written, only the first half of its header landed.
    data = payload(100, 2)
    off = 2 * ALIGN
    seg[off : off + HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)
    seg[off + HEADER_SIZE : off + HEADER_SIZE + len(data)] = np.frombuffer(data, np.uint8)
    hdr = pack_header(key(2), len(data), checksum(data), 2)
    seg[off : off + 32] = np.frombuffer(hdr[:32], np.uint8)
    res = scan(seg)
    assert [h.key for h in res.extents] == [key(1)]
    assert res.discarded == 1


def test_scan_cleared_header_is_not_a_candidate():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    seg[0:HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)  # invalidated by the daemon
    res = scan(seg)
    assert res.extents == [] and res.discarded == 0


def test_scan_discards_extent_running_past_segment_end():
    seg = new_segment(4)
    data = payload(2 * ALIGN, 1)
    # Header at the last slot claims a payload that would run past the end.
    seg[3 * ALIGN : 4 * ALIGN] = np.frombuffer(data[:ALIGN], np.uint8)
    seg[3 * ALIGN : 3 * ALIGN + HEADER_SIZE] = np.frombuffer(
        pack_header(key(1), len(data), checksum(data), 1), np.uint8
    )
    res = scan(seg, verify=False)
    assert res.extents == [] and res.discarded == 1


def test_scan_ignores_unaligned_magic():
    seg = new_segment(4)
    raw = pack_header(key(1), 0, checksum(b""), 1)
    seg[100 : 100 + HEADER_SIZE] = np.frombuffer(raw, np.uint8)  # not at an ALIGN boundary
    res = scan(seg)
    assert res.extents == [] and res.discarded == 0


def test_scan_segment_not_multiple_of_align():
    seg = np.zeros(3 * ALIGN + 100, dtype=np.uint8)
    write_extent(seg, 0, key(1), b"x" * 10, 1)
    write_extent(seg, 3 * ALIGN, key(2), b"y" * 30, 2)  # fits in the trailing 100 bytes
    res = scan(seg)
    assert [h.key for h in res.extents] == [key(1)]  # only whole ALIGN slots are scanned
    assert res.discarded == 0


def test_scan_ignores_magic_in_payload_that_is_not_a_header():
    seg = new_segment(8)
    data = bytearray(payload(3 * ALIGN, 5))
    # The payload starts at HEADER_SIZE, so payload index ALIGN - HEADER_SIZE lands on offset ALIGN.
    i = ALIGN - HEADER_SIZE
    data[i : i + 4] = MAGIC
    data = bytes(data)
    write_extent(seg, 0, key(1), data, 1)
    assert bytes(seg[ALIGN : ALIGN + 4]) == MAGIC
    res = scan(seg)
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(1))]
    assert res.discarded == 1


def _embedding_payload(inner_key: bytes, inner_data: bytes, inner_seq: int, at: int, total: int) -> bytes:
    """A payload for an extent at offset 0 that carries a whole, valid extent at segment offset ``at``."""
    data = bytearray(payload(total, 99))
    i = at - HEADER_SIZE
    data[i : i + HEADER_SIZE] = pack_header(inner_key, len(inner_data), checksum(inner_data), inner_seq)
    data[i + HEADER_SIZE : i + HEADER_SIZE + len(inner_data)] = inner_data
    return bytes(data)


def test_scan_overlap_newer_outer_extent_wins():
    seg = new_segment(16)
    inner = payload(100, 1)
    outer = _embedding_payload(key(1), inner, inner_seq=1, at=2 * ALIGN, total=5 * ALIGN)
    write_extent(seg, 0, key(2), outer, seq=2)
    assert parse_header(seg, 2 * ALIGN) is not None  # a stale but valid header lies inside
    res = scan(seg)
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(2))]
    assert res.discarded == 1


def test_scan_overlap_newer_inner_extent_wins():
    seg = new_segment(16)
    inner = payload(100, 1)
    outer = _embedding_payload(key(1), inner, inner_seq=10, at=2 * ALIGN, total=5 * ALIGN)
    write_extent(seg, 0, key(2), outer, seq=2)
    res = scan(seg)
    assert [(h.offset, h.key) for h in res.extents] == [(2 * ALIGN, key(1))]
    assert res.discarded == 1


def test_scan_stale_header_after_reuse_resolved_by_seq():
    """A long extent (whose payload carries a valid header at 4A) is overwritten at its start by
    two newer, shorter extents: the newer ones win where they overlap, and the stale header at
    4A, which overlaps nothing newer, is found again."""
    seg = new_segment(32)
    old_inner = payload(50, 7)
    old = _embedding_payload(key(3), old_inner, inner_seq=3, at=4 * ALIGN, total=8 * ALIGN)
    write_extent(seg, 0, key(1), old, seq=4)
    # Newer, shorter extents reuse [0, 2A) and [2A, 3A): the old header at 0 is replaced.
    write_extent(seg, 0, key(5), payload(300, 5), seq=5)
    write_extent(seg, 2 * ALIGN, key(6), payload(100, 6), seq=6)
    res = scan(seg, verify=False)
    got = {(h.offset, h.key) for h in res.extents}
    # The old embedded extent at 4A (seq 3) overlaps nothing newer, so it survives.
    assert got == {(0, key(5)), (2 * ALIGN, key(6)), (4 * ALIGN, key(3))}
    assert [h.seq for h in res.extents] == [3, 5, 6]


def test_scan_many_random_extents_round_trip():
    rng = random.Random(11)
    seg = new_segment(512)
    off = 0
    expect = {}
    seq = 0
    while True:
        n = rng.randrange(0, 3000)
        if off + extent_size(n) > seg.size:
            break
        seq += 1
        data = rng.randbytes(n)
        write_extent(seg, off, key(seq), data, seq)
        expect[off] = (key(seq), n, checksum(data))
        off += extent_size(n) + ALIGN * rng.randrange(0, 3)
    res = scan(seg)
    assert res.discarded == 0
    assert {h.offset: (h.key, h.length, h.checksum) for h in res.extents} == expect


def test_module_header_layout_is_64_bytes():
    assert extent._HEADER.size + 4 == HEADER_SIZE
