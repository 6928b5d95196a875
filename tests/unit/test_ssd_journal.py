"""The SSD segment's columns: the journal replayed as arrays (kvstore.daemon.journal) against the
record-by-record rule, the committed-block map (kvstore.daemon.ssd_map) against a dict, the
windowed batch verification (kvstore.daemon.ssd_verify) against one read per block, and the
inventory messages cut per shard from columns (kvstore.daemon.links.shard_inventory)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvstore.blocks import Block, BlockCols
from kvstore.cluster.slots import arena
from kvstore.daemon import journal, ssd_map
from kvstore.daemon.journal import OP_ADD, OP_DEL, REC_SIZE
from kvstore.daemon.links import shard_inventory
from kvstore.daemon.ssd import SsdSegment
from kvstore.daemon.ssd_map import BlockMap
from kvstore.daemon.ssd_verify import verify_blocks
from kvstore.extent import HEADER_SIZE, checksum

_REC = struct.Struct("<4sB3x16sQQQQQ")


def reference_replay(raw: bytes) -> tuple[dict[int, tuple], int]:
    """The journal's rule one record at a time (offset -> (key, offset, size, length, checksum,
    gen)), and the bytes of its whole leading records."""
    live: dict[int, tuple] = {}
    good = 0
    for pos in range(0, len(raw) - REC_SIZE + 1, REC_SIZE):
        body = raw[pos : pos + _REC.size]
        if struct.unpack_from("<I", raw, pos + _REC.size)[0] != xxhash.xxh32_intdigest(body):
            break
        magic, op, key, offset, size, length, csum, gen = _REC.unpack(body)
        if magic != b"KVJ2":
            break
        if op == OP_ADD:
            live[offset] = (key, offset, size, length, csum, gen)
        elif op == OP_DEL and offset in live and live[offset][0] == key and live[offset][5] == gen:
            del live[offset]
        good = pos + REC_SIZE
    return live, good


def random_journal(rng: np.random.Generator, n: int) -> bytes:
    keys = [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(6)]
    out = []
    for _ in range(n):
        op = int(rng.choice([OP_ADD, OP_ADD, OP_DEL, 7]))  # 7: an op this version does not know
        key, off, gen = keys[int(rng.integers(6))], int(rng.integers(8)) * 4096, int(rng.integers(1, 6))
        out.append(journal.pack_record(op, key, off, 4096, int(rng.integers(100)), int(rng.integers(1 << 62)), gen))
    raw = bytearray(b"".join(out))
    if raw and rng.random() < 0.4:  # damage: a flipped byte somewhere, or a torn tail
        raw[int(rng.integers(len(raw)))] ^= 0x40
    if rng.random() < 0.3:
        raw += b"\x01" * int(rng.integers(1, REC_SIZE))
    return bytes(raw)


@pytest.mark.parametrize("seed", range(60))
def test_replay_as_columns_is_the_record_by_record_rule(seed, tmp_path):
    rng = np.random.default_rng(seed)
    raw = random_journal(rng, int(rng.integers(0, 80)))
    path = tmp_path / "j"
    path.write_bytes(raw)
    live, good = journal.replay(path)
    want, want_good = reference_replay(raw)
    assert good == want_good
    assert [tuple(b[i] for i in (0, 1, 2, 3, 4, 5)) for b in live.rows()] == [want[o] for o in sorted(want)]


def test_replay_of_a_missing_or_empty_journal(tmp_path):
    assert journal.replay(tmp_path / "none") == (BlockCols.empty(), 0)
    (tmp_path / "empty").write_bytes(b"x" * (REC_SIZE - 1))
    assert journal.replay(tmp_path / "empty") == (BlockCols.empty(), 0)


def test_pack_records_is_pack_record_row_by_row():
    rng = np.random.default_rng(1)
    n = 50
    blocks = BlockCols(
        rng.integers(0, 256, (n, 16), dtype=np.uint8),
        *(rng.integers(0, 1 << 62, n).astype(np.uint64) for _ in range(5)),
    )
    raw = journal.pack_records(blocks, OP_DEL).tobytes()
    assert raw == b"".join(journal.pack_record(OP_DEL, *b) for b in blocks.rows())


@pytest.mark.parametrize("big", [False, True])
def test_last_of_each(big):
    rng = np.random.default_rng(2)
    values = rng.integers(0, 20, 300).astype(np.uint64)
    if big:  # too large to pack with the index: the other path
        values |= np.uint64(1 << 62)
    distinct, last = journal._last_of_each(values)
    want = {v: i for i, v in enumerate(values.tolist())}
    assert distinct.tolist() == sorted(want) and last.tolist() == [want[v] for v in sorted(want)]


@pytest.mark.parametrize("seed", range(10))
def test_block_map_is_a_dict_of_blocks(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(ssd_map, "_MERGE_MIN", int(rng.integers(1, 20)))
    start = {int(o) * 4096: Block(bytes(16), int(o) * 4096, 4096, 1, 2, 3) for o in rng.permutation(40)[:15]}
    m = BlockMap(BlockCols.from_rows(list(start.values())))
    model = dict(start)
    for i in range(400):
        off = int(rng.integers(60)) * 4096
        if rng.random() < 0.55:
            b = Block(rng.integers(0, 256, 16, dtype=np.uint8).tobytes(), off, 8192, i, i * 7, i + 10)
            m.put(b)
            model[off] = b
        else:
            m.pop(off)
            model.pop(off, None)
        assert len(m) == len(model)
        probe = int(rng.integers(60)) * 4096
        assert m.get(probe) == model.get(probe)
        if rng.random() < 0.05:
            assert m.columns().rows() == [model[o] for o in sorted(model)]
    assert m.columns().rows() == [model[o] for o in sorted(model)]
    assert m.get(-1) is None and m.get(1 << 70) is None
    with pytest.raises(ValueError):
        BlockMap(BlockCols.from_rows([start[o] for o in list(start)[:1]] * 2))


@pytest.mark.parametrize("verify", [True, False])
def test_windowed_verification_is_one_check_per_block(tmp_path, verify):
    """Blocks of every size around a small window (some larger than it, some across its end),
    some stored compressed, some damaged: the windows give what reading each block alone gives."""
    rng = np.random.default_rng(3)
    seg = SsdSegment(tmp_path, 2, 8 << 20, direct_io=False)
    rows, off = [], 0
    for i in range(60):
        n = int(rng.choice([10, 3000, 4096 - HEADER_SIZE, 9000, 40_000]))
        raw = np.zeros(n, np.uint8) if i % 5 == 0 else rng.integers(0, 256, n, dtype=np.uint8)
        key = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        size = seg.write(off, key, raw, checksum(raw), i + 1)
        b = seg.commit(off, key, i + 1)
        rows.append(b)
        off += size
    blocks = BlockCols.from_rows(rows)
    with open(seg.path, "r+b") as f:
        for b in rows[3::7]:  # a payload byte, or a header byte
            f.seek(b.offset + (HEADER_SIZE + 5 if b.offset % 2 else 9))
            f.write(b"\xee")
    one = [
        seg.read(b.offset, b.key, b.length, gen=b.gen)[0].ok
        if verify
        else seg._header_ok(b.offset, b.key, b.length, b.checksum, b.gen)
        for b in rows
    ]
    assert 0 < sum(one) < len(one)
    for window in (16 << 10, 64 << 10, 8 << 20):
        assert verify_blocks(seg, blocks, verify, window=window).tolist() == one
    # Records that do not name what the header holds fail, as does an extent past the segment's
    # end or one not aligned.
    b = rows[1]
    assert verify_blocks(seg, BlockCols.from_rows([b]), verify).tolist() == [True]
    wrong = [b._replace(key=bytes(16)), b._replace(gen=b.gen + 1), b._replace(length=b.length + 1)]
    wrong += [b._replace(checksum=b.checksum ^ 1), b._replace(offset=8 << 20), b._replace(offset=b.offset + 512)]
    for w in wrong:
        assert verify_blocks(seg, BlockCols.from_rows([w]), verify).tolist() == [False]
    seg.close()


def test_shard_inventory_cuts_columns_by_shard_arena():
    cap, align = 1 << 20, 4096
    offs = np.arange(0, cap, 16 * align, dtype=np.uint64)
    n = offs.size
    blocks = BlockCols(
        np.arange(n * 16, dtype=np.uint8).reshape(n, 16) % 251, offs, np.full(n, align), offs + 1, offs + 2, offs + 3
    )
    cols = [(0, blocks, False), (2, blocks.take(slice(0, 2)), True)]
    sizes = {0: (cap, align), 2: (cap, align)}
    whole = shard_inventory(cols, sizes, 0, 1)
    assert [m.segment_id for m in whole] == [0, 2] and whole[0].size == b"" and len(whole[1].size) == 16
    assert whole[0].keys == blocks.keys.tobytes()
    seen = 0
    for shard in range(3):
        base, span = arena(cap, align, shard, 3)
        msgs = {m.segment_id: m for m in shard_inventory(cols, sizes, shard, 3)}
        mine = (offs >= base) & (offs < base + span)
        got = np.frombuffer(msgs[0].offset, "<u8")
        assert got.tolist() == offs[mine].tolist()
        assert msgs[0].keys == blocks.keys[mine].tobytes()
        assert np.frombuffer(msgs[0].gen, "<u8").tolist() == (offs[mine] + 3).tolist()
        assert (2 in msgs) == (shard == 0)  # an empty cut is left out
        seen += got.size
    assert seen == np.count_nonzero(offs < 3 * arena(cap, align, 0, 3)[1])
