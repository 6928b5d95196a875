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
for good), so the lock is kept here, per process, and a block evicted between lookup and load is
a failed bit of the load, which LMCache handles as a miss (its interface allows a load to fail).
Load: one get per task of the keys' leading stored run, verified by checksum; a key after the
first that failed is reported failed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.lmcache")


def object_key(namespace: str, key: Any) -> bytes:
    """The kvstore key of an LMCache ObjectKey (16 bytes)."""
    h = xxhash.xxh3_128()
    for part in (
        b"kvstore-lmcache-v1",
        namespace.encode(),
        str(key.model_name).encode(),
        str(int(key.kv_rank)).encode(),
        str(int(getattr(key, "object_group_id", 0))).encode(),
        str(getattr(key, "cache_salt", "") or "").encode(),
    ):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(bytes(key.chunk_hash))
    return h.digest()


def _bytes_of(obj: Any) -> np.ndarray:
    """An LMCache MemoryObj's bytes (its logical size), as a writable uint8 array over them."""
    return np.frombuffer(obj.byte_array, dtype=np.uint8)


class KVStoreL2Adapter(L2AdapterInterface):
    def __init__(self, params: dict[str, Any] | None = None, **_: Any) -> None:
        super().__init__(max_capacity_bytes=0)  # the store evicts by itself
        params = dict(params or {})
        self.namespace = str(params.get("namespace", "lmcache"))
        meta = params.get("meta") or os.environ.get("KVSTORE_META") or "127.0.0.1:7100"
        timeout = float(params.get("rpc_timeout_s", 5.0))
        self._cfg = ClientConfig(
            meta=meta,
            transport=params.get("transport", "auto"),
            token=params.get("token", ""),
            rpc_timeout_s=timeout,
            io_timeout_s=timeout,
        )
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=int(params.get("workers", 2)), thread_name_prefix="kvstore-l2")
        self._efd = {name: create_event_notifier() for name in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._next = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._locked: Counter[bytes] = Counter()
        self.counters = Counter()

    # ---- the store -------------------------------------------------------------------------

    def _store(self) -> Any:
        with self._client_lock:
            if self._client is None:
                from kvstore.client.sync import SyncKVStoreClient

                self._client = SyncKVStoreClient(self._cfg.meta, self._cfg)
            return self._client

    def _task(self) -> L2TaskId:
        with self._lock:
            self._next += 1
            return self._next

    # ---- event fds ---------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    # ---- store -------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        task = self._task()
        self._pool.submit(self._run_store, task, list(keys), list(objects))
        return task

    def _run_store(self, task: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        ok, nbytes = True, 0
        try:
            data = [_bytes_of(o) for o in objects]
            r = self._store().put([object_key(self.namespace, k) for k in keys], data, chain=False)
            nbytes = sum(d.size for d in data)
            self.counters["stored"] += r.stored
            self.counters["skipped"] += r.skipped
            if r.rejected:
                ok = False
                self.counters["rejected"] += r.rejected
            else:
                self._notify_keys_stored(keys, [d.size for d in data])
        except (KVStoreError, OSError, ValueError) as e:
            ok = False
            self.counters["store_failures"] += 1
            log.warning("event=store_failed keys=%d reason=%r", len(keys), str(e))
        except Exception:  # noqa: BLE001 - a task must always complete, or LMCache waits for ever
            ok = False
            log.exception("event=store_failed keys=%d", len(keys))
        with self._lock:
            self._stores[task] = L2StoreResult(ok, nbytes if ok else 0)
        self._efd["store"].notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # ---- lookup and lock ---------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> L2TaskId:
        task = self._task()
        self._pool.submit(self._run_lookup, task, list(keys))
        return task

    def _run_lookup(self, task: L2TaskId, keys: list[Any]) -> None:
        bits = Bitmap(len(keys))
        try:
            ks = [object_key(self.namespace, k) for k in keys]
            found = self._store().exists(ks) if ks else []
            with self._lock:
                for i, (k, hit) in enumerate(zip(ks, found)):
                    if hit:
                        bits.set(i)
                        self._locked[k] += 1
            self.counters["lookups"] += 1
        except (KVStoreError, OSError, ValueError) as e:
            self.counters["lookup_failures"] += 1
            log.warning("event=lookup_failed keys=%d reason=%r", len(keys), str(e))
        except Exception:  # noqa: BLE001 - see _run_store
            log.exception("event=lookup_failed keys=%d", len(keys))
        with self._lock:
            self._lookups[task] = bits
        self._efd["lookup"].notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        with self._lock:
            for k in keys:
                kk = object_key(self.namespace, k)
                if self._locked[kk] <= 1:
                    self._locked.pop(kk, None)
                else:
                    self._locked[kk] -= 1

    # ---- load --------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        task = self._task()
        self._pool.submit(self._run_load, task, list(keys), list(objects))
        return task

    def _run_load(self, task: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        bits = Bitmap(len(keys))
        try:
            if keys:
                n = self._store().get_into(
                    [object_key(self.namespace, k) for k in keys], [_bytes_of(o) for o in objects]
                )
                if n:
                    bits.set_range(0, n)
                self.counters["blocks_loaded"] += n
                self.counters["blocks_missed"] += len(keys) - n
        except (KVStoreError, OSError, ValueError) as e:
            self.counters["load_failures"] += 1
            log.warning("event=load_failed keys=%d reason=%r", len(keys), str(e))
        except Exception:  # noqa: BLE001 - see _run_store
            log.exception("event=load_failed keys=%d", len(keys))
        with self._lock:
            self._loads[task] = bits
        self._efd["load"].notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    # ---- the rest ----------------------------------------------------------------------------

    def report_status(self) -> dict:
        return {"is_healthy": True, "type": "KVStoreL2Adapter", "meta": self._cfg.meta, **self.counters}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
        for e in self._efd.values():
            e.close()
