"""Block keys: the one contract that the engine, the client and the benchmarks share.

A block is ``block_size`` consecutive tokens; only full blocks get keys. Keys chain::

    root    = H(tag "kvstore-root", key_format_version, hash_algo, namespace, fingerprint...)
    key[0]  = H(root,     tokens[0:B],   extra)
    key[i]  = H(key[i-1], tokens[iB:(i+1)B], extra)

so each key commits to its whole prefix, and "the first n*B tokens are cached" is exactly
"the first n keys exist". Every field is encoded as ``tag:u8 type:u8 len:u32 payload``, so no
two field sequences hash the same bytes. See docs/block-keys.md for the byte-exact spec and
golden vectors (tests/unit/test_keys.py checks them).

``H`` is xxh3-128 by default; ``sha256`` (first 16 bytes) is for tenants who must not be able
to construct collisions on purpose. Never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

BlockKey = NewType("BlockKey", bytes)
"""16 bytes. A packed batch of N keys is one ``bytes`` of N x 16."""

KEY_BYTES = 16
KEY_FORMAT_VERSION = 1
HASH_ALGOS = ("xxh3_128", "sha256")

# Field tags. Appending tags is compatible; changing one is a new KEY_FORMAT_VERSION.
_T_DOMAIN, _T_VERSION, _T_ALGO, _T_NAMESPACE = 1, 2, 3, 4
_T_MODEL, _T_DTYPE, _T_LAYERS, _T_KV_HEADS, _T_HEAD_DIM = 5, 6, 7, 8, 9
_T_BLOCK_SIZE, _T_TP_RANK, _T_TP_SIZE, _T_LAYOUT = 10, 11, 12, 13
_T_PARENT, _T_TOKENS, _T_EXTRA = 20, 21, 22
_T_SALT = 14
# Field types.
_Y_BYTES, _Y_STR, _Y_U64, _Y_U32_ARRAY = 1, 2, 3, 4

_FIELD_HEAD = struct.Struct("<BBI")
_U64 = struct.Struct("<Q")


def _field(tag: int, typ: int, payload: bytes) -> bytes:
    return _FIELD_HEAD.pack(tag, typ, len(payload)) + payload


def _str_field(tag: int, value: str) -> bytes:
    return _field(tag, _Y_STR, value.encode("utf-8"))


def _int_field(tag: int, value: int) -> bytes:
    if not 0 <= value < 2**64:
        raise InvalidArgument(f"fingerprint field {tag} must be a non-negative 64-bit int, got {value}")
    return _field(tag, _Y_U64, _U64.pack(value))


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that makes two models' KV for the same tokens differ.

    Two fingerprints that differ in any field never share a key.
    """

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = "layer,kv,token,head,dim"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"ModelFingerprint.{name} must be a positive int, got {v!r}")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"ModelFingerprint.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        for name in ("model_id", "dtype", "layout"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise InvalidArgument(f"ModelFingerprint.{name} must be a str, got {v!r}")
            if not v and name != "layout":
                raise InvalidArgument(f"ModelFingerprint.{name} must not be empty")
        if self.block_size >= 2**28:
            raise InvalidArgument(f"ModelFingerprint.block_size {self.block_size} is absurd (limit 2**28 tokens)")

    def encode(self) -> bytes:
        return b"".join(
            (
                _str_field(_T_MODEL, self.model_id),
                _str_field(_T_DTYPE, self.dtype),
                _int_field(_T_LAYERS, self.num_layers),
                _int_field(_T_KV_HEADS, self.num_kv_heads),
                _int_field(_T_HEAD_DIM, self.head_dim),
                _int_field(_T_BLOCK_SIZE, self.block_size),
                _int_field(_T_TP_RANK, self.tp_rank),
                _int_field(_T_TP_SIZE, self.tp_size),
                _str_field(_T_LAYOUT, self.layout),
            )
        )


def _hasher(algo: str):
    if algo == "xxh3_128":
        return lambda data: xxhash.xxh3_128_digest(data)
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()[:KEY_BYTES]
    raise InvalidArgument(f"unknown hash algorithm {algo!r}; expected one of {HASH_ALGOS}")


