"""Checks of many headers and payloads at once, for a daemon that reattaches millions of blocks:
seals (keyed BLAKE2b-64, :class:`kvstore.extent.Sealer`), payload checksums (xxh3-64) and
journal record CRCs (xxh32).

Each runs natively with the GIL released (``kvstore/transport/batch.c``) where the module was
built, and otherwise here: the seals vectorised with numpy (:func:`blake2b64`, the same MAC
as ``hashlib.blake2b(msg, key=key, digest_size=8)``), the checksums one ``xxhash`` call per
range. Both give the same answers. :func:`ordered_map` and :func:`take_columns` spread such
batches, and numpy's gathers (which release the GIL too), over the machine's cores.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.transport import native

U64 = np.dtype("<u8")
T = TypeVar("T")
R = TypeVar("R")
_impl = native.impl if native.impl is not None and hasattr(native.impl, "seal_many") else None

_IV = (
    0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
    0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179,
)  # fmt: skip
_SIGMA = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
    (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
    (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
    (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
    (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
    (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
    (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
    (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
    (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0),
)
_ROWS = 1 << 14  # messages per numpy pass: its temporaries stay in cache


def _rotr(x: np.ndarray, n: int) -> np.ndarray:
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


def _compress(h: list[np.ndarray], m: list[np.ndarray], t: int, last: bool) -> list[np.ndarray]:
    """BLAKE2b's compression function F (RFC 7693) over arrays of states and message words."""
    v = [x.copy() for x in h] + [np.full_like(h[0], iv) for iv in _IV]
    v[12] ^= np.uint64(t)
    if last:
        v[14] = ~v[14]

    def g(a: int, b: int, c: int, d: int, x: np.ndarray, y: np.ndarray) -> None:
        v[a] += v[b] + x
        v[d] = _rotr(v[d] ^ v[a], 32)
        v[c] += v[d]
        v[b] = _rotr(v[b] ^ v[c], 24)
        v[a] += v[b] + y
        v[d] = _rotr(v[d] ^ v[a], 16)
        v[c] += v[d]
        v[b] = _rotr(v[b] ^ v[c], 63)

    for r in range(12):
        s = _SIGMA[r % 10]
        g(0, 4, 8, 12, m[s[0]], m[s[1]])
        g(1, 5, 9, 13, m[s[2]], m[s[3]])
        g(2, 6, 10, 14, m[s[4]], m[s[5]])
        g(3, 7, 11, 15, m[s[6]], m[s[7]])
        g(0, 5, 10, 15, m[s[8]], m[s[9]])
        g(1, 6, 11, 12, m[s[10]], m[s[11]])
        g(2, 7, 8, 13, m[s[12]], m[s[13]])
        g(3, 4, 9, 14, m[s[14]], m[s[15]])
    return [h[i] ^ v[i] ^ v[i + 8] for i in range(8)]


def blake2b64(key: bytes, msgs: np.ndarray) -> np.ndarray:
    """The keyed BLAKE2b-64 of each row of ``msgs`` ((n, L) uint8, 1 <= L <= 128) under ``key``
    (1..64 bytes), as little-endian u64: the first 8 bytes of
    ``hashlib.blake2b(row, key=key, digest_size=8).digest()``. Vectorised over the rows."""
    n, width = msgs.shape
    if not 1 <= len(key) <= 64 or not 1 <= width <= 128:
        raise InvalidArgument("a BLAKE2b key is 1..64 bytes and a message here 1..128 bytes")
    h0 = [np.array([iv], np.uint64) for iv in _IV]
    h0[0] ^= np.uint64(0x01010000 ^ (len(key) << 8) ^ 8)
    block = np.zeros(128, np.uint8)
    block[: len(key)] = np.frombuffer(key, np.uint8)
    words = block.view(U64)
    hk = _compress(h0, [words[i : i + 1].copy() for i in range(16)], 128, False)  # the key block, once
    out = np.empty(n, U64)
    for lo in range(0, n, _ROWS):
        part = msgs[lo : lo + _ROWS]
        rows = np.zeros((len(part), 128), np.uint8)
        rows[:, :width] = part
        w = rows.view(U64)
        m = [np.ascontiguousarray(w[:, i]) for i in range(16)]
        h = _compress([np.repeat(x, len(part)) for x in hk], m, 128 + width, True)
        out[lo : lo + len(part)] = h[0]
    return out


