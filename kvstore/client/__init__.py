"""The client library: :class:`KVStoreClient` (asyncio) and :class:`SyncKVStoreClient`."""

from kvstore.client.client import KVStoreClient, PutResult
from kvstore.client.sync import SyncKVStoreClient

__all__ = ["KVStoreClient", "PutResult", "SyncKVStoreClient"]
