"""Unit tests for kvstore.extent.scan: a segment's committed extents found as columns, checked
against a one-candidate-at-a-time reference written here from the documented format, and
kvstore.overlap, the newest-wins resolution of overlapping extents."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest

from kvstore.blocks import BlockCols
from kvstore.errors import InvalidArgument
from kvstore.extent import (
    ALIGN,
    CLEARED,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Sealer,
    checksum,
    extent_size,
    parse_fields,
    scan,
)
from tests.unit.test_extent import OTHER, SEALER, SECRET, key, new_segment, payload, write_extent

# ---- scan ---------------------------------------------------------------------------------------


def test_scan_empty_segment_finds_nothing():
    res = scan(new_segment(16), SEALER)
    assert len(res.blocks) == 0 and res.discarded == 0


def test_scan_finds_all_whole_extents_oldest_first():
    seg = new_segment(64)
    written = []
    off = 0
    gens = [5, 2, 9, 1, 7, 3]
    for i, gen in enumerate(gens):
        data = payload(100 + 300 * i, i)
        write_extent(seg, off, key(i), data, gen)
        written.append((off, key(i), data, gen))
        off += extent_size(len(data))
    res = scan(seg, SEALER)
    assert res.discarded == 0
    assert [h.gen for h in res.blocks.rows()] == sorted(gens)
    by_off = {h.offset: h for h in res.blocks.rows()}
    assert set(by_off) == {w[0] for w in written}
    for o, k, data, gen in written:
        h = by_off[o]
        assert h.key == k and h.length == len(data) and h.checksum == checksum(data) and h.gen == gen
        assert bytes(seg[o + HEADER_SIZE : o + HEADER_SIZE + h.length]) == data


def test_scan_with_gaps_between_extents():
    seg = new_segment(32)
    write_extent(seg, 0, key(1), b"a" * 10, 1)
    write_extent(seg, 10 * ALIGN, key(2), b"b" * 1000, 2)
    write_extent(seg, 31 * ALIGN, key(3), b"c" * (ALIGN - HEADER_SIZE), 3)  # fills the last slot exactly
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(0, key(1)), (10 * ALIGN, key(2)), (31 * ALIGN, key(3))]
    assert res.discarded == 0


def test_scan_zero_length_extent():
    seg = new_segment(2)
    write_extent(seg, ALIGN, key(1), b"", 1)
    res = scan(seg, SEALER)
    assert [(h.offset, h.length) for h in res.blocks.rows()] == [(ALIGN, 0)]


def test_scan_discards_flipped_payload_byte_when_verifying():
    seg = new_segment(16)
    write_extent(seg, 0, key(1), payload(500, 1), 1)
    write_extent(seg, 4 * ALIGN, key(2), payload(500, 2), 2)
    seg[4 * ALIGN + HEADER_SIZE + 250] ^= 0xFF
    res = scan(seg, SEALER, verify=True)
    assert [h.key for h in res.blocks.rows()] == [key(1)]
    assert res.discarded == 1
    # Without verification the sealed header alone is trusted.
    res = scan(seg, SEALER, verify=False)
    assert [h.key for h in res.blocks.rows()] == [key(1), key(2)]
    assert res.discarded == 0


def test_scan_discards_payload_not_yet_written():
    """A header committed over a payload that is not the one it describes (here: still zeros)
    is caught by the checksum."""
    seg = new_segment(8)
    data = payload(300, 3)
    seg[0:HEADER_SIZE] = np.frombuffer(SEALER.pack(key(1), len(data), checksum(data), 1, 0), np.uint8)
    res = scan(seg, SEALER)
    assert len(res.blocks) == 0 and res.discarded == 1


def test_scan_does_not_adopt_uncommitted_writes():
    """Bytes that a writer (or anything else that can write the segment) made look like a block,
    without the daemon's seal, are not adopted, even when the payload checksum holds."""
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    data = payload(100, 2)
    forged = struct.pack("<4sHH16sQQQQ", MAGIC, VERSION, 0, key(2), len(data), checksum(data), 2, len(data))
    seg[2 * ALIGN : 2 * ALIGN + HEADER_SIZE] = np.frombuffer(forged + bytes(8), np.uint8)
    seg[2 * ALIGN + HEADER_SIZE : 2 * ALIGN + HEADER_SIZE + len(data)] = np.frombuffer(data, np.uint8)
    # The fields are all there, only the seal is not.
    assert parse_fields(seg, 2 * ALIGN) == (key(2), len(data), checksum(data), 2, 2 * ALIGN, 0, len(data))
    res = scan(seg, SEALER)
    assert [h.key for h in res.blocks.rows()] == [key(1)]
    assert res.discarded == 1


