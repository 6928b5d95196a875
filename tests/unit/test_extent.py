"""Unit tests for kvstore.extent: the sealed self-describing header and the segment scan."""

from __future__ import annotations

import hashlib
import random
import stat
import struct

import numpy as np
import pytest
import xxhash

from kvstore import extent
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

SECRET = bytes(range(32))
SEALER = Sealer(SECRET)
OTHER = Sealer(bytes(range(1, 33)))  # another daemon's secret


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def seal(body: bytes, offset: int, secret: bytes = SECRET) -> bytes:
    """The documented seal, computed independently: keyed blake2b-64 of the 56 header bytes and
    the extent's offset (u64 little-endian)."""
    return hashlib.blake2b(body + struct.pack("<Q", offset), key=secret, digest_size=8).digest()


def write_extent(seg: np.ndarray, off: int, k: bytes, data: bytes, gen: int, sealer: Sealer = SEALER) -> None:
    """The documented protocol: the writer moves the payload bytes (after the old header was
    cleared), then the daemon commits by writing the header sealed for this offset."""
    assert off % ALIGN == 0
    seg[off : off + HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)
    seg[off + HEADER_SIZE : off + HEADER_SIZE + len(data)] = np.frombuffer(data, np.uint8)
    seg[off : off + HEADER_SIZE] = np.frombuffer(sealer.pack(k, len(data), checksum(data), gen, off), np.uint8)


def new_segment(n_align: int) -> np.ndarray:
    return np.zeros(n_align * ALIGN, dtype=np.uint8)


# ---- header -------------------------------------------------------------------------------------


def test_constants():
    assert HEADER_SIZE == 64
    assert ALIGN % 4 == 0
    assert len(CLEARED) == HEADER_SIZE and not any(CLEARED)
    assert MAGIC == b"KVB1"
    assert VERSION == 2


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
    raw = SEALER.pack(k, 12345, 0xFFFF_FFFF_FFFF_FFFF, gen=987654321, offset=0, flags=3, raw_length=99999)
    assert len(raw) == HEADER_SIZE
    assert raw[:4] == MAGIC
    h = SEALER.parse(raw)
    assert h is not None
    assert h.key == k
    assert h.length == 12345
    assert h.checksum == 0xFFFF_FFFF_FFFF_FFFF
    assert h.gen == 987654321
    assert h.flags == 3
    assert h.raw_length == 99999
    assert h.offset == 0
    # raw_length defaults to the stored length.
    h = SEALER.parse(SEALER.pack(k, 77, 1, gen=1, offset=0))
    assert h is not None and h.raw_length == 77 and h.flags == 0


def test_seal_is_keyed_blake2b_of_the_header_and_its_offset():
    raw = SEALER.pack(key(3), 10, 42, gen=5, offset=7 * ALIGN)
    assert raw[56:] == seal(raw[:56], 7 * ALIGN)
    assert raw[56:] != seal(raw[:56], 0)
    assert raw[56:] != seal(raw[:56], 7 * ALIGN, secret=bytes(32))


def test_parse_at_offset_reports_offset():
    buf = bytearray(3 * ALIGN)
    buf[ALIGN : ALIGN + HEADER_SIZE] = SEALER.pack(key(5), 10, 42, gen=7, offset=ALIGN)
    h = SEALER.parse(buf, ALIGN)
    assert h is not None and h.offset == ALIGN and h.key == key(5) and h.gen == 7
    assert SEALER.parse(buf, 0) is None


@pytest.mark.parametrize("gen", [1, 2**63 + 12345, 2**64 - 1])
def test_gen_round_trips_and_is_sealed(gen):
    raw = SEALER.pack(key(1), 1, 1, gen=gen, offset=0)
    h = SEALER.parse(raw)
    assert h is not None and h.gen == gen
    # The gen is covered by the seal: the same header with another gen is refused.
    body = bytearray(raw[:56])
    struct.pack_into("<Q", body, 40, gen ^ 1)
    assert parse_fields(bytes(body) + raw[56:]).gen == gen ^ 1
    assert SEALER.parse(bytes(body) + raw[56:]) is None


