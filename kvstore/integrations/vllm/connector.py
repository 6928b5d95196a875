"""``KVStoreConnector``: vLLM's v1 KV connector backed by kvstore.

Loaded by vLLM from ``KVTransferConfig(kv_connector="KVStoreConnector",
kv_connector_module_path="kvstore.integrations.vllm", kv_role=..., kv_connector_extra_config={...},
kv_load_failure_policy="recompute")``. Settings (``kv_connector_extra_config``), all optional:

``meta`` (the metadata service, default ``$KVSTORE_META`` or ``127.0.0.1:7100``), ``token``,
``transport`` (auto, shm, tcp), ``namespace`` (default ``default``), ``model_id`` (default the
served model name: every instance that shares blocks must use the same), ``policy`` (``auto``:
load when the cost model says loading beats recomputing; ``always``; ``never``),
``save_decode`` (save blocks completed while decoding too, for the next turn; default true),
``rpc_timeout_s`` (default 5), ``stats_file`` (the worker writes its counters there as JSON).

Roles: ``kv_both`` loads stored prefixes and saves new blocks in the background (prefix reuse
across instances); ``kv_producer`` (the prefill side of prefill/decode disaggregation) saves and
waits for its saves to be stored before the step ends, so that a request's answer leaves only once
its KV can be pulled; ``kv_consumer`` (the decode side) only loads.

Scheduler side: one batched lookup per request for its prompt's blocks; the hit is capped so the
prompt's last token is computed. Worker side: a step's loads start before the forward pass and each
attention layer waits only for its own layer's copy into the paged cache; saves copy the completed
blocks out after the forward pass and put them (in the background for ``kv_both``). A block that
could not be loaded (store gone, block evicted, checksum mismatch) is reported through vLLM's
load-error path, and vLLM recomputes from there: run with ``kv_load_failure_policy="recompute"``
(vLLM's default, ``fail``, fails such requests instead).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvstore.integrations.store import LazyClient, client_config
from kvstore.integrations.vllm.blocks import PagedBlocks
from kvstore.integrations.vllm.plan import BACKOFF_MAX_S, BACKOFF_MIN_S, Planner, Transfer, split_keys
from kvstore.keys import KeySpace, ModelFingerprint

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvstore.vllm")


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    prefill_tokens: int = 0  # tokens of this step that are not one-token decodes


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Measurements a worker sends back to the scheduler's cost model."""

    loads: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    computes: list[tuple[int, float]] = field(default_factory=list)  # (prefill tokens, seconds)
    short_loads: list[tuple[str, int]] = field(default_factory=list)  # (request, blocks it holds up to)
    dropped_saves: list[tuple[str, int]] = field(default_factory=list)  # (request, first block dropped)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVStoreWorkerMetadata):
            return KVStoreWorkerMetadata(
                self.loads + other.loads,
                self.computes + other.computes,
                self.short_loads + other.short_loads,
                self.dropped_saves + other.dropped_saves,
            )
        return self


def _settings(vllm_config: Any) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def fingerprint(vllm_config: Any, tp_rank: int = 0) -> ModelFingerprint:
    """The key scope of a vLLM model: two instances share blocks only if these are equal. The keys
    the scheduler computes are rank 0's; each worker of a tensor/pipeline-parallel group rehashes
    them with its rank (:func:`plan.split_keys`), so every rank's part of a block has its own key."""
    s = _settings(vllm_config)
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    # The checkpoint itself (path or hub id, revision, quantization), not a served alias that a
    # later deployment may give another model. Instances that load the same weights from
    # different paths set model_id to share.
    model_id = s.get("model_id") or f"{mc.model}@{mc.revision or ''}|quantization={mc.quantization or ''}"
    return ModelFingerprint(
        model_id=str(model_id),
        dtype=dtype,
        num_layers=mc.get_total_num_hidden_layers(),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(),
        block_size=cc.block_size,
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
        layout=f"vllm:{vllm_config.device_config.device_type}|pp{pc.pipeline_parallel_size}",
    )