def test_scan_adopts_only_headers_sealed_by_its_sealer():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    write_extent(seg, 2 * ALIGN, key(2), payload(100, 2), 2, sealer=OTHER)
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(0, key(1))]
    assert res.discarded == 1
    res = scan(seg, OTHER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(2 * ALIGN, key(2))]
    assert res.discarded == 1


def test_scan_refuses_a_whole_extent_copied_to_another_offset():
    seg = new_segment(8)
    data = payload(100, 1)
    write_extent(seg, 0, key(1), data, 1)
    seg[4 * ALIGN : 5 * ALIGN] = seg[0:ALIGN]  # header and payload, byte for byte
    assert parse_fields(seg, 4 * ALIGN) is not None
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(0, key(1))]
    assert res.discarded == 1


def test_scan_discards_torn_header():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    # A second write, torn: cleared, payload written, only the first half of its header landed.
    data = payload(100, 2)
    off = 2 * ALIGN
    seg[off : off + HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)
    seg[off + HEADER_SIZE : off + HEADER_SIZE + len(data)] = np.frombuffer(data, np.uint8)
    hdr = SEALER.pack(key(2), len(data), checksum(data), 2, off)
    seg[off : off + 32] = np.frombuffer(hdr[:32], np.uint8)
    res = scan(seg, SEALER)
    assert [h.key for h in res.blocks.rows()] == [key(1)]
    assert res.discarded == 1


def test_scan_cleared_header_is_not_a_candidate():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    seg[0:HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)  # invalidated by the daemon
    res = scan(seg, SEALER)
    assert len(res.blocks) == 0 and res.discarded == 0


def test_scan_discards_extent_running_past_segment_end():
    seg = new_segment(4)
    data = payload(2 * ALIGN, 1)
    # Header at the last slot claims a payload that would run past the end.
    seg[3 * ALIGN : 4 * ALIGN] = np.frombuffer(data[:ALIGN], np.uint8)
    seg[3 * ALIGN : 3 * ALIGN + HEADER_SIZE] = np.frombuffer(
        SEALER.pack(key(1), len(data), checksum(data), 1, 3 * ALIGN), np.uint8
    )
    res = scan(seg, SEALER, verify=False)
    assert len(res.blocks) == 0 and res.discarded == 1


def test_scan_ignores_unaligned_magic():
    seg = new_segment(4)
    raw = SEALER.pack(key(1), 0, checksum(b""), 1, 100)
    seg[100 : 100 + HEADER_SIZE] = np.frombuffer(raw, np.uint8)  # not at an ALIGN boundary
    assert SEALER.parse(seg, 100) is not None
    res = scan(seg, SEALER)
    assert len(res.blocks) == 0 and res.discarded == 0


def test_scan_segment_not_multiple_of_align():
    seg = np.zeros(3 * ALIGN + 100, dtype=np.uint8)
    write_extent(seg, 0, key(1), b"x" * 10, 1)
    write_extent(seg, 3 * ALIGN, key(2), b"y" * 30, 2)  # fits in the trailing 100 bytes
    res = scan(seg, SEALER)
    assert [h.key for h in res.blocks.rows()] == [key(1)]  # only whole ALIGN slots are scanned
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
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(0, key(1))]
    assert res.discarded == 1


def _embedding_payload(inner_key: bytes, inner_data: bytes, inner_gen: int, at: int, total: int) -> bytes:
    """A payload for an extent at offset 0 that carries a whole extent sealed for segment offset ``at``."""
    data = bytearray(payload(total, 99))
    i = at - HEADER_SIZE
    data[i : i + HEADER_SIZE] = SEALER.pack(inner_key, len(inner_data), checksum(inner_data), inner_gen, at)
    data[i + HEADER_SIZE : i + HEADER_SIZE + len(inner_data)] = inner_data
    return bytes(data)


