"""An engine worker process: one model, one paged KV cache, one role, an HTTP API for the router.

    python -m engine.worker --role prefill|decode|both --model tiny|small|FOLDER [--store META_ADDR]

Roles:
- ``prefill``: ``POST /prefill`` loads the cached prefix from the store, computes the rest and
  the first token, writes the new full blocks to the store. It streams two NDJSON lines: the
  first token as soon as it exists, then ``saved`` once the blocks are in the store (the router
  hands the request to a decode worker only then).
- ``decode``: ``POST /generate`` with the prompt plus the first token: the load hook pulls the
  prompt's blocks from the store into this worker's cache, the tail that is not a full block is
  recomputed, and tokens are generated with continuous batching, streamed one NDJSON line each.
- ``both``: colocated, ``/generate`` does everything in one engine (for comparison).

``POST /export`` (prefill and colocated workers) puts the leading blocks of the given keys that
this worker's cache holds into the store, for another worker to load: how a router pulls a
prefix out of one worker's device tier into another's.

``GET /health`` reports the role, queue, active sequences and the measured prefill throughput
and store bandwidth (the router's estimates use them). The engine runs on its own thread; the
HTTP side only queues commands and relays outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

from engine.hooks import SavedBlocks

log = logging.getLogger("engine.worker")


MAX_EXPORT_KEYS = 4096
_EXPORT_IDS = itertools.count(1)


def build_model(spec: str, dtype: str = "float32"):  # noqa: ANN201
    """``tiny`` / ``small`` (random weights from seed 0, std 0.1 for varied greedy output: every
    worker gets the same model) or a Hugging Face-format folder."""
    from engine.config import ModelConfig
    from engine.model import LlamaForCausalLM

    if spec in ("tiny", "small"):
        cfg = getattr(ModelConfig, spec)(dtype=dtype)
        return LlamaForCausalLM.random(cfg, seed=0, std=0.1)
    return LlamaForCausalLM.load_pretrained(spec, dtype=dtype)


@dataclass
class Job:
    request_id: int
    prompt_len: int
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent: int = 0
    t0: float = field(default_factory=time.perf_counter)
    t_first: float | None = None


class Worker:
    def __init__(self, role: str, engine, connector=None) -> None:  # noqa: ANN001
        self.role = role
        self.engine = engine
        self.connector = connector
        self.cmds: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}
        self.cached: dict[int, int] = {}  # request id -> tokens from the local prefix cache
        self.compute_tps: float | None = None
        self.active = 0
        self.queued_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.reporter = None  # engine.device_tier.CacheReporter, when the store indexes this cache
        inner = connector.load if connector is not None else None

        def load_hook(req):  # noqa: ANN001, ANN202
            self.cached[req.request_id] = req.num_cached_tokens
            return inner(req) if inner is not None else req.num_cached_tokens

        engine.load_hook = load_hook
        if connector is not None:
            engine.save_hook = connector.save
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        torch_threads()
        eng = self.engine
        while True:
            block = not eng.has_unfinished()
            try:
                while True:
                    cmd = self.cmds.get(block=block)
                    block = False
                    cmd()
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                continue
            before = eng.stats.prefill_tokens
            t = time.perf_counter()
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep the worker
                log.exception("event=step_failed")
                for rid, job in list(self.jobs.items()):
                    eng.abort(rid)
                    self._emit(job, {"type": "error", "message": f"engine step failed: {e}"})
                    self._finish(rid)
                continue
            dt = time.perf_counter() - t
            self.steps += 1
            self.step_seconds += dt
            computed = eng.stats.prefill_tokens - before
            if computed > 0:
                tps = computed / dt
                self.compute_tps = tps if self.compute_tps is None else 0.7 * self.compute_tps + 0.3 * tps
                if self.connector is not None:
                    self.connector.observe_compute(computed, dt)
            for o in outs:
                self._progress(o)

    def _progress(self, o) -> None:  # noqa: ANN001
        job = self.jobs.get(o.request_id)
        if job is None:
            return
        now = time.perf_counter()
        if job.t_first is None and o.output_ids:
            job.t_first = now
        new = o.output_ids[job.sent :]
        job.sent = len(o.output_ids)
        if new:
            self._emit(job, {"type": "token", "ids": new})
        if o.finished:
            cached = self.cached.pop(o.request_id, 0)
            loaded, load_s = self.connector.take_load(o.request_id) if self.connector is not None else (0, 0.0)
            n_out = len(o.output_ids)
            first = (job.t_first or now) - job.t0
            self._emit(
                job,
                {
                    "type": "done",
                    "finish_reason": o.finish_reason,
                    "output_tokens": n_out,
                    "prompt_tokens": job.prompt_len,
                    "cached_tokens": cached,
                    "loaded_tokens": loaded,
                    "computed_tokens": job.prompt_len - cached - loaded,
                    "ttft_s": first,
                    "load_s": load_s,
                    "tpot_s": (now - (job.t_first or now)) / max(1, n_out - 1),
                },
            )
            self._finish(o.request_id)

    def _finish(self, rid: int) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            self.active -= 1
            self.queued_tokens -= job.prompt_len

    def _emit(self, job: Job, msg: dict) -> None:
        job.loop.call_soon_threadsafe(job.out.put_nowait, msg)

    # ---- HTTP side --------------------------------------------------------------------------

    async def submit(self, body: dict) -> tuple[int, Job]:
        """Queues a request on the engine thread; returns its id and job (raises InvalidRequest)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        out: asyncio.Queue = asyncio.Queue()
        prompt = body.get("prompt_ids")
        params = dict(
            max_tokens=int(body.get("max_tokens", 16)),
            temperature=float(body.get("temperature", 0.0)),
            seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos", False)),
            stop_token_ids=tuple(body.get("stop_token_ids", ())),
        )

        def add() -> None:
            try:
                rid = self.engine.add_request(prompt, **params)
            except Exception as e:  # noqa: BLE001 - handed back to the HTTP side
                loop.call_soon_threadsafe(fut.set_exception, e)
                return
            job = Job(rid, len(prompt), out, loop)
            self.jobs[rid] = job
            self.active += 1
            self.queued_tokens += len(prompt)
            loop.call_soon_threadsafe(fut.set_result, (rid, job))

        self.cmds.put(add)
        return await fut

    async def export(self, keys: list[bytes]) -> int:
        """Puts the leading run of ``keys`` that this worker's cache holds into the store, so that
        another worker can load it (a pull from this worker's device tier through the store).
        The blocks are copied out on the engine thread, between steps, and put as a save would
        be. Returns how many of them the store holds afterwards."""
        if self.connector is None:
            return 0
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        rid = -next(_EXPORT_IDS)  # a request id no engine request has

        def go() -> None:
            try:
                ids = self.engine.block_manager.cached_run(keys)
                if ids:
                    self.connector.save(SavedBlocks(rid, keys[: len(ids)], ids, 0, "export"))
                loop.call_soon_threadsafe(fut.set_result, len(ids))
            except Exception as e:  # noqa: BLE001 - handed back to the HTTP side
                loop.call_soon_threadsafe(fut.set_exception, e)

        self.cmds.put(go)
        if not await fut:
            return 0
        return await asyncio.to_thread(self.connector.wait_saved, rid)

    def abort(self, rid: int) -> None:
        def go() -> None:
            if self.engine.abort(rid):
                self._finish(rid)

        self.cmds.put(go)

    def health(self) -> dict:
        c = self.connector
        ks = self.engine.keyspace
        return {
            "ok": True,
            "role": self.role,
            "active": self.active,
            "queued_tokens": self.queued_tokens,
            "prefill_tps": self.compute_tps,
            "store_bandwidth": None if c is None else c.bandwidth.value,
            "store_latency": None if c is None else c.latency.value,
            "store_effective_bandwidth": None if c is None else c.effective_bandwidth.value,
            "store_tokens_loaded": None if c is None else c.stats.tokens_loaded,
            "device_tier": None
            if self.reporter is None
            else {
                "engine_id": self.reporter.engine_id,
                "synced": self.reporter.synced,
                "blocks": len(self.reporter.held),
                "reports": self.reporter.reports,
                "failures": self.reporter.failures,
            },
            "block_bytes": self.engine.kv_cache.block_nbytes,
            "block_size": self.engine.config.block_size,
            "step_s": self.step_seconds / self.steps if self.steps else None,
            "pid": os.getpid(),
            "model_id": self.engine.model_id,
            "max_model_len": self.engine.model_config.max_position_embeddings,
            "vocab_size": self.engine.model_config.vocab_size,
            "eos_token_id": self.engine.tokenizer.eos_token_id,
            "max_num_seqs": self.engine.config.max_num_seqs,
            "keyspace": {
                "fingerprint": {f: getattr(ks.fingerprint, f) for f in ks.fingerprint.__slots__},
                "namespace": ks.namespace,
                "algo": ks.algo,
            },
        }


