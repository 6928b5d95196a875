"""What every engine integration needs of the store: a client made from the engine's own settings
dict, opened on first use, and a 16-byte key for a name the engine gives its blocks."""

from __future__ import annotations

import os
import threading
from typing import Any

import xxhash

from kvstore.config import ClientConfig


def client_config(settings: dict[str, Any], retries: int | None = None) -> ClientConfig:
    """``meta`` (default ``$KVSTORE_META`` or ``127.0.0.1:7100``), ``transport``, ``token``,
    ``rpc_timeout_s`` (5, for RPCs and data-port I/O alike), ``retries``. Raises ValueError on a
    setting that is not a number where one is needed, at start-up rather than on first use."""
    timeout = float(settings.get("rpc_timeout_s", 5.0))
    cfg = ClientConfig(
        meta=settings.get("meta") or os.environ.get("KVSTORE_META") or "127.0.0.1:7100",
        transport=settings.get("transport", "auto"),
        token=settings.get("token", ""),
        rpc_timeout_s=timeout,
        io_timeout_s=timeout,
    )
    if "retries" in settings or retries is not None:
        cfg.retries = int(settings.get("retries", retries))
    return cfg


class LazyClient:
    """A SyncKVStoreClient opened on first use (engines build their plugins before a store is
    needed, in processes that may never use it), shared by the plugin's threads."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self._client: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._client is None:
                from kvstore.client.sync import SyncKVStoreClient

                self._client = SyncKVStoreClient(self.cfg.meta, self.cfg)
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def scoped_key(*parts: bytes) -> bytes:
    """A 128-bit key for ``parts`` (each length-prefixed, so no two lists of parts collide)."""
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()