def test_scan_overlap_newer_outer_extent_wins():
    seg = new_segment(16)
    inner = payload(100, 1)
    outer = _embedding_payload(key(1), inner, inner_gen=1, at=2 * ALIGN, total=5 * ALIGN)
    write_extent(seg, 0, key(2), outer, gen=2)
    assert SEALER.parse(seg, 2 * ALIGN) is not None  # a stale but sealed header lies inside
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(0, key(2))]
    assert res.discarded == 1


def test_scan_overlap_newer_inner_extent_wins():
    seg = new_segment(16)
    inner = payload(100, 1)
    outer = _embedding_payload(key(1), inner, inner_gen=10, at=2 * ALIGN, total=5 * ALIGN)
    write_extent(seg, 0, key(2), outer, gen=2)
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.blocks.rows()] == [(2 * ALIGN, key(1))]
    assert res.discarded == 1


def test_scan_stale_header_after_reuse_resolved_by_gen():
    """A long extent (whose payload carries a sealed header at 4A) is overwritten at its start by
    two newer, shorter extents: the newer ones win where they overlap, and the stale header at
    4A, which overlaps nothing newer, is found again."""
    seg = new_segment(32)
    old_inner = payload(50, 7)
    old = _embedding_payload(key(3), old_inner, inner_gen=3, at=4 * ALIGN, total=8 * ALIGN)
    write_extent(seg, 0, key(1), old, gen=4)
    # Newer, shorter extents reuse [0, 2A) and [2A, 3A): the old header at 0 is replaced.
    write_extent(seg, 0, key(5), payload(300, 5), gen=5)
    write_extent(seg, 2 * ALIGN, key(6), payload(100, 6), gen=6)
    res = scan(seg, SEALER, verify=False)
    got = {(h.offset, h.key) for h in res.blocks.rows()}
    # The old embedded extent at 4A (gen 3) overlaps nothing newer, so it survives.
    assert got == {(0, key(5)), (2 * ALIGN, key(6)), (4 * ALIGN, key(3))}
    assert [h.gen for h in res.blocks.rows()] == [3, 5, 6]


def test_scan_many_random_extents_round_trip():
    rng = random.Random(11)
    seg = new_segment(512)
    off = 0
    expect = {}
    gen = 0
    while True:
        n = rng.randrange(0, 3000)
        if off + extent_size(n) > seg.size:
            break
        gen += 1
        data = rng.randbytes(n)
        write_extent(seg, off, key(gen), data, gen)
        expect[off] = (key(gen), n, checksum(data), gen)
        off += extent_size(n) + ALIGN * rng.randrange(0, 3)
    res = scan(seg, SEALER)
    assert res.discarded == 0
    assert {h.offset: (h.key, h.length, h.checksum, h.gen) for h in res.blocks.rows()} == expect


def test_scan_returns_columns_that_pack_into_an_inventory():
    seg = new_segment(16)
    write_extent(seg, 0, key(1), payload(300, 1), 7)
    write_extent(seg, 4 * ALIGN, key(2), payload(10, 2), 3)
    blocks = scan(seg, SEALER).blocks
    assert blocks.keys.dtype == np.uint8 and blocks.keys.shape == (2, 16)
    assert all(getattr(blocks, f).dtype == np.dtype("<u8") for f in BlockCols.FIELDS)
    assert blocks.offset.tolist() == [4 * ALIGN, 0] and blocks.size.tolist() == [ALIGN, 2 * ALIGN]
    msg = blocks.to_pb(5)
    assert msg.segment_id == 5 and msg.keys == key(2) + key(1) and msg.size == b""
    assert np.frombuffer(msg.gen, "<u8").tolist() == [3, 7]
    assert np.frombuffer(msg.length, "<u8").tolist() == [10, 300]
    assert np.frombuffer(msg.checksum, "<u8").tolist() == [checksum(payload(10, 2)), checksum(payload(300, 1))]


def test_scan_refuses_what_is_not_a_segment():
    with pytest.raises(InvalidArgument):
        scan(np.zeros(4 * ALIGN, np.uint16), SEALER)
    with pytest.raises(InvalidArgument):
        scan(np.zeros((4, ALIGN), np.uint8), SEALER)
    with pytest.raises(InvalidArgument):
        scan(np.zeros(8 * ALIGN, np.uint8)[::2], SEALER)