def test_parse_accepts_numpy_buffer():
    seg = new_segment(2)
    write_extent(seg, ALIGN, key(9), b"hello", gen=1)
    h = SEALER.parse(seg, ALIGN)
    assert h is not None and h.key == key(9) and h.length == 5 and h.checksum == checksum(b"hello")


@pytest.mark.parametrize("pos", range(HEADER_SIZE))
def test_seal_detects_any_flipped_byte(pos):
    raw = bytearray(SEALER.pack(key(1), 1000, 77, gen=5, offset=0))
    assert SEALER.parse(bytes(raw)) is not None
    raw[pos] ^= 0x01
    assert SEALER.parse(bytes(raw)) is None


def test_header_sealed_with_another_secret_is_refused():
    raw = OTHER.pack(key(1), 10, 1, gen=1, offset=0)
    assert OTHER.parse(raw) is not None
    assert SEALER.parse(raw) is None


def test_remembered_headers_are_bounded_and_answer_as_a_fresh_check():
    """A Sealer remembers the headers it sealed or checked (bytes and offset), at most
    _KNOWN_MAX of them; a remembered header is still refused at another offset or with a
    byte changed."""
    sealer = Sealer(SECRET)
    raws = [sealer.pack(key(i), 10, i, gen=i + 1, offset=i * ALIGN) for i in range(extent._KNOWN_MAX + 10)]
    assert len(sealer._known) <= extent._KNOWN_MAX
    for i in (0, 5, len(raws) - 1):
        h = sealer.parse(raws[i], 0, at=i * ALIGN)
        assert h == Sealer(SECRET).parse(raws[i], 0, at=i * ALIGN) and h is not None and h.key == key(i)
        assert sealer.parse(raws[i], 0, at=(i + 1) * ALIGN) is None
        bad = bytearray(raws[i])
        bad[20] ^= 1
        assert sealer.parse(bytes(bad), 0, at=i * ALIGN) is None


def test_a_remembered_header_is_what_was_packed():
    """A key shorter than 16 bytes is packed padded: the Sealer remembers it as packed."""
    sealer = Sealer(SECRET)
    raw = sealer.pack(b"abc", 10, 1, gen=2, offset=ALIGN)
    assert sealer.parse(raw, 0, at=ALIGN) == Sealer(SECRET).parse(raw, 0, at=ALIGN)
    assert sealer.parse(raw, 0, at=ALIGN).key == b"abc" + bytes(13)


def test_header_copied_to_another_offset_is_refused():
    """The seal binds the offset: a valid header copied elsewhere does not describe a block there."""
    buf = bytearray(4 * ALIGN)
    raw = SEALER.pack(key(1), 10, 1, gen=1, offset=ALIGN)
    buf[ALIGN : ALIGN + HEADER_SIZE] = raw
    buf[3 * ALIGN : 3 * ALIGN + HEADER_SIZE] = raw
    assert SEALER.parse(buf, ALIGN) is not None
    assert SEALER.parse(buf, 3 * ALIGN) is None
    # A copy of the header (as a reader makes one) is checked against the offset it was sealed for.
    h = SEALER.parse(raw, 0, at=ALIGN)
    assert h is not None and h.offset == ALIGN and h.key == key(1)
    assert SEALER.parse(raw, 0, at=3 * ALIGN) is None
    assert SEALER.parse(raw) is None


def test_parse_fields_reads_without_the_secret():
    raw = SEALER.pack(key(4), 300, 0xABCDEF, gen=12, offset=2 * ALIGN, flags=1, raw_length=900)
    buf = bytearray(3 * ALIGN)
    buf[2 * ALIGN : 2 * ALIGN + HEADER_SIZE] = raw
    h = parse_fields(buf, 2 * ALIGN)
    assert h == SEALER.parse(buf, 2 * ALIGN)
    assert (h.key, h.length, h.checksum, h.gen, h.offset, h.flags, h.raw_length) == (
        key(4), 300, 0xABCDEF, 12, 2 * ALIGN, 1, 900,
    )  # fmt: skip
    # The seal is not checked: another daemon's header, or one copied elsewhere, still parses.
    assert parse_fields(OTHER.pack(key(4), 1, 1, gen=1, offset=0)) is not None
    assert parse_fields(raw).offset == 0
    # Magic, version and length are.
    assert parse_fields(CLEARED) is None
    assert parse_fields(raw[:-1]) is None
    body = bytearray(raw[:56])
    struct.pack_into("<H", body, 4, VERSION + 1)
    assert parse_fields(bytes(body) + raw[56:]) is None


