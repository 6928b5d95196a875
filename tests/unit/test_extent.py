"""Unit tests for kvstore.extent: the sealed self-describing header, and the batches that check and
make many of them at once (kvstore.batch). The segment scan: test_extent_scan.py."""

from __future__ import annotations

import hashlib
import random
import stat
import struct
import time

import numpy as np
import pytest
import xxhash

from kvstore import batch, extent
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


def test_module_header_layout_is_64_bytes():
    assert extent._HEADER.size + extent._SEAL.size == HEADER_SIZE
    assert extent._HEADER.size == 56


# ---- many headers and payloads at once (kvstore.batch) -------------------------------------------

NATIVE = pytest.mark.skipif(batch._impl is None, reason="the native module was not built")


@pytest.mark.parametrize("width", [1, 56, 64, 100, 128])
@pytest.mark.parametrize("key_len", [1, 32, 64])
def test_numpy_blake2b_is_hashlibs_keyed_blake2b(width, key_len):
    rng = np.random.default_rng(width * key_len)
    k = rng.integers(0, 256, key_len, dtype=np.uint8).tobytes()
    msgs = rng.integers(0, 256, (50, width), dtype=np.uint8)
    want = [int.from_bytes(hashlib.blake2b(m.tobytes(), key=k, digest_size=8).digest(), "little") for m in msgs]
    assert batch.blake2b64(k, msgs).tolist() == want


def _headers(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n sealed headers at random offsets, every other one damaged in one byte."""
    rng = np.random.default_rng(seed)
    offs = rng.integers(0, 1 << 40, n).astype(np.uint64) // ALIGN * ALIGN
    keys = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    raw = SEALER.pack_many(keys, rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 63, n), np.arange(n) + 1, offs)
    raw[1::2, rng.integers(0, 64)] ^= 0x10
    return raw, offs


def test_pack_many_is_pack_row_by_row_and_check_many_is_parse():
    raw, offs = _headers(200, 1)
    raw[1::2] = SEALER.pack_many(np.zeros((100, 16), np.uint8), np.ones(100), np.ones(100), np.ones(100), offs[1::2])
    f = raw.view(extent.HEADER_DTYPE).reshape(-1)
    for i in range(0, 200, 7):
        one = SEALER.pack(
            f["key"][i].tobytes(), int(f["length"][i]), int(f["checksum"][i]), int(f["gen"][i]), int(offs[i])
        )
        assert raw[i].tobytes() == one
    raw[::3, 60] ^= 1  # a third of the seals broken
    raw[5, 4] = 9  # another version
    got = SEALER.check_many(raw, offs)
    assert got.tolist() == [SEALER.parse(raw[i].tobytes(), at=int(offs[i])) is not None for i in range(200)]
    assert 0 < got.sum() < 200
    assert not OTHER.check_many(raw, offs).any()
    assert not SEALER.check_many(raw, offs + np.uint64(ALIGN)).any()  # sealed for another offset


def test_seals_with_and_without_the_native_module_match_hashlib():
    raw, offs = _headers(300, 2)
    want = [int.from_bytes(seal(r[:56].tobytes(), int(o)), "little") for r, o in zip(raw, offs)]
    assert batch.python_seals(SECRET, raw, offs).tolist() == want
    assert batch.seals(SECRET, raw, offs).tolist() == want
    ok = batch.seals_ok(SECRET, raw, offs)
    assert ok.tolist() == [
        i % 2 == 0 or raw[i, 56:].tobytes() == seal(raw[i, :56].tobytes(), int(offs[i])) for i in range(300)
    ]
    with pytest.raises(InvalidArgument):
        batch.seals(SECRET, raw[:, :63], offs)


@NATIVE
def test_native_seals_refuse_mismatched_buffers():
    raw, offs = _headers(4, 3)
    with pytest.raises(ValueError):
        batch._impl.seal_many(SECRET, raw, offs[:3], np.empty(3, np.uint64))
    with pytest.raises(ValueError):
        batch._impl.seal_many(b"", raw, offs, np.empty(4, np.uint64))


def test_checksums_with_and_without_the_native_module_match_xxhash():
    rng = np.random.default_rng(4)
    buf = rng.integers(0, 256, 100_000, dtype=np.uint8)
    starts = rng.integers(0, 90_000, 500).astype(np.uint64)
    lengths = rng.integers(0, 10_000, 500).astype(np.uint64)
    starts[:2], lengths[:2] = [0, 100_000], [100_000, 0]  # all of it; empty at the end
    want = [xxhash.xxh3_64_intdigest(buf[s : s + n].tobytes()) for s, n in zip(starts.tolist(), lengths.tolist())]
    assert batch.checksums(buf, starts, lengths).tolist() == want
    assert batch.python_checksums(buf, starts, lengths).tolist() == want
    for s, n in [(99_999, 2), (100_001, 0), (0, 1 << 63)]:
        with pytest.raises(InvalidArgument):
            batch.checksums(buf, np.array([s], np.uint64), np.array([n], np.uint64))


@NATIVE
def test_native_checksums_check_their_ranges_themselves():
    buf = np.zeros(1000, np.uint8)
    out = np.empty(2, np.uint64)
    with pytest.raises(ValueError, match="range 1"):
        batch._impl.xxh3_many(buf, np.array([0, 990], np.uint64), np.array([10, 11], np.uint64), out)


def test_record_crcs_match_xxh32():
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, 68 * 40 + 30, dtype=np.uint8)  # a torn record at the end
    want = [xxhash.xxh32_intdigest(buf[i : i + 64].tobytes()) for i in range(0, 68 * 40, 68)]
    assert batch.record_crcs(buf, 68, 64).tolist() == want
    assert batch.python_record_crcs(buf, 68, 64).tolist() == want
    with pytest.raises(InvalidArgument):
        batch.record_crcs(buf, 64, 68)


def test_ordered_map_keeps_order_on_threads():
    rng = random.Random(6)
    items = list(range(200))

    def slow_square(i: int) -> int:
        time.sleep(rng.random() / 2000)
        return i * i

    assert list(batch.ordered_map(slow_square, items, threads=4)) == [i * i for i in items]
    assert list(batch.ordered_map(slow_square, items, threads=1)) == [i * i for i in items]
    cols = [np.arange(10, dtype=np.uint64), np.arange(20, dtype=np.uint8).reshape(10, 2)]
    a, b = batch.take_columns(cols, np.array([3, 1, 1]))
    assert a.tolist() == [3, 1, 1] and b.tolist() == [[6, 7], [2, 3], [2, 3]]