def _header_only(seg: np.ndarray, off: int, k: bytes, length: int, gen: int, sealer: Sealer = SEALER) -> None:
    """A sealed header claiming ``length`` bytes whose payload was never written: the slots it
    covers keep what they held (a stale header, say)."""
    seg[off : off + HEADER_SIZE] = np.frombuffer(sealer.pack(k, length, 0, gen, off), np.uint8)


def test_scan_overlapping_stale_headers_newest_claims_first():
    """A (gen 5) covers slots 0-3, B (gen 9) sits at slot 1 inside it, C (gen 2) at slot 3.
    B is newest and is kept; A overlaps B and goes; C overlapped only A, which is not kept, so
    C stays: a dropped extent blocks nothing."""
    seg = new_segment(16)
    _header_only(seg, 3 * ALIGN, key(3), ALIGN, gen=2)  # C: slots 3-4
    _header_only(seg, ALIGN, key(2), 10, gen=9)  # B: slot 1
    _header_only(seg, 0, key(1), 3 * ALIGN, gen=5)  # A: slots 0-3
    res = scan(seg, SEALER, verify=False)
    assert [(b.offset, b.key) for b in res.blocks.rows()] == [(3 * ALIGN, key(3)), (ALIGN, key(2))]
    assert res.discarded == 1


def test_scan_equal_generations_keep_the_lower_offset_first():
    seg = new_segment(16)
    _header_only(seg, 2 * ALIGN, key(2), 2 * ALIGN, gen=4)  # slots 2-4
    _header_only(seg, 4 * ALIGN, key(3), 10, gen=4)  # slot 4: same generation, overlaps the first
    _header_only(seg, 8 * ALIGN, key(4), 10, gen=4)
    res = scan(seg, SEALER, verify=False)
    assert [b.offset for b in res.blocks.rows()] == [2 * ALIGN, 8 * ALIGN] and res.discarded == 1


def test_scan_bad_seal_is_discarded_and_the_same_bytes_sealed_are_found():
    seg = new_segment(8)
    write_extent(seg, 2 * ALIGN, key(1), payload(100, 1), 3)
    seg[2 * ALIGN + 60] ^= 0x01  # one bit of the seal
    res = scan(seg, SEALER)
    assert len(res.blocks) == 0 and res.discarded == 1
    seg[2 * ALIGN + 60] ^= 0x01
    assert scan(seg, SEALER).blocks.key_bytes() == [key(1)]


def test_scan_truncated_extent_in_a_ragged_segment():
    """An extent whose payload runs past the segment's end is discarded, even when its header
    sits in the last whole slot; one that ends inside the ragged tail is whole."""
    seg = np.zeros(4 * ALIGN + 100, np.uint8)
    write_extent(seg, 3 * ALIGN, key(1), payload(ALIGN - HEADER_SIZE + 100, 1), 1)  # ends at the last byte
    assert scan(seg, SEALER).blocks.key_bytes() == [key(1)]
    _header_only(seg, 3 * ALIGN, key(1), ALIGN - HEADER_SIZE + 101, 2)  # one byte past the end
    res = scan(seg, SEALER, verify=False)
    assert len(res.blocks) == 0 and res.discarded == 1


def test_scan_does_not_adopt_a_sealed_header_of_the_wrong_version_or_with_flags():
    seg = new_segment(8)
    for i, (version, flags) in enumerate([(VERSION + 1, 0), (VERSION, 1), (VERSION, 0)]):
        body = struct.pack("<4sHH16sQQQQ", MAGIC, version, flags, key(i), 0, checksum(b""), 1, 0)
        sealed = body + hashlib.blake2b(body + struct.pack("<Q", 2 * i * ALIGN), key=SECRET, digest_size=8).digest()
        seg[2 * i * ALIGN : 2 * i * ALIGN + HEADER_SIZE] = np.frombuffer(sealed, np.uint8)
    res = scan(seg, SEALER)
    assert res.blocks.key_bytes() == [key(2)] and res.discarded == 2
    assert parse_fields(seg, 0) is None and parse_fields(seg, 2 * ALIGN) is not None