def test_parse_refuses_short_buffer():
    raw = SEALER.pack(key(1), 10, 1, gen=1, offset=0)
    assert SEALER.parse(raw[:-1]) is None
    assert SEALER.parse(b"") is None


def test_parse_refuses_cleared_header():
    assert SEALER.parse(CLEARED) is None


@pytest.mark.parametrize("version", [1, VERSION + 1])
def test_parse_refuses_other_version_even_with_valid_seal(version):
    body = struct.pack("<4sHH16sQQQQ", MAGIC, version, 0, key(1), 10, 1, 1, 10)
    assert SEALER.parse(body + seal(body, 0)) is None
    assert parse_fields(body + seal(body, 0)) is None
    # The same bytes with the current version are accepted (so it is the version that was refused).
    body2 = struct.pack("<4sHH16sQQQQ", MAGIC, VERSION, 0, key(1), 10, 1, 1, 10)
    assert SEALER.parse(body2 + seal(body2, 0)) is not None


def test_sealer_refuses_a_short_secret():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Sealer(b"x" * 15)


def test_load_or_create_makes_a_private_secret_stable_across_calls(tmp_path):
    path = tmp_path / "daemon.secret"
    a = Sealer.load_or_create(path)
    assert path.stat().st_size == extent.SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_bytes()
    b = Sealer.load_or_create(path)
    assert path.read_bytes() == secret  # not rewritten
    raw = a.pack(key(1), 10, 1, gen=3, offset=ALIGN)
    assert b.parse(raw, 0, at=ALIGN) is not None  # the same secret: blocks survive a restart
    c = Sealer.load_or_create(tmp_path / "other.secret")
    assert c.parse(raw, 0, at=ALIGN) is None  # fresh random bytes elsewhere
    assert Sealer(secret).parse(raw, 0, at=ALIGN) is not None


def test_load_or_create_refuses_a_damaged_secret_file(tmp_path):
    path = tmp_path / "daemon.secret"
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="32-byte secret"):
        Sealer.load_or_create(path)
    assert path.read_bytes() == b"short"  # never replaced: old blocks would silently be lost


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
    res = scan(new_segment(16), SEALER)
    assert res.extents == [] and res.discarded == 0


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
    assert [h.gen for h in res.extents] == sorted(gens)
    by_off = {h.offset: h for h in res.extents}
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
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(1)), (10 * ALIGN, key(2)), (31 * ALIGN, key(3))]
    assert res.discarded == 0


def test_scan_zero_length_extent():
    seg = new_segment(2)
    write_extent(seg, ALIGN, key(1), b"", 1)
    res = scan(seg, SEALER)
    assert [(h.offset, h.length) for h in res.extents] == [(ALIGN, 0)]


def test_scan_discards_flipped_payload_byte_when_verifying():
    seg = new_segment(16)
    write_extent(seg, 0, key(1), payload(500, 1), 1)
    write_extent(seg, 4 * ALIGN, key(2), payload(500, 2), 2)
    seg[4 * ALIGN + HEADER_SIZE + 250] ^= 0xFF
    res = scan(seg, SEALER, verify=True)
    assert [h.key for h in res.extents] == [key(1)]
    assert res.discarded == 1
    # Without verification the sealed header alone is trusted.
    res = scan(seg, SEALER, verify=False)
    assert [h.key for h in res.extents] == [key(1), key(2)]
    assert res.discarded == 0