def torch_threads() -> None:
    """One torch thread per worker: on a small shared machine, more threads only contend."""
    import torch

    torch.set_num_threads(int(os.environ.get("KVSTORE_TORCH_THREADS", "1")))


def make_app(worker: Worker) -> web.Application:
    from engine.errors import InvalidRequest

    async def stream(request: web.Request, body: dict, prefill: bool) -> web.StreamResponse:
        if prefill:
            body = {**body, "max_tokens": 1}
        try:
            rid, job = await worker.submit(body)
        except (InvalidRequest, ValueError, TypeError) as e:
            return web.json_response({"error": str(e)}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            while True:
                msg = await job.out.get()
                await resp.write((json.dumps(msg) + "\n").encode())
                if msg["type"] in ("done", "error"):
                    break
            if prefill and msg["type"] == "done":
                saved = 0
                if worker.connector is not None:
                    saved = await asyncio.to_thread(worker.connector.wait_saved, rid)
                await resp.write((json.dumps({"type": "saved", "blocks": saved}) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            worker.abort(rid)
            raise
        await resp.write_eof()
        return resp

    async def export(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            keys = [bytes.fromhex(k) for k in body["keys"]]
            if not 0 < len(keys) <= MAX_EXPORT_KEYS or any(len(k) != 16 for k in keys):
                raise ValueError(f"keys: 1 to {MAX_EXPORT_KEYS} block keys of 16 bytes (hex)")
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad export request: {e}"}, status=400)
        return web.json_response({"exported": await worker.export(keys)})

    async def generate(request: web.Request) -> web.StreamResponse:
        return await stream(request, await request.json(), prefill=False)

    async def prefill(request: web.Request) -> web.StreamResponse:
        return await stream(request, await request.json(), prefill=True)

    async def health(request: web.Request) -> web.Response:
        return web.json_response(worker.health())

    app = web.Application()
    app.router.add_get("/health", health)
    if worker.role in ("decode", "both"):
        app.router.add_post("/generate", generate)
    if worker.role in ("prefill", "both"):
        app.router.add_post("/prefill", prefill)
        app.router.add_post("/export", export)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("prefill", "decode", "both"), required=True)
    ap.add_argument("--model", default="tiny", help="tiny, small, or a Hugging Face-format folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--store", default="", help="metadata service address; empty = no store")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--no-prefix-cache", action="store_true", help="turn the engine's local prefix cache off")
    ap.add_argument("--load-policy", default="auto", choices=("auto", "always", "never"))
    ap.add_argument(
        "--no-device-tier", action="store_true", help="do not report this cache's blocks to the store's index"
    )
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    torch_threads()
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    model = build_model(ns.model, ns.dtype)
    cfg = EngineConfig(
        num_blocks=ns.num_blocks, max_num_seqs=ns.max_num_seqs, enable_prefix_caching=not ns.no_prefix_cache
    )
    engine = LLMEngine(model, cfg)
    connector = client = None
    if ns.store:
        from engine.connector import StoreConnector
        from kvstore.client import SyncKVStoreClient
        from kvstore.config import client_settings

        # Token and certificates from the environment (KVSTORE_CLIENT__TOKEN, KVSTORE_TLS__*).
        cc, tls = client_settings(rpc_timeout_s=5, io_timeout_s=5, retries=0)
        client = SyncKVStoreClient(ns.store, cc, tls=tls)
        connector = StoreConnector(client, engine.kv_cache, policy=ns.load_policy)
    worker = Worker(ns.role, engine, connector)

    async def serve() -> None:
        # A short drain on SIGTERM: the router has stopped sending by then.
        runner = web.AppRunner(make_app(worker), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, ns.host, ns.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://{ns.host}:{port}"
        if client is not None and not ns.no_device_tier and not ns.no_prefix_cache and ns.role != "decode":
            from engine.device_tier import CacheReporter

            # Before the first request: every block the cache takes from here on is reported.
            worker.reporter = CacheReporter(client, engine_id=url, url=url)
            engine.block_manager.events = worker.reporter.events
            worker.reporter.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print("READY " + json.dumps({"url": url, "role": ns.role, "pid": os.getpid()}), flush=True)
        await stop.wait()
        if worker.reporter is not None:
            await asyncio.to_thread(worker.reporter.close)  # its holdings leave the index now
        await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