def shard_tag(vllm_config: Any, tp_rank: int, pp_rank: int) -> str:
    """A worker's rank, folded into its keys when there is more than one (see split_keys)."""
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size == 1 and pc.pipeline_parallel_size == 1:
        return ""
    return f"tp{tp_rank}/{pc.tensor_parallel_size}|pp{pp_rank}/{pc.pipeline_parallel_size}"


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = _settings(vllm_config)
        try:
            # One retry: vLLM's scheduler waits for each lookup.
            self._store = LazyClient(client_config(self.settings, retries=1))
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_connector_extra_config: {e}") from None
        tc = vllm_config.kv_transfer_config
        self.producer = tc.kv_role == "kv_producer"
        self.consumer = tc.kv_role == "kv_consumer"
        namespace = self.settings.get("namespace", "default")
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "event=load_failure_policy policy=%s effect=requests_fail_when_a_stored_block_cannot_be_loaded "
                "hint=kv_load_failure_policy=recompute",
                tc.kv_load_failure_policy,
            )
        if role == KVConnectorRole.SCHEDULER:
            fp = fingerprint(vllm_config)
            self.shard = shard_tag(vllm_config, 0, 0)  # lookups ask for rank 0's part
            import torch as _torch

            dt = getattr(_torch, fp.dtype, None)
            elem = _torch.empty((), dtype=dt).element_size() if isinstance(dt, _torch.dtype) else 1
            block_bytes = 2 * fp.num_kv_heads * fp.head_dim * elem * fp.block_size * fp.num_layers
            self.planner = Planner(
                KeySpace(fp, namespace=namespace),
                self._lookup,
                block_bytes=block_bytes // fp.tp_size,
                load=not self.producer or self.settings.get("producer_loads", True),
                save=not self.consumer,
                save_decode=bool(self.settings.get("save_decode", True)) and not self.producer,
                policy=self.settings.get("policy", "auto"),
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            try:
                rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
            except Exception:  # noqa: BLE001 - not initialized: a single worker
                rank, pp_rank = 0, 0
            self.shard = shard_tag(vllm_config, rank, pp_rank)
            self.block_size = vllm_config.cache_config.block_size
            self.blocks: PagedBlocks | None = None
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-load")
            self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")
            self._load: Future | None = None
            self._loaded: list[tuple[Transfer, Any, int]] | None = None
            self._last_loaded: list[tuple[Transfer, Any, int]] = []
            self._layers_left: set[int] = set()
            self._load_errors: set[int] = set()
            self._pending: deque[Future] = deque()
            self._save_quiet_until = 0.0
            self._save_backoff = 0.0
            self._measured = KVStoreWorkerMetadata()
            self._forward_t0: float | None = None
            self._scatter_s = 0.0
            self.max_pending_saves = int(self.settings.get("max_pending_saves", 64))
            self.counters = {
                "loads": 0, "blocks_loaded": 0, "tokens_loaded": 0, "blocks_failed": 0, "load_errors": 0,
                "blocks_saved": 0, "saves_dropped": 0, "save_failures": 0,
            }  # fmt: skip
            self._stats_file = self.settings.get("stats_file")

    # ---- the store -----------------------------------------------------------------------

    def store(self) -> Any:
        return self._store.get()

    def _lookup(self, packed: bytes) -> int:
        return self.store().lookup(split_keys(packed, self.shard))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads land in the paged cache layer by layer as attention runs (wait_for_layer_load): a
        # full CUDA graph would replay attention without those calls.
        return True

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.planner.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        loads, saves = self.planner.step(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        prefill = sum(n for n in scheduled.values() if n > 1)
        return KVStoreConnectorMetadata(loads, saves, prefill)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVStoreWorkerMetadata):
            for nbytes, s in meta.loads:
                self.planner.cost.observe_load(nbytes, s)
            for tokens, s in meta.computes:
                self.planner.cost.observe_compute(tokens, s)
            if meta.short_loads or meta.dropped_saves:
                self.planner.failed(meta.short_loads, meta.dropped_saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        if num_blocks is None:
            num_blocks = next(iter(kv_caches.values())).shape[0]
        self.blocks = PagedBlocks(kv_caches, num_blocks)
        log.info(
            "event=kv_caches_registered layers=%d block_bytes=%d blocks=%d",
            len(self.blocks.layers), self.blocks.block_bytes, num_blocks,
        )  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or self.blocks is None or not meta.loads:
            return
        self._loaded = None
        self._layers_left = set(range(len(self.blocks.layers)))
        self._load = self._loader.submit(self._fetch, meta.loads)

    def _fetch(self, loads: list[Transfer]) -> list[tuple[Transfer, Any, int]]:
        """Gets each request's blocks into a host buffer; returns (transfer, buffer, loaded)."""
        out = []
        for t in loads:
            buf = self.blocks.buffer(len(t))  # type: ignore[union-attr]
            t0 = time.perf_counter()
            try:
                n = self.store().get_into(split_keys(t.keys, self.shard), list(buf))
            except Exception as e:  # noqa: BLE001 - a load that fails is recomputed, never vLLM's crash
                self.counters["load_errors"] += 1
                log.warning("event=load_failed request=%s blocks=%d reason=%r", t.req_id, len(t), str(e))
                n = 0
            if n:
                self._measured.loads.append((n * buf.shape[1], time.perf_counter() - t0))
            out.append((t, buf, n))
        return out

    def _wait_loaded(self) -> list[tuple[Transfer, Any, int]]:
        if self._loaded is None and self._load is not None:
            self._loaded = self._load.result()
            self._load = None
            for t, _buf, n in self._loaded:
                self.counters["loads"] += 1
                self.counters["blocks_loaded"] += n
                self.counters["tokens_loaded"] += n * self.block_size
                if n < len(t):
                    self.counters["blocks_failed"] += len(t) - n
                    self._load_errors.update(t.block_ids[n:])
                    self._measured.short_loads.append((t.req_id, t.first + n))
                    log.info("event=short_load request=%s loaded=%d of=%d", t.req_id, n, len(t))
        return self._loaded or []

    def _scatter(self, layer: int) -> None:
        t0 = time.perf_counter()
        for t, buf, n in self._wait_loaded():
            if n:
                self.blocks.scatter(layer, buf, t.block_ids[:n])  # type: ignore[union-attr]
        self._layers_left.discard(layer)
        self._scatter_s += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._forward_t0 is None:
            self._forward_t0 = time.perf_counter()
        if self.blocks is None or not self._layers_left:
            return
        i = self.blocks.index.get(layer_name)
        if i is not None and i in self._layers_left:
            self._scatter(i)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are copied out once, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self.blocks is None or not isinstance(meta, KVStoreConnectorMetadata):
            return
        for layer in sorted(self._layers_left):  # layers the forward pass did not wait for
            self._scatter(layer)
        self._last_loaded = self._loaded or []
        self._loaded = None
        end = time.perf_counter()
        if self._forward_t0 is not None and meta.prefill_tokens > 0:
            self._measured.computes.append((meta.prefill_tokens, max(1e-9, end - self._forward_t0 - self._scatter_s)))
        self._forward_t0 = None
        self._scatter_s = 0.0
        futs = []
        if any(n < len(t) for t, _buf, n in self._last_loaded):
            # A load of this step failed: blocks computed in it may rest on unloaded KV (vLLM
            # recomputes them); none is saved, and the scheduler plans them again.
            self.counters["saves_dropped"] += sum(len(t) for t in meta.saves)
            self._measured.dropped_saves += [(t.req_id, t.first) for t in meta.saves]
            meta = KVStoreConnectorMetadata(meta.loads, [], meta.prefill_tokens)
        self._last_loaded = []
        for t in meta.saves:
            f = self._save(t)
            if f is not None:
                futs.append(f)
        if self.producer:
            for f in futs:  # the decode side pulls these once this request's answer is out
                f.result()
        if meta.loads or meta.saves:
            self._write_stats()

    def _save(self, t: Transfer) -> Future | None:
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        if time.monotonic() < self._save_quiet_until:  # the store failed a save a moment ago
            self.counters["saves_dropped"] += len(t)
            return None
        if len(self._pending) >= self.max_pending_saves and not self.producer:
            self.counters["saves_dropped"] += len(t)
            return None
        data = self.blocks.gather(t.block_ids)  # type: ignore[union-attr]
        f = self._saver.submit(self._put, t, data)
        self._pending.append(f)
        return f

    def _put(self, t: Transfer, data: Any) -> None:
        try:
            r = self.store().put(split_keys(t.keys, self.shard), list(data))
            self.counters["blocks_saved"] += r.stored + r.skipped
            self._save_backoff = 0.0
        except Exception as e:  # noqa: BLE001 - a save that fails is a later miss, never vLLM's crash
            self.counters["save_failures"] += 1
            # Saves are not tried again for a while (doubling), so that a producer does not wait
            # for a store that cannot answer step after step.
            self._save_backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._save_backoff))
            self._save_quiet_until = time.monotonic() + self._save_backoff
            log.warning("event=save_failed request=%s blocks=%d reason=%r", t.req_id, len(t), str(e))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._measured.loads and not self._measured.computes:
            return None
        out, self._measured = self._measured, KVStoreWorkerMetadata()
        return out

    def _write_stats(self) -> None:
        if not self._stats_file:
            return
        path = Path(self._stats_file)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.counters))
            tmp.replace(path)
        except OSError as e:
            log.warning("event=stats_not_written path=%s reason=%r", path, str(e))

    def shutdown(self) -> None:
        if self.role != KVConnectorRole.SCHEDULER:
            for f in list(self._pending):
                try:
                    f.result(timeout=30)
                except Exception:  # noqa: BLE001 - logged where it failed
                    pass
            self._write_stats()
            self._loader.shutdown(wait=False)
            self._saver.shutdown(wait=True)
        self._store.close()
