"""Block compression for the SSD tier: lz4, plain or after a 2-byte shuffle, only where it pays.

``auto`` tries lz4 on a sample of each block, plain and byte-shuffled (the two bytes of each
16-bit element split into planes, as blosc does), and stores the block compressed only if the
sample shrinks by at least 20 % (the reason for 20 % is in :mod:`kvstore.daemon.ssd`); ``off``
never tries. Flags travel in the block header.
"""

from __future__ import annotations

import numpy as np

F_LZ4 = 1
F_SHUFFLE2 = 2
_SAMPLE = 64 << 10


def shuffle2(raw: np.ndarray) -> np.ndarray:
    """Splits 16-bit elements into a plane of low bytes and a plane of high bytes."""
    n = raw.size // 2 * 2
    w = raw[:n].view("<u2")
    out = np.empty(raw.size, np.uint8)
    out[: n // 2] = w & 0xFF
    out[n // 2 : n] = w >> 8
    out[n:] = raw[n:]
    return out


def unshuffle2(planes: np.ndarray, out: np.ndarray) -> None:
    n = out.size // 2 * 2
    w = out[:n].view("<u2")
    np.left_shift(planes[n // 2 : n].astype("<u2"), 8, out=w)
    w |= planes[: n // 2]
    out[n:] = planes[n:]


def _lz4():
    import lz4.block

    return lz4.block


def compress(raw: np.ndarray, policy: str) -> tuple[int, bytes | None]:
    """(flags, stored bytes) if compressing pays for this block, else (0, None)."""
    if policy == "off" or raw.size < 4096:
        return 0, None
    lz4 = _lz4()
    sample = raw[:_SAMPLE]
    best_flags, best = 0, sample.size * 0.8  # must save at least 20 %
    for flags in (F_LZ4, F_LZ4 | F_SHUFFLE2):
        src = shuffle2(sample) if flags & F_SHUFFLE2 else sample
        size = len(lz4.compress(src, mode="fast", store_size=False))
        if size < best:
            best_flags, best = flags, size
    if not best_flags:
        return 0, None
    src = shuffle2(raw) if best_flags & F_SHUFFLE2 else raw
    data = lz4.compress(src, mode="fast", store_size=False)
    if len(data) >= raw.size * 0.95:
        return 0, None
    return best_flags, data


def decompress(stored: memoryview, flags: int, out: np.ndarray) -> bool:
    """Decodes into ``out`` (raw length). False if the stored bytes do not decode."""
    try:
        data = _lz4().decompress(stored, uncompressed_size=out.size)
    except Exception:  # noqa: BLE001 - lz4 raises LZ4BlockError on damaged input
        return False
    if len(data) != out.size:
        return False
    src = np.frombuffer(data, np.uint8)
    if flags & F_SHUFFLE2:
        unshuffle2(src, out)
    else:
        out[:] = src
    return True