def seals(secret: bytes, headers: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The seal of each 64-byte header (a row of ``headers``, (n, 64) uint8: its first 56 bytes)
    for its extent's offset under ``secret`` (:class:`kvstore.extent.Sealer`), as u64: what the
    header's last 8 bytes hold, read as a little-endian u64, where it is sealed."""
    headers = np.ascontiguousarray(headers, np.uint8)
    offsets = np.ascontiguousarray(offsets, U64)
    if headers.ndim != 2 or headers.shape != (offsets.size, 64):
        raise InvalidArgument(f"headers must be (n, 64) bytes for n offsets, got {headers.shape} for {offsets.size}")
    if _impl is not None:
        out = np.empty(offsets.size, U64)
        _impl.seal_many(secret, headers, offsets, out)
        return out
    return python_seals(secret, headers, offsets)


def python_seals(secret: bytes, headers: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """:func:`seals` without the native module."""
    msgs = np.array(headers, np.uint8).reshape(-1, 64)
    msgs[:, 56:] = np.asarray(offsets, U64).view(np.uint8).reshape(-1, 8)
    return blake2b64(secret, msgs)


def seals_ok(secret: bytes, headers: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Whether each 64-byte header ends in its seal (:func:`seals`)."""
    headers = np.ascontiguousarray(headers, np.uint8)
    return seals(secret, headers, offsets) == headers[:, 56:].copy().view(U64).ravel()


def _ranges(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    starts = np.ascontiguousarray(starts, U64)
    lengths = np.ascontiguousarray(lengths, U64)
    if starts.shape != lengths.shape or starts.ndim != 1:
        raise InvalidArgument("starts and lengths must be 1-D arrays of one length")
    if starts.size and bool(((starts > buf.size) | (lengths > buf.size - np.minimum(starts, buf.size))).any()):
        raise InvalidArgument("a checksummed range lies outside the buffer")
    return starts, lengths


def checksums(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The xxh3-64 of ``buf[starts[i] : starts[i] + lengths[i]]`` for each i (``buf``: a
    contiguous uint8 array), as u64."""
    starts, lengths = _ranges(buf, starts, lengths)
    if _impl is not None:
        out = np.empty(starts.size, U64)
        _impl.xxh3_many(buf, starts, lengths, out)
        return out
    return python_checksums(buf, starts, lengths)


def python_checksums(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """:func:`checksums` without the native module."""
    starts, lengths = _ranges(buf, starts, lengths)
    view = memoryview(buf).cast("B")
    h = xxhash.xxh3_64_intdigest
    return np.fromiter((h(view[s : s + n]) for s, n in zip(starts.tolist(), lengths.tolist())), U64, count=starts.size)


def record_crcs(buf: np.ndarray, stride: int, length: int) -> np.ndarray:
    """The xxh32 of the first ``length`` bytes of each whole ``stride``-byte record of ``buf``
    (a contiguous uint8 array), as u32."""
    if not 0 <= length <= stride:
        raise InvalidArgument(f"a record's checked length ({length}) must fit its stride ({stride})")
    n = buf.size // stride
    if _impl is not None:
        out = np.empty(n, "<u4")
        _impl.xxh32_many(buf[: n * stride], stride, length, out)
        return out
    return python_record_crcs(buf, stride, length)


def python_record_crcs(buf: np.ndarray, stride: int, length: int) -> np.ndarray:
    """:func:`record_crcs` without the native module."""
    n = buf.size // stride
    view = memoryview(buf[: n * stride]).cast("B")
    h = xxhash.xxh32_intdigest
    return np.fromiter((h(view[i : i + length]) for i in range(0, n * stride, stride)), "<u4", count=n)


def workers() -> int:
    """Threads for batch work: the cores this process may run on (at most 8)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> Iterator[R]:
    """``fn`` over ``items`` on ``threads`` threads (default :func:`workers`), the results in
    the order of the items, with at most two per thread computed ahead of the one taken."""
    threads = threads or workers()
    if threads <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="kvstore-batch") as pool:
        ahead: deque = deque()
        for item in items:
            ahead.append(pool.submit(fn, item))
            if len(ahead) >= 2 * threads:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def take_columns(columns: list[np.ndarray], idx: np.ndarray) -> list[np.ndarray]:
    """``[c[idx] for c in columns]`` (rows of 2-D ones), the columns gathered on several threads."""
    return list(ordered_map(lambda c: np.take(c, idx, axis=0), columns))
