"""kvstore as SGLang's HiCache storage backend (``HiCacheStorage``), its third tier.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "meta": "127.0.0.1:7100"}'

Extra config: ``meta`` (default ``$KVSTORE_META`` or ``127.0.0.1:7100``), ``namespace``
(``sglang``), ``token``, ``transport``, ``rpc_timeout_s`` (5), ``interface_v1`` (1: SGLang hands
pages of its host memory pool to read and write in place; 0: whole pages as tensors).

Keys: SGLang names a page by a hash chained over the tokens before it; a kvstore key is a 128-bit
hash of that name, the namespace, the shard identity (model, tensor/pipeline/context-parallel
rank and size; MLA KV, the same on every TP rank, is shared across them) and the host pool's page
geometry (layout, dtype, page size, layers, heads). With ``interface_v1``
a page is the buffers the host pool lays it out in (K and V, per layer for ``layer_first``): each
is one kvstore block, read and written in place, and a page is present only when all its buffers
are. Every read is checksum-verified; a page that is missing, evicted or corrupted is a miss
(SGLang then computes it), never an error and never wrong bytes.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.errors import KVStoreError
from kvstore.integrations.store import LazyClient, client_config, scoped_key

log = logging.getLogger("kvstore.sglang")
_FAILURES = (KVStoreError, OSError, ValueError)


def _host_bytes(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 view of ``size`` bytes of host memory at ``ptr`` (SGLang's host pool)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"a page must be a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    return t.view(torch.uint8).reshape(-1).numpy()


class KVStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None, mem_pool_host: Any = None):
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.namespace = str(extra.get("namespace", "sglang"))
        self.v1 = bool(int(extra.get("interface_v1", 0)))
        c = storage_config
        shard = f"pp{c.pp_rank}/{c.pp_size}|cp{c.attn_cp_rank}/{c.attn_cp_size}"
        if c.dcp_size > 1:
            shard += f"|dcp{c.dcp_rank}/{c.dcp_size}|page{c.logical_page_size}"
        tp = "" if c.is_mla_model else f"|tp{c.tp_rank}/{c.tp_size}"
        self.scope = f"{c.model_name or ''}|mla={int(c.is_mla_model)}{tp}|{shard}".encode()
        self._client = LazyClient(client_config(extra))
        self._parts: int | None = None  # buffers per page of the host pool (interface_v1)
        self._pool_scope = b""
        self.counters: Counter[str] = Counter()
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # ---- the store ---------------------------------------------------------------------------

    def _store(self) -> Any:
        return self._client.get()

    def key(self, page: str, part: int = -1) -> bytes:
        """The kvstore key of one of SGLang's pages (or of one buffer of it)."""
        return scoped_key(
            b"kvstore-sglang-v1",
            self.namespace.encode(),
            self.scope,
            self._pool_scope,
            str(page).encode(),
            b"%d" % part,
        )

    def _page_keys(self, keys: list[str], parts: int) -> list[bytes]:
        return [self.key(k, j) for k in keys for j in range(parts)]

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Also scopes the keys by how the pool lays a page out (layout, dtype, page size, layers,
        heads): the same page in another layout or dtype has other bytes of the same size."""
        super().register_mem_pool_host(mem_pool_host)
        self._parts = None
        h = mem_pool_host
        geometry = [getattr(h, a, None) for a in ("layout", "dtype", "page_size", "layer_num", "head_num", "head_dim")]
        self._pool_scope = "|".join(str(x) for x in geometry).encode()

    def _parts_per_page(self) -> int:
        if self._parts is None:
            host = self.mem_pool_host
            ptrs, _ = host.get_page_buffer_meta(torch.arange(host.page_size))
            self._parts = len(ptrs)
        return self._parts

    # ---- pages in place in the host pool (interface_v1) ----------------------------------------

    def _buffers(self, keys: list[str], host_indices: torch.Tensor) -> tuple[list[bytes], list[np.ndarray], int]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys):
            raise ValueError(f"{len(ptrs)} host buffers do not split into {len(keys)} pages")
        parts = len(ptrs) // len(keys)
        self._parts = parts
        return self._page_keys(keys, parts), [_host_bytes(p, s) for p, s in zip(ptrs, sizes)], parts

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        try:
            ks, bufs, parts = self._buffers(keys, host_indices)
            n = self._store().get_into(ks, bufs)
        except _FAILURES as e:
            self.counters["get_failures"] += 1
            log.warning("event=get_failed pages=%d reason=%r", len(keys), str(e))
            return [False] * len(keys)
        pages = n // parts
        self.counters["pages_loaded"] += pages
        return [i < pages for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        try:
            ks, bufs, _ = self._buffers(keys, host_indices)
            r = self._store().put(ks, bufs)
        except _FAILURES as e:
            self.counters["set_failures"] += 1
            log.warning("event=set_failed pages=%d reason=%r", len(keys), str(e))
            return [False] * len(keys)
        self.counters["pages_stored"] += len(keys)
        return [r.rejected == 0] * len(keys)

    # ---- whole pages as tensors ----------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        if not keys:
            return []
        if target_locations is None:
            raise ValueError("kvstore reads a page into a tensor it is given (target_locations)")
        try:
            n = self._store().get_into([self.key(k) for k in keys], [_tensor_bytes(t) for t in target_locations])
        except _FAILURES as e:
            self.counters["get_failures"] += 1
            log.warning("event=get_failed pages=%d reason=%r", len(keys), str(e))
            n = 0
        self.counters["pages_loaded"] += n
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if not keys:
            return True
        try:
            r = self._store().put([self.key(k) for k in keys], [_tensor_bytes(v.contiguous()) for v in values])
        except _FAILURES as e:
            self.counters["set_failures"] += 1
            log.warning("event=set_failed pages=%d reason=%r", len(keys), str(e))
            return False
        self.counters["pages_stored"] += len(keys)
        return r.rejected == 0

    # ---- existence -----------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Pages stored from the first on (the hit prefix length): one lookup RPC."""
        if not keys:
            return 0
        try:
            if self.v1 and getattr(self, "mem_pool_host", None) is not None:
                parts = self._parts_per_page()
                return self._store().lookup(self._page_keys(keys, parts)) // parts
            return self._store().lookup([self.key(k) for k in keys])
        except _FAILURES as e:
            self.counters["exists_failures"] += 1
            log.warning("event=exists_failed pages=%d reason=%r", len(keys), str(e))
            return 0

    def get_stats(self) -> dict:
        return dict(self.counters)

    def close(self) -> None:
        self._client.close()