def test_scan_discards_payload_not_yet_written():
    """A header committed over a payload that is not the one it describes (here: still zeros)
    is caught by the checksum."""
    seg = new_segment(8)
    data = payload(300, 3)
    seg[0:HEADER_SIZE] = np.frombuffer(SEALER.pack(key(1), len(data), checksum(data), 1, 0), np.uint8)
    res = scan(seg, SEALER)
    assert res.extents == [] and res.discarded == 1


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
    assert [h.key for h in res.extents] == [key(1)]
    assert res.discarded == 1


def test_scan_adopts_only_headers_sealed_by_its_sealer():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    write_extent(seg, 2 * ALIGN, key(2), payload(100, 2), 2, sealer=OTHER)
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(1))]
    assert res.discarded == 1
    res = scan(seg, OTHER)
    assert [(h.offset, h.key) for h in res.extents] == [(2 * ALIGN, key(2))]
    assert res.discarded == 1


def test_scan_refuses_a_whole_extent_copied_to_another_offset():
    seg = new_segment(8)
    data = payload(100, 1)
    write_extent(seg, 0, key(1), data, 1)
    seg[4 * ALIGN : 5 * ALIGN] = seg[0:ALIGN]  # header and payload, byte for byte
    assert parse_fields(seg, 4 * ALIGN) is not None
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(1))]
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
    assert [h.key for h in res.extents] == [key(1)]
    assert res.discarded == 1


def test_scan_cleared_header_is_not_a_candidate():
    seg = new_segment(8)
    write_extent(seg, 0, key(1), payload(100, 1), 1)
    seg[0:HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)  # invalidated by the daemon
    res = scan(seg, SEALER)
    assert res.extents == [] and res.discarded == 0


def test_scan_discards_extent_running_past_segment_end():
    seg = new_segment(4)
    data = payload(2 * ALIGN, 1)
    # Header at the last slot claims a payload that would run past the end.
    seg[3 * ALIGN : 4 * ALIGN] = np.frombuffer(data[:ALIGN], np.uint8)
    seg[3 * ALIGN : 3 * ALIGN + HEADER_SIZE] = np.frombuffer(
        SEALER.pack(key(1), len(data), checksum(data), 1, 3 * ALIGN), np.uint8
    )
    res = scan(seg, SEALER, verify=False)
    assert res.extents == [] and res.discarded == 1


def test_scan_ignores_unaligned_magic():
    seg = new_segment(4)
    raw = SEALER.pack(key(1), 0, checksum(b""), 1, 100)
    seg[100 : 100 + HEADER_SIZE] = np.frombuffer(raw, np.uint8)  # not at an ALIGN boundary
    assert SEALER.parse(seg, 100) is not None
    res = scan(seg, SEALER)
    assert res.extents == [] and res.discarded == 0


def test_scan_segment_not_multiple_of_align():
    seg = np.zeros(3 * ALIGN + 100, dtype=np.uint8)
    write_extent(seg, 0, key(1), b"x" * 10, 1)
    write_extent(seg, 3 * ALIGN, key(2), b"y" * 30, 2)  # fits in the trailing 100 bytes
    res = scan(seg, SEALER)
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
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(1))]
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
    assert [(h.offset, h.key) for h in res.extents] == [(0, key(2))]
    assert res.discarded == 1


def test_scan_overlap_newer_inner_extent_wins():
    seg = new_segment(16)
    inner = payload(100, 1)
    outer = _embedding_payload(key(1), inner, inner_gen=10, at=2 * ALIGN, total=5 * ALIGN)
    write_extent(seg, 0, key(2), outer, gen=2)
    res = scan(seg, SEALER)
    assert [(h.offset, h.key) for h in res.extents] == [(2 * ALIGN, key(1))]
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
    got = {(h.offset, h.key) for h in res.extents}
    # The old embedded extent at 4A (gen 3) overlaps nothing newer, so it survives.
    assert got == {(0, key(5)), (2 * ALIGN, key(6)), (4 * ALIGN, key(3))}
    assert [h.gen for h in res.extents] == [3, 5, 6]


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
    assert {h.offset: (h.key, h.length, h.checksum, h.gen) for h in res.extents} == expect


def test_module_header_layout_is_64_bytes():
    assert extent._HEADER.size + extent._SEAL.size == HEADER_SIZE
    assert extent._HEADER.size == 56