@dataclass(frozen=True, slots=True)
class KeySpace:
    """A (namespace, model fingerprint, hash) scope: computes chained block keys.

    >>> ks = KeySpace(ModelFingerprint("m", "bf16", 2, 2, 64), namespace="tenant-a")
    >>> keys = ks.block_keys(list(range(40)))   # 2 full blocks of 16; 8 tokens left over
    >>> len(keys)
    2
    """

    fingerprint: ModelFingerprint
    namespace: str = "default"
    algo: str = "xxh3_128"
    # A tenant's secret (16+ random bytes; use algo="sha256" with it): keys then cannot be
    # computed by anyone without it, even knowing the namespace, model and prompt. Empty: none.
    salt: bytes = field(default=b"", repr=False)
    root: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        h = _hasher(self.algo)
        if not isinstance(self.namespace, str):
            raise InvalidArgument(f"namespace must be a str, got {type(self.namespace).__name__}")
        try:
            self.namespace.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument("namespace must be encodable as UTF-8") from None
        seed = b"".join(
            (
                _field(_T_DOMAIN, _Y_BYTES, b"kvstore-root"),
                _int_field(_T_VERSION, KEY_FORMAT_VERSION),
                _str_field(_T_ALGO, self.algo),
                _str_field(_T_NAMESPACE, self.namespace),
                self.fingerprint.encode(),
            )
        )
        if not isinstance(self.salt, bytes):
            raise InvalidArgument(f"salt must be bytes, got {type(self.salt).__name__}")
        if self.salt:
            if len(self.salt) < 16:
                raise InvalidArgument(f"salt must be at least 16 bytes (a secret), got {len(self.salt)}")
            seed += _field(_T_SALT, _Y_BYTES, self.salt)
        object.__setattr__(self, "root", h(seed))

    @property
    def block_size(self) -> int:
        return self.fingerprint.block_size

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        extra: bytes = b"",
        parent: bytes | None = None,
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids`` (a trailing partial block has none).

        ``parent`` continues a chain from an earlier key instead of the root (``token_ids`` then
        start at a block boundary). ``extra`` is folded into every block (LoRA id, image hashes).
        Pure: no state, same result in every process.
        """
        tokens = _as_u32(token_ids)
        if not isinstance(extra, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"extra must be bytes, got {type(extra).__name__}")
        if parent is None:
            prev = self.root
        else:
            if not isinstance(parent, (bytes, bytearray)) or len(parent) != KEY_BYTES:
                got = len(parent) if isinstance(parent, (bytes, bytearray)) else type(parent).__name__
                raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {got}")
            prev = bytes(parent)
        bs = self.fingerprint.block_size
        n = len(tokens) // bs
        if n == 0:
            return []
        h = _hasher(self.algo)
        raw = tokens[: n * bs].tobytes()
        step = bs * 4
        tok_head = _FIELD_HEAD.pack(_T_TOKENS, _Y_U32_ARRAY, step)
        parent_head = _FIELD_HEAD.pack(_T_PARENT, _Y_BYTES, KEY_BYTES)
        extra_field = _field(_T_EXTRA, _Y_BYTES, bytes(extra)) if extra else b""
        out: list[BlockKey] = []
        for i in range(n):
            prev = h(b"".join((parent_head, prev, tok_head, raw[i * step : (i + 1) * step], extra_field)))
            out.append(BlockKey(prev))
        return out

    def packed_block_keys(
        self, token_ids: Sequence[int] | np.ndarray, extra: bytes = b"", parent: bytes | None = None
    ) -> bytes:
        """:meth:`block_keys` as one packed ``bytes`` of N x 16."""
        return b"".join(self.block_keys(token_ids, extra, parent))


def _as_u32(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    try:
        arr = np.asarray(token_ids)
    except (ValueError, TypeError):
        raise InvalidArgument("token_ids must be a flat sequence of integers") from None
    if arr.dtype == object and arr.ndim == 1 and all(isinstance(t, int) for t in arr.tolist()):
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    if arr.ndim != 1:
        raise InvalidArgument(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype("<u4")
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= 2**32:
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def key_list(keys: Sequence[bytes] | bytes) -> list[bytes]:
    """The keys one by one (bytes of 16), from a list of them or a packed buffer; raises
    InvalidArgument as :func:`pack_keys` does."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        data = pack_keys(keys)
        return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]
    out = list(keys)
    if set(map(type, out)) <= {bytes} and set(map(len, out)) <= {KEY_BYTES}:
        return out
    pack_keys(out)  # raises, naming the first bad key
    return [bytes(k) for k in out]  # bytearrays


def pack_keys(keys: Sequence[bytes] | bytes) -> bytes:
    """Packs a list of 16-byte keys (or checks an already packed buffer) into N x 16 bytes."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        data = bytes(keys)
        if len(data) % KEY_BYTES:
            raise InvalidArgument(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(data)}")
        return data
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            size = len(k) if isinstance(k, (bytes, bytearray)) else type(k).__name__
            raise InvalidArgument(f"key {i} must be {KEY_BYTES} bytes, got {size}")
    return b"".join(keys)


def unpack_keys(packed: bytes) -> list[BlockKey]:
    """Splits N x 16 packed bytes into a list of keys (fast path through numpy)."""
    if len(packed) % KEY_BYTES:
        raise InvalidArgument(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(packed)}")
    if not packed:
        return []
    return np.frombuffer(packed, dtype=f"V{KEY_BYTES}").tolist()  # type: ignore[return-value]
