"""The store connector: the only seam between the engine and kvstore.

It plugs into the engine's two hooks (``engine.hooks``):

- **load** (before a prefill): look up how long a prefix the store holds (no side effects),
  decide whether loading it is cheaper than recomputing it, and load it straight into the
  sequence's blocks of the paged cache. A failed, short or refused load is a shorter hit: the
  engine computes the rest. Never an error, never wrong KV (every block is checksum-verified by
  the client before it counts).
- **save** (after a forward pass completed full blocks): copy the blocks out of the cache
  (their ids are only valid during the call) and put them in the background, so the request
  is not held up; ``wait_saved(request_id)`` is there for a prefill worker that must hand a
  request to a decode worker only once its blocks are in the store.

Device memory: on a CPU the store reads and writes the cache's blocks in place (each block is
one contiguous chunk). When the cache lives on a GPU, blocks go through a pinned host staging
pool (``engine.staging``) and the custom copy kernels (``engine.kv_copy``): one gather launch
fills a slab for a save, one scatter launch empties it after a load, on the pool's own stream.

Load or recompute: loading n blocks costs about ``latency + bytes / bandwidth`` (both measured
on past loads), recomputing them ``tokens / prefill throughput`` (measured by the worker and fed
in with :meth:`observe_compute`). Until both are measured, it loads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.hooks import LoadRequest, SavedBlocks
from engine.kv_cache import KVCache
from kvstore.errors import KVStoreError
from kvstore.integrations.cost import LoadCost

log = logging.getLogger("engine.connector")


@dataclass
class ConnectorStats:
    lookups: int = 0  # loads tried (a get each; it finds how much is stored)
    tokens_loaded: int = 0
    blocks_loaded: int = 0
    load_failures: int = 0
    loads_skipped: int = 0  # recompute judged cheaper
    short_loads: int = 0  # fewer blocks stored than the request could have loaded
    blocks_saved: int = 0
    saves_dropped: int = 0
    save_failures: int = 0
    load_seconds: float = 0.0
    load_bytes: int = 0
    per_request: dict = field(default_factory=dict)


class StoreConnector:
    """Connects one engine (its ``kv_cache``) to the store through a synchronous client.

    Thread-safe: hooks run on the engine thread, saves run on a background thread.
    """

    def __init__(
        self,
        client,  # kvstore.SyncKVStoreClient (or anything with lookup / get_into / put)
        kv_cache: KVCache,
        policy: str = "auto",
        max_pending_saves: int = 64,
        staging_blocks: int = 256,
    ) -> None:
        if policy not in ("auto", "always", "never"):
            raise ValueError(f"connector policy must be auto, always or never, got {policy!r}")
        self.client = client
        self.cache = kv_cache
        self.policy = policy
        self.block_size = kv_cache.block_size
        self.block_bytes = kv_cache.block_nbytes
        self.stats = ConnectorStats()
        self.cost = LoadCost()
        # The measurements, by the names the worker's health report reads.
        self.bandwidth = self.cost.bandwidth
        self.latency = self.cost.latency
        self.prefill_tps = self.cost.prefill_tps
        self.effective_bandwidth = self.cost.effective_bandwidth
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-save")
        self.on_gpu = kv_cache.tensor.device.type == "cuda"
        self.pool = None
        if self.on_gpu:
            from engine.staging import StagingPool

            self.slab_blocks = staging_blocks
            self.pool = StagingPool(slab_bytes=staging_blocks * self.block_bytes, num_slabs=4)
        self._pending: deque[Future] = deque()
        self._by_request: dict[int, list[Future]] = {}
        self._lock = threading.Lock()
        self.max_pending_saves = max_pending_saves

    # ---- measurements -----------------------------------------------------------------------

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """Feeds the prefill throughput the worker measured (tokens computed in ``seconds``)."""
        self.cost.observe_compute(tokens, seconds)

    def estimate_load_s(self, blocks: int) -> float | None:
        return self.cost.estimate_load_s(blocks * self.block_bytes)

    def estimate_compute_s(self, tokens: int) -> float | None:
        return self.cost.estimate_compute_s(tokens)

    def worth_loading(self, blocks: int) -> bool:
        if self.policy != "auto":
            return self.policy == "always"
        return self.cost.worth_loading(blocks * self.block_bytes, blocks * self.block_size)

    # ---- hooks ------------------------------------------------------------------------------

    def load(self, req: LoadRequest) -> int:
        """The engine's load hook. Returns leading tokens present (never raises)."""
        bs = self.block_size
        first = req.num_cached_tokens // bs
        last = req.max_tokens // bs  # exclusive: blocks a load may fill
        if self.policy == "never" or last <= first:
            return req.num_cached_tokens
        keys = list(req.keys[:last])
        # No lookup first: the load itself finds how much of the prefix is stored (a get loads the
        # longest stored run, reading known blocks without the metadata service), so the
        # decision is made for the most that could be loaded; a smaller load is no more worth
        # it (the fixed cost of a load weighs more on fewer blocks).
        n = last - first
        if not self.worth_loading(n):
            self.stats.loads_skipped += 1
            return req.num_cached_tokens
        try:
            self.stats.lookups += 1
            t = time.perf_counter()
            if self.on_gpu:
                got = self._load_staged(keys[first : first + n], list(req.block_ids[first : first + n]))
            else:
                views = [self.cache.block_view(b) for b in req.block_ids[first : first + n]]
                got = self.client.get_into(keys[first : first + n], views)
            dt = time.perf_counter() - t
        except (KVStoreError, OSError, ValueError) as e:
            self.stats.load_failures += 1
            log.warning("event=load_failed request=%d reason=%r", req.request_id, str(e))
            return req.num_cached_tokens
        if got < n:
            self.stats.short_loads += 1
        if got:
            nbytes = got * self.block_bytes
            self._observe_load(nbytes, dt)
            self.stats.blocks_loaded += got
            self.stats.tokens_loaded += got * bs
            self.stats.load_bytes += nbytes
            self.stats.load_seconds += dt
        self.stats.per_request[req.request_id] = (got * bs, dt)
        return (first + got) * bs

    def _load_staged(self, keys: list[bytes], block_ids: list[int]) -> int:
        """GPU cache: store -> pinned slab -> one scatter launch per slab of blocks."""
        from engine import kv_copy

        got = 0
        bb = self.block_bytes
        for lo in range(0, len(keys), self.slab_blocks):
            chunk = keys[lo : lo + self.slab_blocks]
            with self.pool.acquire() as slab:  # type: ignore[union-attr]
                host = slab.numpy(np.uint8, (len(chunk), bb))
                n = self.client.get_into(chunk, list(host))
                if n:
                    src = slab.torch(torch.uint8, (n * bb,))
                    kv_copy.scatter(self.cache.tensor, block_ids[lo : lo + n], src, stream=self.pool.stream)  # type: ignore[union-attr]
                    self.pool.synchronize()  # type: ignore[union-attr]
            got += n
            if n < len(chunk):
                break
        return got

    def _observe_load(self, nbytes: int, seconds: float) -> None:
        self.cost.observe_load(nbytes, seconds)

    def save(self, blocks: SavedBlocks) -> None:
        """The engine's save hook: copies the blocks out now, puts them in the background."""
        if not blocks.keys:
            return
        with self._lock:
            while self._pending and self._pending[0].done():
                self._pending.popleft()
            if len(self._pending) >= self.max_pending_saves:
                self.stats.saves_dropped += len(blocks.keys)
                return
        keys = list(blocks.keys)
        if self.on_gpu:
            # One gather launch into a pinned slab; the slab goes back after the put.
            from engine import kv_copy

            keys = keys[: self.slab_blocks]
            slab = self.pool.acquire()  # type: ignore[union-attr]
            out = slab.torch(torch.uint8, (len(keys) * self.block_bytes,))
            kv_copy.gather(self.cache.tensor, list(blocks.block_ids[: len(keys)]), out=out, stream=self.pool.stream)  # type: ignore[union-attr]
            self.pool.synchronize()  # type: ignore[union-attr]
            staged = slab.numpy(np.uint8, (len(keys), self.block_bytes))
            fut = self._saver.submit(self._put, blocks.request_id, keys, staged, slab)
        else:
            staged = self.cache.gather(list(blocks.block_ids))  # a copy: the ids may be reused after this call
            fut = self._saver.submit(self._put, blocks.request_id, keys, staged)
        with self._lock:
            self._pending.append(fut)
            self._by_request.setdefault(blocks.request_id, []).append(fut)

    def _put(self, request_id: int, keys: list[bytes], staged, slab=None) -> int:  # noqa: ANN001
        try:
            res = self.client.put(keys, [staged[i] for i in range(len(keys))])
        except (KVStoreError, OSError, ValueError) as e:
            self.stats.save_failures += 1
            log.warning("event=save_failed request=%d blocks=%d reason=%r", request_id, len(keys), str(e))
            return 0
        finally:
            if slab is not None:
                slab.release()
        self.stats.blocks_saved += res.stored
        return res.stored + res.skipped

    def wait_saved(self, request_id: int, timeout: float = 30.0) -> int:
        """Blocks until the request's saves finished; returns how many of its blocks the store holds."""
        with self._lock:
            futs = self._by_request.pop(request_id, [])
        total = 0
        deadline = time.monotonic() + timeout
        for f in futs:
            try:
                total += f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a save that did not finish counts as not saved
                pass
        return total

    def take_load(self, request_id: int) -> tuple[int, float]:
        """(tokens loaded, seconds the load took) for a request, forgotten afterwards."""
        return self.stats.per_request.pop(request_id, (0, 0.0))

    def close(self) -> None:
        self._saver.shutdown(wait=True)
