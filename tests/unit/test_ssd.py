"""The SSD segment on real files: round trips, compression, journal recovery, damage detection."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.daemon.ssd import F_LZ4, F_SHUFFLE2, SsdSegment, compress, shuffle2, unshuffle2
from kvstore.extent import HEADER_SIZE, checksum

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


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("name", list(payloads()))
def test_write_read_roundtrip_every_payload(tmp_path, name, direct):
    seg = SsdSegment(tmp_path, 2, 16 * MB, direct_io=direct)
    raw = payloads()[name]
    key = name.encode().ljust(16, b"_")
    seg.write(4096 * 3, key, raw, checksum(raw))
    st, out = seg.read(4096 * 3, key, raw.size)
    assert st.ok and np.array_equal(out, raw)
    dest = np.empty_like(raw)
    st, _ = seg.read(4096 * 3, key, raw.size, out=dest)
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
    size = seg.write(0, b"z" * 16, p["zeros"], checksum(p["zeros"]))
    assert size == 4096  # 200 kB of zeros in one page
    assert seg.counters["compressed"] == 1


def test_shuffle_round_trip_odd_length():
    raw = np.random.default_rng(1).integers(0, 256, 10_001, dtype=np.uint8)
    out = np.empty_like(raw)
    unshuffle2(shuffle2(raw), out)
    assert np.array_equal(out, raw)
    assert F_SHUFFLE2 != F_LZ4


def test_wrong_key_or_length_is_a_mismatch_not_data(tmp_path):
    seg = SsdSegment(tmp_path, 2, 4 * MB)
    raw = payloads()["fp32"]
    seg.write(0, b"a" * 16, raw, checksum(raw))
    assert seg.read(0, b"b" * 16, raw.size)[0].reason == "mismatch"
    assert seg.read(0, b"a" * 16, raw.size - 1)[0].reason == "mismatch"
    assert seg.read(8 * MB, b"a" * 16, raw.size)[0].reason == "mismatch"
    with pytest.raises(ValueError, match="outside segment"):
        seg.write(4 * MB - 4096, b"c" * 16, raw, checksum(raw))


def _fill(seg: SsdSegment, n: int) -> dict[bytes, tuple[int, np.ndarray]]:
    rng = np.random.default_rng(7)
    blocks = {}
    for i in range(n):
        raw = rng.integers(0, 256, 20_000 + i, dtype=np.uint8)
        key = i.to_bytes(16, "little")
        off = i * 6 * 4096
        seg.write(off, key, raw, checksum(raw))
        blocks[key] = (off, raw)
    return blocks


def test_recovery_after_reopen_keeps_every_whole_block(tmp_path):
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    blocks = _fill(seg, 20)
    victim = next(iter(blocks))
    assert seg.invalidate(blocks[victim][0], victim)
    seg.close()  # as after a crash: nothing flushed beyond what the OS has
    seg = SsdSegment(tmp_path, 2, 16 * MB)
    found, discarded = seg.recover()
    assert discarded == 0
    assert {b.key for b in found} == set(blocks) - {victim}
    for b in found:
        st, out = seg.read(b.offset, b.key, b.length)
        assert st.ok and np.array_equal(out, blocks[b.key][1])
    # The journal was compacted to the live set.
    assert os.path.getsize(seg.journal_path) == 19 * 68


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
    keys = {b.key for b in found}
    assert (9).to_bytes(16, "little") not in keys  # its record was torn
    assert (3).to_bytes(16, "little") not in keys  # its bytes were damaged
    assert len(found) == 8 and discarded == 1
    # New records follow the whole ones, and survive another reopen.
    raw = np.ones(5000, np.uint8)
    seg.write(15 * MB, b"n" * 16, raw, checksum(raw))
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
    seg.write(0, b"d" * 16, raw, checksum(raw))
    assert seg.read(0, b"d" * 16, raw.size)[0].ok
    with pytest.raises(ValueError, match="durability"):
        SsdSegment(tmp_path / "x", 2, 4 * MB, durability="sometimes")
