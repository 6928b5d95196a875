"""Starting an engine deployment: an optional embedded store, N prefill + M decode workers (or
N colocated ones) as separate processes, and the router in this process.

    kvstore engine --prefill 1 --decode 1 --store embedded --model small --port 8000
    kvstore engine --colocated 2 --store 127.0.0.1:7100

``--store embedded`` starts ``kvstore serve`` in a temporary folder; ``--store ADDR`` uses a
running metadata service; ``--store none`` runs without a store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from engine.router import Router, RouterConfig, WorkerRef, make_app
from kvstore.procs import Child, start

log = logging.getLogger("engine.serve")


@dataclass
class DeploymentSpec:
    model: str = "tiny"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    store: str = "embedded"  # "embedded", "none" or a metadata service address
    dram: str = "512MiB"
    store_args: list[str] = field(default_factory=list)  # extra `kvstore serve` flags (e.g. an SSD segment)
    num_blocks: int = 1024
    prefix_cache: bool = True
    load_policy: str = "auto"
    router: RouterConfig = field(default_factory=RouterConfig)
    host: str = "127.0.0.1"
    port: int = 0


class Deployment:
    """Owns the child processes; ``async with Deployment(spec) as d: d.url``."""

    def __init__(self, spec: DeploymentSpec, log_dir: str | Path | None = None) -> None:
        self.spec = spec
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-engine-")
        self.dir = Path(log_dir or self._tmp.name)
        self.children: list[Child] = []
        self.store_addr = ""
        self.router: Router | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _log(self, name: str):  # noqa: ANN202
        return open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child

    async def start(self) -> str:
        s = self.spec
        if s.store == "embedded":
            store = await asyncio.to_thread(
                start, ["serve", "--listen", "127.0.0.1:0", "--dram", s.dram, "--data-dir", str(self.dir / "store"),
                        "--log-level", "warning", *s.store_args], "store", stderr=self._log("store"),
            )  # fmt: skip
            self.children.append(store)
            self.store_addr = store.info["meta"]
        elif s.store not in ("", "none"):
            self.store_addr = s.store
        roles = [("both", s.colocated)] if s.colocated else [("prefill", s.prefill), ("decode", s.decode)]
        mode = "colocated" if s.colocated else "disagg"
        args = []
        for role, n in roles:
            for i in range(n):
                a = [
                    "--role",
                    role,
                    "--model",
                    s.model,
                    "--num-blocks",
                    str(s.num_blocks),
                    "--load-policy",
                    s.load_policy,
                ]
                if self.store_addr:
                    a += ["--store", self.store_addr]
                if not s.prefix_cache:
                    a.append("--no-prefix-cache")
                args.append((f"{role}-{i}", a))
        workers = await asyncio.gather(
            *(asyncio.to_thread(start, a, name, "engine.worker", 300.0, self._log(name)) for name, a in args)
        )
        self.children += workers
        refs = [WorkerRef(w.info["url"], w.info["role"]) for w in workers]
        self.spec.router.mode = mode
        self.router = Router(self.spec.router, refs, self.store_addr)
        await self.router.start()
        self.runner = web.AppRunner(make_app(self.router), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.host, s.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{s.host}:{port}"
        return self.url

    def worker(self, role: str, i: int = 0) -> Child:
        return [c for c in self.children if c.info.get("role") == role][i]

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
        if self.router:
            await self.router.close()
        for c in reversed(self.children):
            await asyncio.to_thread(c.stop)
        self._tmp.cleanup()

    async def __aenter__(self) -> Deployment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model", default="small", help="tiny, small (random weights, seed 0) or a Hugging Face-format folder"
    )
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="decode workers")
    ap.add_argument("--colocated", type=int, default=0, help="workers that do both phases (instead of prefill/decode)")
    ap.add_argument("--store", default="embedded", help="embedded, none, or a metadata service address")
    ap.add_argument("--dram", default="512MiB", help="DRAM of the embedded store")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks per worker")
    ap.add_argument("--no-prefix-cache", action="store_true", help="turn the workers' local prefix caches off")
    ap.add_argument("--routing", default="cache_aware", choices=("cache_aware", "round_robin", "least_loaded"))
    ap.add_argument("--ttft-target-ms", type=float, default=5000.0)
    ap.add_argument("--tpot-target-ms", type=float, default=500.0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)


def spec_from_args(ns: argparse.Namespace) -> DeploymentSpec:
    return DeploymentSpec(
        model=ns.model, prefill=ns.prefill, decode=ns.decode, colocated=ns.colocated, store=ns.store, dram=ns.dram,
        num_blocks=ns.num_blocks, prefix_cache=not ns.no_prefix_cache, host=ns.host, port=ns.port,
        router=RouterConfig(routing=ns.routing, ttft_target_s=ns.ttft_target_ms / 1000, tpot_target_s=ns.tpot_target_ms / 1000),
    )  # fmt: skip


def main(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)

    async def run() -> None:
        d = Deployment(spec_from_args(ns))
        try:
            url = await d.start()
            print(
                "READY "
                + json.dumps(
                    {"url": url, "store": d.store_addr, "workers": [c.info for c in d.children if "role" in c.info]}
                ),
                flush=True,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await d.stop()

    asyncio.run(run())
    return 0
