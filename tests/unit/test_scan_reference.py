"""kvstore.extent.scan against a one-candidate-at-a-time reference written here from the
documented format (struct, hashlib, xxhash) on random segments, with and without the native
module, and kvstore.overlap.newest_wins against the one-by-one newest-first rule."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest
import xxhash

from kvstore import batch, extent
from kvstore.extent import ALIGN, CLEARED, HEADER_SIZE, MAGIC, VERSION, Sealer, checksum, extent_size, scan
from kvstore.overlap import newest_wins

SECRET = bytes(range(32))
SEALER = Sealer(SECRET)
OTHER = Sealer(bytes(range(1, 33)))  # another daemon's secret


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def write_extent(seg: np.ndarray, off: int, k: bytes, data: bytes, gen: int, sealer: Sealer = SEALER) -> None:
    """The writer's payload, then the daemon's sealed header (as in test_extent_scan.py)."""
    seg[off : off + HEADER_SIZE] = np.frombuffer(CLEARED, np.uint8)
    seg[off + HEADER_SIZE : off + HEADER_SIZE + len(data)] = np.frombuffer(data, np.uint8)
    seg[off : off + HEADER_SIZE] = np.frombuffer(sealer.pack(k, len(data), checksum(data), gen, off), np.uint8)


def _header_only(seg: np.ndarray, off: int, k: bytes, length: int, gen: int) -> None:
    """A sealed header claiming ``length`` bytes whose payload was never written."""
    seg[off : off + HEADER_SIZE] = np.frombuffer(SEALER.pack(k, length, 0, gen, off), np.uint8)


# ---- the reference and random segments --------------------------------------------------------


def reference_scan(seg: np.ndarray, secret: bytes, verify: bool) -> tuple[list[tuple], int]:
    """The documented rule one candidate at a time, from the format alone (struct, hashlib,
    xxhash): (key, offset, size, length, checksum, gen) rows, oldest first, and the discards."""
    found, discarded = [], 0
    for off in range(0, seg.size - seg.size % ALIGN, ALIGN):
        raw = bytes(seg[off : off + HEADER_SIZE])
        if raw[:4] != MAGIC:
            continue
        _m, version, flags, k, length, csum, gen, _raw = struct.unpack("<4sHH16sQQQQ", raw[:56])
        seal = hashlib.blake2b(raw[:56] + struct.pack("<Q", off), key=secret, digest_size=8).digest()
        bad = seal != raw[56:] or version != VERSION or flags or off + HEADER_SIZE + length > seg.size
        if not bad and verify:
            bad = xxhash.xxh3_64_intdigest(bytes(seg[off + HEADER_SIZE : off + HEADER_SIZE + length])) != csum
        if bad:
            discarded += 1
            continue
        found.append((k, off, extent_size(length), length, csum, gen))
    kept: list[tuple] = []
    for b in sorted(found, key=lambda b: (-b[5], b[1])):  # newest first, then lower offset
        if any(b[1] < o[1] + o[2] and o[1] < b[1] + b[2] for o in kept):
            discarded += 1
            continue
        kept.append(b)
    return sorted(kept, key=lambda b: (b[5], b[1])), discarded


def random_segment(rng: random.Random, slots: int) -> np.ndarray:
    """Commits, stale and partial headers, damage and forgeries at random slots, in random order."""
    seg = np.zeros(slots * ALIGN + rng.choice([0, 0, 100]), np.uint8)
    for i in range(rng.randrange(1, 2 * slots)):
        off = rng.randrange(slots) * ALIGN
        k, gen, n = key(i), rng.randrange(1, 40), rng.choice([0, 10, 192, 300, 700, 2000])
        n = min(n, seg.size - off - HEADER_SIZE)
        kind = rng.choice(
            ["good"] * 6 + ["header", "seal", "payload", "past_end", "other", "flags", "version", "magic"]
        )
        if kind == "header":
            _header_only(seg, off, k, n, gen)
        elif kind == "past_end":
            _header_only(seg, off, k, seg.size - off - HEADER_SIZE + rng.randrange(1, 300), gen)
        elif kind == "magic":
            seg[off : off + 4] = np.frombuffer(MAGIC, np.uint8)
        elif kind in ("flags", "version"):
            body = struct.pack("<4sHH16sQQQQ", MAGIC, VERSION + (kind == "version"), kind == "flags", k, n, 0, gen, n)
            sealed = body + hashlib.blake2b(body + struct.pack("<Q", off), key=SECRET, digest_size=8).digest()
            seg[off : off + HEADER_SIZE] = np.frombuffer(sealed, np.uint8)
        else:
            write_extent(seg, off, k, rng.randbytes(n), gen, OTHER if kind == "other" else SEALER)
            if kind == "seal":
                seg[off + 56 + rng.randrange(8)] ^= 1 << rng.randrange(8)
            elif kind == "payload" and n:
                seg[off + HEADER_SIZE + rng.randrange(n)] ^= 0xFF
    return seg


@pytest.mark.parametrize("seed", range(40))
def test_scan_matches_the_reference_on_random_segments(seed, monkeypatch):
    rng = random.Random(seed)
    seg = random_segment(rng, rng.choice([4, 16, 64, 200]))
    if seed % 3 == 0:  # batches and passes that split the candidates
        monkeypatch.setattr(extent, "_SCAN_BATCH", 3)
        monkeypatch.setattr(extent, "_SCAN_SLOTS", 7)
    for verify in (True, False):
        want, discarded = reference_scan(seg, SECRET, verify)
        res = scan(seg, SEALER, verify=verify)
        assert [tuple(b) for b in res.blocks.rows()] == want
        assert res.discarded == discarded


@pytest.mark.parametrize("seed", range(6))
def test_scan_without_the_native_module_gives_the_same_columns(seed, monkeypatch):
    seg = random_segment(random.Random(100 + seed), 64)
    native = scan(seg, SEALER)
    monkeypatch.setattr(batch, "_impl", None)
    python = scan(seg, SEALER)
    assert python.blocks == native.blocks and python.discarded == native.discarded


# ---- overlap resolution -------------------------------------------------------------------------


def greedy(start: list[int], end: list[int], gen: list[int]) -> list[bool]:
    keep = [False] * len(start)
    taken: list[tuple[int, int]] = []
    for i in sorted(range(len(start)), key=lambda i: (-gen[i], start[i])):
        if not any(start[i] < hi and lo < end[i] for lo, hi in taken):
            taken.append((start[i], end[i]))
            keep[i] = True
    return keep


@pytest.mark.parametrize("seed", range(30))
def test_newest_wins_is_the_one_by_one_rule(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    start = rng.choice(int(rng.integers(n, 3 * n + 1)), n, replace=False).astype(np.uint64) * 256
    end = start + rng.integers(1, int(rng.integers(2, 40)), n).astype(np.uint64) * 256
    gen = rng.integers(0, int(rng.integers(1, 2 * n + 2)), n).astype(np.uint64)  # with ties
    assert newest_wins(start, end, gen).tolist() == greedy(start.tolist(), end.tolist(), gen.tolist())


@pytest.mark.parametrize("descending", [True, False])
def test_newest_wins_on_a_chain_of_overlaps(descending):
    """Each extent overlaps the next: which survive depends on every one before it."""
    n = 5000
    start = np.arange(n, dtype=np.uint64) * 256
    gen = np.arange(n, dtype=np.uint64)[::-1].copy() if descending else np.random.default_rng(1).permutation(n)
    got = newest_wins(start, start + 512, gen)
    assert got.tolist() == greedy(start.tolist(), (start + 512).tolist(), np.asarray(gen).tolist())
    if descending:
        assert got.tolist() == [i % 2 == 0 for i in range(n)]
