"""The front end: an OpenAI-compatible HTTP API and a cache-aware, SLO-aware router.

Endpoints: ``POST /v1/completions`` (streaming or not), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text; labels are bounded: never a request id or key).

Routing (``mode="disagg"``): a request goes to the prefill worker with the lowest estimated
time to first token, then to a decode worker chosen by load against the TPOT target::

    est_ttft(w) = queued_tokens(w) / tps(w)                  # what is ahead of it (their uncached tokens)
                + uncached_tokens(w) / tps(w)                # what it must compute
                + transfer_bytes(w) / bandwidth(w)           # what it must load from the store

``uncached`` counts the prompt's tokens beyond the longer of two cached prefixes: the store's
and the worker's own cache, both from one side-effect-free per-tier lookup of the prompt's block
keys (the device tier: what each worker reported its cache holds, ``engine.device_tier``, plus
what the router sent it since its last report could land; for a worker that does not report,
what the router recently sent it). Only the part the worker does not hold itself is loaded.
Throughput and bandwidth are what the workers measured. A request whose best estimate misses
``ttft_target_s`` is refused at once with HTTP 429. ``routing="round_robin"`` ignores all of this
and ``routing="least_loaded"`` looks only at the queues (both for comparison);
``mode="colocated"`` sends the whole request to one worker that does both phases.

Every response carries, besides the OpenAI fields, ``kvstore``: TTFT, TPOT, and the prompt
tokens loaded from the store, found in the worker's local cache, and computed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)

log = logging.getLogger("engine.router")

# How long a worker's cache event may take to reach the index (its reporter's interval, twice).
REPORT_LAG_S = 0.5
# The fixed cost of a pull: the export call and the store's put round trips.
PULL_OVERHEAD_S = 0.005

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class RouterConfig:
    model_name: str = "kvstore-llama"
    mode: str = "disagg"  # or "colocated"
    routing: str = "cache_aware"  # or "round_robin", "least_loaded"
    ttft_target_s: float = 5.0
    tpot_target_s: float = 0.5
    health_interval_s: float = 0.5
    recent_keys_per_worker: int = 50_000
    request_timeout_s: float = 600.0


@dataclass
class WorkerRef:
    url: str
    role: str
    alive: bool = True
    health: dict = field(default_factory=dict)
    queued_tokens: int = 0  # router-side: tokens it will compute for requests sent and not yet prefilled
    active: int = 0  # router-side: requests in flight
    recent: OrderedDict = field(default_factory=OrderedDict)  # block keys it recently computed or loaded

    def tps(self) -> float:
        return self.health.get("prefill_tps") or 2000.0

    def local_hit(self, keys: list[bytes], since: float = 0.0) -> int:
        """Leading keys the router sent this worker (at or after ``since``, monotonic)."""
        n = 0
        for k in keys:
            t = self.recent.get(k)
            if t is None or t < since:
                break
            n += 1
        return n

    def remember(self, keys: list[bytes], limit: int) -> None:
        now = time.monotonic()
        for k in keys:
            self.recent[k] = now
            self.recent.move_to_end(k)
        while len(self.recent) > limit:
            self.recent.popitem(last=False)

    @property
    def reports_device_tier(self) -> bool:
        """The worker reports its cache to the store's index (engine.device_tier), and its last
        report was taken."""
        dt = self.health.get("device_tier")
        return bool(dt) and bool(dt.get("synced", True))

    @property
    def engine_id(self) -> str:
        return (self.health.get("device_tier") or {}).get("engine_id") or self.url

    def device_hit(self, keys: list[bytes], tiers) -> int:  # noqa: ANN001 - kvstore TierLookup or None
        """Leading keys this worker holds in its own cache: as it reported them to the store's
        index (plus what the router sent it since its last report could land), or, for a worker
        that does not report, as the router remembers sending them."""
        if tiers is None or not tiers.per_tier or not self.reports_device_tier:
            return self.local_hit(keys)
        return max(tiers.device(self.engine_id), self.local_hit(keys, since=time.monotonic() - REPORT_LAG_S))


class Choice(NamedTuple):
    worker: WorkerRef
    est: float  # estimated seconds to first token
    cost: int  # tokens it will compute
    pull_from: WorkerRef | None = None  # a peer whose cache holds a longer prefix, exported first
    pull_blocks: int = 0  # the prefix length (blocks) held once the pull is done


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Metrics:
    """The router's Prometheus metrics (``prometheus-client``, its own registry): requests by
    status, prompt tokens by where they came from, TTFT and TPOT, workers alive by role."""

    def __init__(self, workers: Callable[[], list[WorkerRef]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter("kvstore_engine_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self._tokens = Counter(
            "kvstore_engine_tokens",
            "Tokens by kind: prompt, loaded (from kvstore), cached (worker's own cache), computed, generated",
            ["kind"],
            registry=r,
        )
        for kind in ("prompt", "loaded", "cached", "computed", "generated"):
            self._tokens.labels(kind)
        self._ttft = Histogram("kvstore_engine_ttft_seconds", "Time to first token", registry=r, buckets=TTFT_BUCKETS)
        self._tpot = Summary("kvstore_engine_tpot_seconds", "Time per output token after the first", registry=r)
        self._workers = workers or (lambda: [])
        gauge = Gauge("kvstore_engine_workers", "Workers by role and state", ["role", "state"], registry=r)
        for role in ("prefill", "decode", "both"):
            gauge.labels(role, "alive").set_function(
                lambda role=role: sum(1 for w in self._workers() if w.role == role and w.alive)
            )

    def request(self, status: str) -> None:
        self._requests.labels(status).inc()

    def tokens(self, kind: str, n: int) -> None:
        self._tokens.labels(kind).inc(n)

    def observe(self, info: dict) -> None:
        self._ttft.observe(info["ttft_ms"] / 1000)
        if info.get("tpot_ms") is not None:
            self._tpot.observe(info["tpot_ms"] / 1000)
        for k, src in (("loaded", "tokens_loaded"), ("cached", "tokens_cached"), ("computed", "tokens_computed")):
            self._tokens.labels(k).inc(info.get(src, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Router:
    def __init__(self, cfg: RouterConfig, workers: list[WorkerRef], store: str = "") -> None:
        if cfg.mode not in ("disagg", "colocated"):
            raise ValueError(f"router mode must be disagg or colocated, got {cfg.mode!r}")
        if cfg.routing not in ("cache_aware", "round_robin", "least_loaded"):
            raise ValueError(f"routing must be cache_aware, round_robin or least_loaded, got {cfg.routing!r}")
        self.cfg = cfg
        self.workers = workers
        self.store_addr = store
        self.metrics = Metrics(lambda: self.workers)
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self.session: aiohttp.ClientSession | None = None
        self.store = None
        self.keyspace = None
        self.tokenizer = None
        self.info: dict = {}
        self._poller: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s))
        await self._poll_once()
        ref = next((w for w in self.workers if w.alive and w.health), None)
        if ref is None:
            raise RuntimeError("no engine worker answered /health")
        self.info = ref.health
        from engine.tokenizer import ByteTokenizer
        from kvstore.keys import KeySpace, ModelFingerprint

        ks = self.info["keyspace"]
        self.keyspace = KeySpace(ModelFingerprint(**ks["fingerprint"]), namespace=ks["namespace"], algo=ks["algo"])
        self.tokenizer = ByteTokenizer(self.info["vocab_size"])
        if self.store_addr:
            from kvstore.client import KVStoreClient
            from kvstore.config import client_settings

            cc, tls = client_settings(rpc_timeout_s=2, retries=0)  # token, certificates: environment
            self.store = KVStoreClient(self.store_addr, cc, tls=tls)
        self._poller = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._poller:
            self._poller.cancel()
        if self.store is not None:
            await self.store.close()
        if self.session:
            await self.session.close()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self._poll_once()

    async def _poll_once(self) -> None:
        async def one(w: WorkerRef) -> None:
            try:
                async with self.session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:  # type: ignore[union-attr]
                    w.health = await r.json()
                    w.alive = True
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                if w.alive:
                    log.warning("event=worker_down url=%s", w.url)
                    if w.health.get("device_tier") and self.store is not None:
                        # Its cache is gone with it: its holdings leave the index now, not
                        # when its reports' time to live passes.
                        try:
                            await self.store.report_engine_blocks(w.engine_id, w.url, leave=True)
                        except Exception as e:  # noqa: BLE001 - they lapse anyway
                            log.info("event=engine_leave_failed url=%s reason=%r", w.url, str(e))
                w.alive = False

        await asyncio.gather(*(one(w) for w in self.workers))

    # ---- choosing workers -------------------------------------------------------------------

    def _pool(self, role: str) -> list[WorkerRef]:
        want = ("both",) if self.cfg.mode == "colocated" else (role,)
        return [w for w in self.workers if w.alive and w.role in want]

    async def _tiers(self, keys: list[bytes]):  # noqa: ANN202 - kvstore TierLookup or None
        """Where the prompt's blocks are: in the store (DRAM, SSD) and in which worker's cache
        (the device tier), in one lookup; None without a store or when it does not answer."""
        if self.store is None or not keys:
            return None
        try:
            return await self.store.lookup_tiers(keys)
        except Exception:  # noqa: BLE001 - a store without tiers: its leading hit alone
            pass
        try:
            from kvstore.client.engines import TierLookup

            return TierLookup.stored_only(len(keys), await self.store.lookup(keys))
        except Exception:  # noqa: BLE001 - an unreachable store means: nothing known there
            return None

    def uncached_tokens(self, w: WorkerRef, keys: list[bytes], prompt_len: int, tiers=None) -> tuple[int, int]:  # noqa: ANN001
        """(tokens the worker must compute, bytes it must load) for this prompt, given where its
        blocks are (``tiers``: the store's per-tier lookup, or None)."""
        local = w.device_hit(keys, tiers)
        stored = tiers.stored if tiers is not None else 0
        return self._to_compute(prompt_len, max(local, stored)), max(0, stored - local) * self.info["block_bytes"]

    def _to_compute(self, prompt_len: int, held_blocks: int) -> int:
        """Tokens computed when ``held_blocks`` leading blocks are held. The last token is always
        computed, so a fully held prompt still computes its last block."""
        bs = self.info["block_size"]
        return max(prompt_len - held_blocks * bs, bs if prompt_len % bs == 0 else prompt_len % bs)

    def estimate_ttft(self, w: WorkerRef, keys: list[bytes], prompt_len: int, tiers=None) -> float:  # noqa: ANN001
        """Queue ahead (the compute the router already sent it) + own compute + own load."""
        uncached, transfer = self.uncached_tokens(w, keys, prompt_len, tiers)
        return self._ttft(w, uncached, transfer)

    def _ttft(self, w: WorkerRef, uncached: int, transfer: int, extra_s: float = 0.0) -> float:
        # Effective bandwidth (round trips included), as the workers measured it on real loads.
        bw = w.health.get("store_effective_bandwidth") or 2e9
        est = (w.queued_tokens + uncached) / w.tps() + (transfer / bw if transfer else 0.0) + extra_s
        if w.role == "both":
            # A colocated worker interleaves the prefill with decode steps of what it runs.
            est += w.active * (w.health.get("step_s") or 0.0)
        return est

    def plan(self, w: WorkerRef, keys: list[bytes], prompt_len: int, tiers, pool: list[WorkerRef]) -> Choice:  # noqa: ANN001
        """How ``w`` would serve the prompt: from its own cache and the store, or also with a
        longer prefix that another worker holds on its device, exported to the store for ``w``
        to load (a pull), when that is estimated to be faster than computing those tokens."""
        uncached, transfer = self.uncached_tokens(w, keys, prompt_len, tiers)
        best = Choice(w, self._ttft(w, uncached, transfer), uncached)
        if tiers is None or not tiers.per_tier or self.cfg.routing != "cache_aware":
            return best
        local = w.device_hit(keys, tiers)
        have = max(local, tiers.stored)
        # Only holdings a peer reported: the router cannot pull what it merely sent there.
        peers = [(tiers.device(v.engine_id), v) for v in pool if v is not w and v.reports_device_tier]
        held, peer = max(peers, key=lambda p: p[0], default=(0, None))
        if peer is None or held <= have:
            return best
        bb = self.info["block_bytes"]
        pulled = self._to_compute(prompt_len, held)
        # The peer copies the blocks out between two of its steps and puts them; w loads them.
        export_s = (held - have) * bb / (peer.health.get("store_effective_bandwidth") or 2e9) + PULL_OVERHEAD_S
        if peer.active:
            export_s += peer.health.get("step_s") or 0.0
        est = self._ttft(w, pulled, (held - local) * bb, export_s)
        if est < best.est:
            return Choice(w, est, pulled, peer, held)
        return best

    async def plan_prefill(self, keys: list[bytes], prompt_len: int) -> Choice:
        """The prefill worker, its TTFT estimate, the tokens it will compute (its queue cost),
        and the peer to pull a prefix from first, if any."""
        pool = self._pool("prefill")
        if not pool:
            raise RequestError(503, "no prefill worker is available", "service_unavailable")
        if len(pool) == 1:
            # Nothing to choose: the lookup is skipped when even computing the whole prompt
            # meets the target (the estimate and the queue cost are then the worst case).
            w = pool[0]
            worst = self._to_compute(prompt_len, 0)
            est = self._ttft(w, worst, 0)
            if est <= self.cfg.ttft_target_s:
                return Choice(w, est, worst)
        tiers = await self._tiers(keys)
        plans = [self.plan(w, keys, prompt_len, tiers, pool) for w in pool]
        if self.cfg.routing == "round_robin":
            return plans[next(self._rr["prefill"]) % len(pool)]
        if self.cfg.routing == "least_loaded":  # the least queued compute, blind to caches
            return min(plans, key=lambda c: (c.worker.queued_tokens / c.worker.tps(), c.worker.active))
        # Ties (equal estimates) go to the worker with fewer requests in flight.
        best = min(plans, key=lambda c: (c.est, c.worker.active))
        if best.est > self.cfg.ttft_target_s:
            raise RequestError(
                429,
                f"estimated time to first token {best.est:.2f} s exceeds the target of {self.cfg.ttft_target_s:.2f} s; "
                "retry later",
                "rate_limit_exceeded",
            )
        return best

    async def choose_prefill(self, keys: list[bytes], prompt_len: int) -> tuple[WorkerRef, float, int]:
        """The prefill worker, its TTFT estimate, and the tokens it will compute (its queue cost)."""
        c = await self.plan_prefill(keys, prompt_len)
        return c.worker, c.est, c.cost

    async def pull(self, peer: WorkerRef, keys: list[bytes]) -> int:
        """Has ``peer`` put the leading run of ``keys`` its cache holds into the store; returns
        how many blocks the store holds from it (0 on any failure: the worker computes them)."""
        try:
            body = {"keys": [k.hex() for k in keys]}
            async with self.session.post(peer.url + "/export", json=body) as r:  # type: ignore[union-attr]
                if r.status != 200:
                    return 0
                return int((await r.json())["exported"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
            log.warning("event=pull_failed peer=%s reason=%r", peer.url, str(e))
            return 0

    def choose_decode(self) -> WorkerRef:
        pool = self._pool("decode")
        if not pool:
            raise RequestError(503, "no decode worker is available", "service_unavailable")
        if self.cfg.routing == "round_robin":
            return pool[next(self._rr["decode"]) % len(pool)]

        def tpot(w: WorkerRef) -> float:
            step = w.health.get("step_s") or 0.0
            return step * (1 + w.active / max(1, w.health.get("max_num_seqs", 32)))

        ok = [w for w in pool if tpot(w) <= self.cfg.tpot_target_s] or pool
        return min(ok, key=lambda w: (w.active, tpot(w)))

    # ---- requests ---------------------------------------------------------------------------

    def parse(self, body: dict) -> dict:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)  # type: ignore[union-attr]
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "prompt must be a string or a list of token ids (one prompt per request)")
        if not ids:
            raise RequestError(400, "prompt is empty")
        vocab = self.info["vocab_size"]
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(400, f"prompt has token ids outside the vocabulary [0, {vocab})")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
        limit = self.info["max_model_len"]
        if len(ids) + max_tokens > limit:
            raise RequestError(
                400, f"prompt of {len(ids)} tokens plus max_tokens {max_tokens} exceeds the context limit of {limit}"
            )
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
            raise RequestError(400, f"temperature must be a number in [0, 2], got {temperature!r}")
        if body.get("n", 1) != 1:
            raise RequestError(400, "only n=1 is supported")
        if body.get("echo") or body.get("logprobs") or body.get("best_of", 1) != 1:
            raise RequestError(400, "echo, logprobs and best_of are not supported")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise RequestError(400, f"seed must be a non-negative integer, got {seed!r}")
        return {
            "prompt_ids": ids,
            "max_tokens": max_tokens,
            "temperature": float(temperature),
            "seed": seed,
            "ignore_eos": bool(body.get("ignore_eos", False)),
            "stream": bool(body.get("stream", False)),
        }

    async def _ndjson(self, resp: aiohttp.ClientResponse):  # noqa: ANN202
        async for line in resp.content:
            if line.strip():
                yield json.loads(line)

    async def run(self, req: dict):  # noqa: ANN201 - async generator of events
        """Runs one request through the workers. Yields ("token", ids), then ("done", info)."""
        t0 = time.perf_counter()
        ids = req["prompt_ids"]
        keys = self.keyspace.block_keys(ids)  # type: ignore[union-attr]
        choice = await self.plan_prefill(keys, len(ids))
        pw, est, cost = choice.worker, choice.est, choice.cost
        params = {k: req[k] for k in ("max_tokens", "temperature", "seed", "ignore_eos")}
        pw.queued_tokens += cost
        pw.active += 1
        info: dict = {"prefill_worker": pw.url, "estimated_ttft_ms": round(est * 1000, 2)}
        out: list[int] = []
        t_tokens: list[float] = []
        finish = None
        try:
            if choice.pull_from is not None:  # the prefix out of a peer's cache, into the store
                info["pulled_from"] = choice.pull_from.url
                info["pulled_blocks"] = await self.pull(choice.pull_from, keys[: choice.pull_blocks])
            path = "/generate" if self.cfg.mode == "colocated" else "/prefill"
            async with self.session.post(pw.url + path, json={"prompt_ids": ids, **params}) as r:  # type: ignore[union-attr]
                if r.status == 400:
                    raise RequestError(400, (await r.json())["error"])
                r.raise_for_status()
                async for msg in self._ndjson(r):
                    if msg["type"] == "token":
                        if not out:
                            pw.queued_tokens -= cost
                        out += msg["ids"]
                        t_tokens += [time.perf_counter()] * len(msg["ids"])
                        yield "token", msg["ids"]
                    elif msg["type"] == "done":
                        finish = msg["finish_reason"]
                        info.update(tokens_loaded=msg["loaded_tokens"], tokens_cached=msg["cached_tokens"],
                                    tokens_computed=msg["computed_tokens"],
                                    worker_ttft_ms=round(msg["ttft_s"] * 1000, 3),
                                    load_ms=round(msg.get("load_s", 0.0) * 1000, 3))  # fmt: skip
                    elif msg["type"] == "error":
                        raise RequestError(502, f"prefill worker {pw.url} failed: {msg['message']}", "server_error")
            pw.remember(keys, self.cfg.recent_keys_per_worker)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise RequestError(502, f"worker {pw.url} failed during prefill: {e}", "server_error") from None
        finally:
            if not out:
                pw.queued_tokens -= cost
            pw.active -= 1
        if not out:
            raise RequestError(502, f"worker {pw.url} returned no token", "server_error")
        if self.cfg.mode == "disagg" and finish in ("max_tokens", "length") and req["max_tokens"] > 1:
            dw = self.choose_decode()
            info["decode_worker"] = dw.url
            dw.active += 1
            body = {"prompt_ids": ids + out[:1], **params, "max_tokens": req["max_tokens"] - 1}
            try:
                async with self.session.post(dw.url + "/generate", json=body) as r:  # type: ignore[union-attr]
                    if r.status == 400:
                        raise RequestError(400, (await r.json())["error"])
                    r.raise_for_status()
                    finish = None
                    async for msg in self._ndjson(r):
                        if msg["type"] == "token":
                            out += msg["ids"]
                            t_tokens += [time.perf_counter()] * len(msg["ids"])
                            yield "token", msg["ids"]
                        elif msg["type"] == "done":
                            finish = msg["finish_reason"]
                            info["decode_tokens_loaded"] = msg["loaded_tokens"]
                        elif msg["type"] == "error":
                            raise RequestError(502, f"decode worker {dw.url} failed: {msg['message']}", "server_error")
                    if finish is None:
                        raise RequestError(502, f"decode worker {dw.url} ended the stream early", "server_error")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                dw.alive = False  # until its next health check says otherwise
                raise RequestError(502, f"decode worker {dw.url} failed mid-request: {e}", "server_error") from None
            finally:
                dw.active -= 1
        info["ttft_ms"] = round((t_tokens[0] - t0) * 1000, 3)
        info["tpot_ms"] = (
            round((t_tokens[-1] - t_tokens[0]) / (len(t_tokens) - 1) * 1000, 3) if len(t_tokens) > 1 else None
        )
        info["finish_reason"] = "stop" if finish in ("eos", "stop") else "length"
        info["completion_tokens"] = len(out)
        info["output_ids"] = out
        self.metrics.observe(info)
        self.metrics.tokens("prompt", len(ids))
        self.metrics.tokens("generated", len(out))
        yield "done", info


def make_app(router: Router) -> web.Application:
    def error(e: RequestError) -> web.Response:
        router.metrics.request(str(e.status))
        return web.json_response({"error": {"message": e.message, "type": e.kind, "code": e.status}}, status=e.status)

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(RequestError(400, "the request body is not valid JSON"))
        try:
            req = router.parse(body)
        except RequestError as e:
            return error(e)
        cid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = router.cfg.model_name
        tok = router.tokenizer
        if not req["stream"]:
            try:
                info = None
                async for kind, val in router.run(req):
                    if kind == "done":
                        info = val
            except RequestError as e:
                return error(e)
            ids = info["output_ids"]
            router.metrics.request("200")
            return web.json_response(
                {
                    "id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": tok.decode(ids), "logprobs": None, "finish_reason": info["finish_reason"]}],
                    "usage": {"prompt_tokens": len(req["prompt_ids"]), "completion_tokens": len(ids),
                              "total_tokens": len(req["prompt_ids"]) + len(ids)},
                    "kvstore": info,
                }
            )  # fmt: skip
        resp = None
        ids: list[int] = []
        sent_text = ""

        def chunk(text: str, finish: str | None, extra: dict | None = None) -> bytes:
            body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}  # fmt: skip
            if extra:
                body.update(extra)
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        try:
            async for kind, val in router.run(req):
                if resp is None:
                    resp = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await resp.prepare(request)
                if kind == "token":
                    ids += val
                    text = tok.decode(ids)
                    if text.endswith("\ufffd"):
                        continue  # an incomplete UTF-8 sequence: wait for its next byte
                    delta, sent_text = text[len(sent_text) :], text
                    await resp.write(chunk(delta, None))
                else:
                    usage = {"prompt_tokens": len(req["prompt_ids"]), "completion_tokens": len(ids),
                             "total_tokens": len(req["prompt_ids"]) + len(ids)}  # fmt: skip
                    await resp.write(
                        chunk(tok.decode(ids)[len(sent_text) :], val["finish_reason"], {"usage": usage, "kvstore": val})
                    )
            router.metrics.request("200")
        except RequestError as e:
            if resp is None:
                return error(e)
            router.metrics.request(str(e.status))
            err = {"error": {"message": e.message, "type": e.kind, "code": e.status}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            return resp
        await resp.write(b"data: [DONE]\n\n")  # type: ignore[union-attr]
        await resp.write_eof()  # type: ignore[union-attr]
        return resp  # type: ignore[return-value]

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": router.cfg.model_name, "object": "model", "created": 0, "owned_by": "kvstore"}],
            }
        )

    async def health(request: web.Request) -> web.Response:
        ws = [{"url": w.url, "role": w.role, "alive": w.alive, "active": w.active} for w in router.workers]
        ok = bool(router._pool("prefill")) and (router.cfg.mode == "colocated" or bool(router._pool("decode")))
        return web.json_response({"ok": ok, "mode": router.cfg.mode, "workers": ws}, status=200 if ok else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=router.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
