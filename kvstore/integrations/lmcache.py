"""kvstore as LMCache's second tier: an ``L2AdapterInterface`` plugin for ``lmcache server``.

    lmcache server --l1-size-gb 1 --supported-transfer-mode auto --l2-adapter \\
      '{"type": "plugin", "module_path": "kvstore.integrations.lmcache",
        "class_name": "KVStoreL2Adapter", "adapter_params": {"meta": "127.0.0.1:7100"}}'

``adapter_params``: ``meta`` (default ``$KVSTORE_META`` or ``127.0.0.1:7100``), ``namespace``
(``lmcache``), ``token``, ``transport``, ``workers`` (threads that run tasks, default 2),
``rpc_timeout_s`` (5).

An LMCache object key (chunk hash, model, KV rank, object group, cache salt) becomes one 16-byte
kvstore key: a 128-bit hash of all of them under the namespace, so that the same chunk of two
models, ranks or salts never shares a block, and every LMCache server on the same store and
namespace shares every chunk. An object's bytes are one block.

Tasks run on a small thread pool and signal the event fds LMCache waits on. Store: one put per
task (its keys are not assumed to be a chain). Lookup: one ``exists`` per task, a bit per key.
Lock: LMCache locks what a lookup found until it loads it; kvstore has no lock that ends with
the process that took it (a pin outlives a crashed server and would keep its blocks from eviction
for good), so nothing is locked: a block evicted between lookup and load is a failed bit of the
load, which LMCache handles as a miss (its interface allows a load to fail).
Load: one get per task of the keys' leading stored run, verified by checksum; a key after the
first that failed is reported failed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from kvstore.errors import KVStoreError
from kvstore.integrations.store import LazyClient, client_config, scoped_key

log = logging.getLogger("kvstore.lmcache")


def object_key(namespace: str, key: Any) -> bytes:
    """The kvstore key of an LMCache ObjectKey (16 bytes)."""
    return scoped_key(
        b"kvstore-lmcache-v1",
        namespace.encode(),
        str(key.model_name).encode(),
        str(int(key.kv_rank)).encode(),
        str(int(getattr(key, "object_group_id", 0))).encode(),
        str(getattr(key, "cache_salt", "") or "").encode(),
        bytes(key.chunk_hash),
    )


def _bytes_of(obj: Any) -> np.ndarray:
    """An LMCache MemoryObj's bytes (its logical size), as a writable uint8 array over them."""
    return np.frombuffer(obj.byte_array, dtype=np.uint8)


class KVStoreL2Adapter(L2AdapterInterface):
    def __init__(self, params: dict[str, Any] | None = None, **_: Any) -> None:
        super().__init__(max_capacity_bytes=0)  # the store evicts by itself
        params = dict(params or {})
        self.namespace = str(params.get("namespace", "lmcache"))
        self._store = LazyClient(client_config(params))
        self._pool = ThreadPoolExecutor(max_workers=int(params.get("workers", 2)), thread_name_prefix="kvstore-l2")
        self._efd = {name: create_event_notifier() for name in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._next = 0
        self._done: dict[str, dict[L2TaskId, Any]] = {"store": {}, "lookup": {}, "load": {}}
        self.counters: Counter[str] = Counter()

    def _keys(self, keys: list[Any]) -> list[bytes]:
        return [object_key(self.namespace, k) for k in keys]

    def _submit(self, kind: str, run: Callable[[], Any], failed: Any, n: int) -> L2TaskId:
        """Runs ``run`` on the pool as task ``kind``; its result (``failed`` if it raised) is kept
        for LMCache to collect, and the kind's event fd is signalled. A task always completes:
        LMCache would otherwise wait for it for ever."""
        with self._lock:
            self._next += 1
            task = self._next

        def go() -> None:
            try:
                result = run()
            except Exception as e:  # noqa: BLE001 - reported as the task's failure, see above
                result = failed
                self.counters[f"{kind}_failures"] += 1
                if isinstance(e, (KVStoreError, OSError, ValueError)):
                    log.warning("event=%s_failed keys=%d reason=%r", kind, n, str(e))
                else:
                    log.exception("event=%s_failed keys=%d", kind, n)
            with self._lock:
                self._done[kind][task] = result
            self._efd[kind].notify()

        self._pool.submit(go)
        return task

    def _collect(self, kind: str, task: L2TaskId) -> Any:
        with self._lock:
            return self._done[kind].pop(task, None)

    # ---- event fds ---------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    # ---- store -------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        keys, objects = list(keys), list(objects)

        def run() -> L2StoreResult:
            data = [_bytes_of(o) for o in objects]
            r = self._store.get().put(self._keys(keys), data, chain=False)
            self.counters["stored"] += r.stored
            self.counters["skipped"] += r.skipped
            if r.rejected:
                self.counters["rejected"] += r.rejected
                return L2StoreResult(False, 0)
            self._notify_keys_stored(keys, [d.size for d in data])
            return L2StoreResult(True, sum(d.size for d in data))

        return self._submit("store", run, L2StoreResult(False, 0), len(keys))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    # ---- lookup (and no lock, see the module's text) -----------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> L2TaskId:
        keys = list(keys)

        def run() -> Bitmap:
            bits = Bitmap(len(keys))
            for i, hit in enumerate(self._store.get().exists(self._keys(keys)) if keys else []):
                if hit:
                    bits.set(i)
            self.counters["lookups"] += 1
            return bits

        return self._submit("lookup", run, Bitmap(len(keys)), len(keys))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._collect("lookup", task_id)

    def submit_unlock(self, keys: list[Any]) -> None:
        return  # nothing was locked

    # ---- load --------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        keys, objects = list(keys), list(objects)

        def run() -> Bitmap:
            bits = Bitmap(len(keys))
            n = self._store.get().get_into(self._keys(keys), [_bytes_of(o) for o in objects]) if keys else 0
            if n:
                bits.set_range(0, n)
            self.counters["blocks_loaded"] += n
            self.counters["blocks_missed"] += len(keys) - n
            return bits

        return self._submit("load", run, Bitmap(len(keys)), len(keys))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._collect("load", task_id)

    # ---- the rest ----------------------------------------------------------------------------

    def report_status(self) -> dict:
        return {"is_healthy": True, "type": "KVStoreL2Adapter", "meta": self._store.cfg.meta, **self.counters}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()
        for e in self._efd.values():
            e.close()
