"""kvstore: a KV-cache-centric storage tier for LLM serving.

``import kvstore`` needs neither torch nor CuPy. The public API::

    from kvstore import KVStoreClient, SyncKVStoreClient, KeySpace, ModelFingerprint
"""

from kvstore.client import KVStoreClient, PutResult, SyncKVStoreClient
from kvstore.errors import (
    Expired,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ResourceExhausted,
    Timeout,
    Unavailable,
)
from kvstore.keys import BlockKey, KeySpace, ModelFingerprint, pack_keys, unpack_keys

__version__ = "0.1.0"

__all__ = [
    "BlockKey",
    "Expired",
    "InvalidArgument",
    "KVStoreClient",
    "KVStoreError",
    "KeySpace",
    "ModelFingerprint",
    "NotFound",
    "PutResult",
    "ResourceExhausted",
    "SyncKVStoreClient",
    "Timeout",
    "Unavailable",
    "pack_keys",
    "unpack_keys",
]
