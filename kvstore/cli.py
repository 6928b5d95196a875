"""The ``kvstore`` command.

    kvstore serve  [--data-dir D] [--listen ADDR] [--dram SIZE]   metadata service + one daemon
    kvstore meta   [--listen ADDR]                                metadata service alone
    kvstore daemon --meta ADDR [--dram SIZE] [--data-dir D]       one cache daemon
    kvstore stat   [--meta ADDR] [--json]                         nodes, tiers, bytes, counters
    kvstore shm    list|clean [--shm-dir D] [--dry-run] [--json]  daemons' shared memory: held or stale
    kvstore demo                                                  embedded store + prefix-reuse workload
    kvstore bench  SUITE                                          the benchmark suite (from a checkout)

Every command takes ``--config FILE`` and repeated ``--set section.key=value``; environment
variables ``KVSTORE_<SECTION>__<KEY>`` apply in between. Servers print one line
``READY {json}`` on stdout once they accept requests (tests and scripts wait for it).
SIGTERM or SIGINT stops a server: a daemon on its own drains first (see
:meth:`kvstore.daemon.server.CacheDaemon.drain`).

Other packages add commands through the ``kvstore.commands`` entry point group (the engine adds
``kvstore engine`` and its ``kvstore demo``); this package imports none of them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvstore.config import Config, load_config
from kvstore.daemon import shm
from kvstore.errors import KVStoreError
from kvstore.tables import fmt_bytes as _fmt_bytes
from kvstore.tables import print_table as _table


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with sections meta, daemon, client, log, tls")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one setting")
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument("--log-format", choices=("text", "json"), help="text (key=value) or one JSON object per line")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvstore", description="KV-cache storage tier for LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="metadata service and one cache daemon in one process (the embedded default)")
    _common(p)
    p.add_argument("--listen", help="metadata service address (default 127.0.0.1:7100)")
    p.add_argument("--data-dir", help="folder for daemon state (default ./kvstore-data)")
    p.add_argument("--dram", help="DRAM segment size, e.g. 1GiB")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics of the service and its daemon (0 = any port)")

    p = sub.add_parser(
        "meta", help="the metadata service alone; with cluster.redis, one shard's primary or standby (kvstore.cluster)"
    )
    _common(p)
    p.add_argument("--listen", help="address to listen on (default 127.0.0.1:7100)")
    p.add_argument("--redis", help="cluster coordination: redis://host:port or sentinel://host:port,.../master")
    p.add_argument("--shards", type=int, help="shards of the cluster (cluster.shards)")
    p.add_argument("--shard", type=int, help="the shard this process serves (cluster.shard)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = any port)")

    p = sub.add_parser("daemon", help="one cache daemon, registering with a metadata service")
    _common(p)
    p.add_argument("--meta", help="metadata service address")
    p.add_argument("--redis", help="a cluster's coordination (cluster.redis): register with every shard")
    p.add_argument("--data-dir", help="folder for daemon state")
    p.add_argument("--dram", help="DRAM segment size, e.g. 1GiB")
    p.add_argument("--host", help="address to bind and advertise")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = any port)")
    p.add_argument(
        "--retire",
        action="store_true",
        help="on SIGTERM, drain and also remove the DRAM segment (a daemon leaving for good)",
    )

    p = sub.add_parser("stat", help="a table of nodes, tiers, bytes, blocks and hit counters")
    _common(p)
    p.add_argument("--meta", help="metadata service address")
    p.add_argument("--redis", help="a cluster's coordination (cluster.redis): shards, leaders, epochs too")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("shm", help="the daemons' shared memory (daemon.shm_dir): list it, remove what no daemon holds")
    shm.add_arguments(p, _common)

    for name, plugin in _plugins().items():
        if hasattr(plugin, "add_arguments"):
            p = sub.add_parser(name, help=plugin.help)
            _common(p)
            plugin.add_arguments(p)

    p = sub.add_parser("certs", help="make a CA and mutual-TLS certificates for a test cluster (see tls.* settings)")
    p.add_argument("--out", required=True, help="folder for ca.pem, ca.key, NAME.pem, NAME.key")
    p.add_argument("--name", action="append", help="an identity to certify (repeatable; default meta, daemon, client)")
    p.add_argument("--server-name", default="kvstore", help="the name clients check (tls.server_name)")
    p.add_argument("--days", type=int, default=365)
    p.set_defaults(set=[], config=None, log_level=None, log_format=None)

    p = sub.add_parser("bench", help="the benchmark suite: JSON in bench/results, bench/RESULTS.md, PNG plots")
    p.add_argument("suite", choices=sorted(BENCH_SUITES), help="policy, store, engine, gpu, soak, cluster or all")
    p.add_argument("--quick", action="store_true", help="a small size (each benchmark about a minute on 2 cores)")
    p.add_argument("--log-level", help=argparse.SUPPRESS)
    p.set_defaults(set=[], config=None)

    p = sub.add_parser("demo", help="run the embedded store and a short multi-turn workload that shows prefix reuse")
    _common(p)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-only", action="store_true", help="the store with a NumPy stand-in model (no torch)")
    return ap


@functools.cache
def _plugins() -> dict[str, Any]:
    """Commands installed packages add (entry point group ``kvstore.commands``); one that fails
    to load (its extra is not installed) is left out."""
    from importlib.metadata import entry_points

    out = {}
    for ep in entry_points(group="kvstore.commands"):
        try:
            out[ep.name] = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the store's CLI
            logging.getLogger("kvstore.cli").debug("event=plugin_unavailable name=%s reason=%r", ep.name, str(e))
    return out


BENCH_SUITES = {
    "policy": ["policy.py", "policy_variants.py", "index_scale.py"],
    "store": ["store_throughput.py", "peers.py", "meta_capacity.py", "tier_throughput.py"],
    "engine": ["engine_reuse.py", "engine_integrations.py"],
    "gpu": ["gpu_copy.py"],
    "soak": ["soak.py"],
    "cluster": ["cluster.py"],
    "all": [
        "policy.py",
        "policy_variants.py",
        "index_scale.py",
        "store_throughput.py",
        "peers.py",
        "meta_capacity.py",
        "tier_throughput.py",
        "engine_reuse.py",
        "engine_integrations.py",
        "soak.py",
        "cluster.py",
    ],  # fmt: skip
}


def _bench(suite: str, quick: bool) -> int:
    """Runs each benchmark of the suite as its own process (each writes its JSON, plots and
    section of bench/RESULTS.md); the suite fails if any of them does."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench").is_dir():
        print(
            "kvstore bench: the benchmark suite runs from a checkout of the repository (its bench/ folder is not "
            f"next to this installation at {root}); clone it, run scripts/setup.sh, then `kvstore bench`",
            file=sys.stderr,
        )
        return 2
    failed = []
    for script in BENCH_SUITES[suite]:
        cmd = [sys.executable, str(root / "bench" / script)] + (["--quick"] if quick else [])
        print(f"== {' '.join(['python', 'bench/' + script] + cmd[2:])}", flush=True)
        if subprocess.run(cmd, cwd=root).returncode != 0:
            failed.append(script)
    print(f"results: {root / 'bench' / 'results'}; report: {root / 'bench' / 'RESULTS.md'}")
    if failed:
        print(f"kvstore bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _config(ns: argparse.Namespace) -> Config:
    overrides = list(ns.set)
    for attr, key in (
        ("listen", "meta.listen"),
        ("data_dir", "daemon.data_dir"),
        ("dram", "daemon.dram_bytes"),
        ("host", "daemon.host"),
        ("shm_dir", "daemon.shm_dir"),
        ("metrics_port", "meta.metrics_port" if ns.cmd in ("serve", "meta") else "daemon.metrics_port"),
        ("redis", "cluster.redis"),
        ("shards", "cluster.shards"),
        ("shard", "cluster.shard"),
    ):
        v = getattr(ns, attr, None)
        if v is not None:
            overrides.append(f"{key}={v}")
    if getattr(ns, "meta", None):
        overrides += [f"daemon.meta={ns.meta}", f"client.meta={ns.meta}"]
    if getattr(ns, "retire", False):
        overrides.append("daemon.remove_segment_on_drain=true")
    if ns.cmd == "serve" and getattr(ns, "listen", None):
        overrides.append(f"client.meta={ns.listen}")
    cfg = load_config(ns.config, overrides)
    if cfg.cluster.redis and not getattr(ns, "meta", None):
        # Clients of a cluster find its shards through Redis (kvstore.client.shards).
        cfg.client.meta = f"{cfg.cluster.redis}#{cfg.cluster.name}"
    if ns.log_level:
        cfg.log.level = ns.log_level
    if getattr(ns, "log_format", None):
        cfg.log.format = ns.log_format
    return cfg


def _ready(**info: object) -> None:
    print("READY " + json.dumps(info), flush=True)


async def _until_signal() -> str:
    stop = asyncio.Event()
    got: list[str] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: (got.append(s.name), stop.set()))
    await stop.wait()
    return got[0]


async def _serve(cfg: Config, with_meta: bool, with_daemon: bool) -> None:
    from kvstore.daemon.server import CacheDaemon
    from kvstore.meta.service import MetaServer

    meta = daemon = None
    info: dict[str, object] = {}
    try:
        if with_meta:
            meta = MetaServer(cfg.meta, tls=cfg.tls)
            port = await meta.start()
            host = cfg.meta.listen.rpartition(":")[0] or "127.0.0.1"
            info["meta"] = f"{host}:{port}"
            if meta.metrics.port:
                info["metrics_port"] = meta.metrics.port
            if with_daemon:
                cfg.daemon.meta = str(info["meta"])
        if with_daemon:
            if meta is not None:  # one process: one /metrics for both, the service's
                cfg.daemon.metrics_port = -1
            daemon = CacheDaemon(
                cfg.daemon,
                registry=meta.registry if meta is not None else None,
                tls=cfg.tls,
                cluster=cfg.cluster if meta is None else None,
            )
            if meta is not None:  # one process: the service calls the daemon directly
                meta.link.attach_local(daemon.daemon_id, daemon)
                if not cfg.daemon.token:  # and trusts it through a token only this process knows
                    cfg.daemon.token = meta.local_daemon_token(daemon.daemon_id)
            await daemon.start()
            await daemon.until_registered(timeout=60)
            info.update(
                daemon_id=daemon.daemon_id,
                data_port=daemon.dataport.port,
                control_port=daemon.control_port,
                shm_path=daemon.dram.path,
            )
            if daemon.metrics.port:
                info["metrics_port"] = daemon.metrics.port
        _ready(**info)
        sig = await _until_signal()
        logging.getLogger("kvstore.cli").info("event=signal name=%s", sig)
        if daemon is not None and meta is None:
            await daemon.drain()  # leaves the index now, serves reads already handed out
    finally:
        # The service first: its background rounds may still be calling the daemon.
        if meta:
            await meta.stop()
        if daemon:
            await daemon.stop()


async def _shard(cfg: Config) -> None:
    """One metadata process of a cluster: standby, leader when it holds its shard's lease."""
    from kvstore.cluster.shard import ShardNode

    node = ShardNode(cfg)
    run = asyncio.create_task(node.run())
    _ready(shard=cfg.cluster.shard, shards=cfg.cluster.shards, node=node.node, addr=node.addr)
    stop = asyncio.create_task(_until_signal())
    done, _ = await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
    if stop in done:
        logging.getLogger("kvstore.cli").info("event=signal name=%s", stop.result())
    node.stop()
    await run


def _print_cluster(cl: dict) -> None:
    """Shards (slots, leader, epoch, keys), then every member process."""
    rows = [("shard", "slots", "leader", "address", "epoch", "keys", "daemons")]
    for sh in cl["shards"]:
        rows.append(
            (str(sh["shard"]), str(sh["slots"]), sh.get("leader") or "NONE", sh.get("addr", "-"), str(sh.get("epoch", 0)),
             str(sh.get("keys", "?")), str(sh.get("daemons", "?")))
        )  # fmt: skip
    _table(rows)
    print()
    rows = [("member", "role", "shard", "address", "host")]
    for m in cl["members"]:
        rows.append((m["node"], m.get("role", "?"), str(m.get("shard", "-")), m.get("addr", "-"), m.get("host", "-")))
    _table(rows)
    print()


def _stat(cfg: Config, as_json: bool) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvstore.client import SyncKVStoreClient

    cluster = None
    with SyncKVStoreClient(config=cfg.client, tls=cfg.tls) as c:
        s = c.stats()
        if cfg.cluster.redis:
            cluster = c.cluster_state()
    if as_json:
        out = MessageToDict(s, preserving_proto_field_name=True)
        out.setdefault("touch_interval_ms", 0)
        if cluster is not None:
            out["cluster"] = cluster
        print(json.dumps(out, indent=2))
        return 0
    if cluster is not None:
        _print_cluster(cluster)
    tiers = {1: "dram", 2: "ssd", 3: "gpu"}
    rows = [("daemon", "host", "alive", "tier", "used", "capacity", "use%", "blocks", "pinned", "leased")]
    alive = {d.info.daemon_id: (d.alive, d.info.data_addr) for d in s.daemons}
    for seg in s.segments:
        ok, addr = alive.get(seg.daemon_id, (False, "?"))
        pct = 100.0 * seg.used_bytes / seg.capacity_bytes if seg.capacity_bytes else 0.0
        rows.append(
            (seg.daemon_id, addr, "yes" if ok else "NO", tiers.get(seg.tier, "?"), _fmt_bytes(seg.used_bytes),
             _fmt_bytes(seg.capacity_bytes), f"{pct:.1f}", str(seg.blocks), str(seg.pinned_blocks), str(seg.leased_blocks))
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    c = dict(s.counters)
    hits, misses = c.get("hit_keys", 0), c.get("miss_keys", 0)
    rate = 100.0 * hits / (hits + misses) if hits + misses else 0.0
    print(f"\nkeys {s.keys}  pending puts {s.pending_puts}  active leases {s.active_leases}")
    lag = f"{s.touch_interval_ms} ms" if s.touch_interval_ms else "no client reported"
    print(f"hit rate {rate:.1f}% ({hits} hit / {misses} miss keys on get; reads of known locations "
          f"counted up to {lag} late)  "
          f"lookups {c.get('lookups', 0)}  puts {c.get('puts', 0)}  dedup keys {c.get('dedup_keys', 0)}  "
          f"evictions {c.get('evictions', 0)}  corrupt {c.get('corrupt_reported', 0)}")  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        cfg = _config(ns)
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    from kvstore.logs import setup

    setup(cfg.log.level, cfg.log.format)
    try:
        if ns.cmd == "serve":
            asyncio.run(_serve(cfg, True, True))
        elif ns.cmd == "meta" and cfg.cluster.redis:
            asyncio.run(_shard(cfg))
        elif ns.cmd == "meta":
            asyncio.run(_serve(cfg, True, False))
        elif ns.cmd == "daemon":
            asyncio.run(_serve(cfg, False, True))
        elif ns.cmd == "stat":
            return _stat(cfg, ns.json)
        elif ns.cmd == "shm":
            return shm.run(ns, cfg.daemon.shm_dir)
        elif ns.cmd == "bench":
            return _bench(ns.suite, ns.quick)
        elif ns.cmd == "certs":
            from kvstore.certs import DEFAULT_NAMES, make

            files = make(ns.out, tuple(ns.name or DEFAULT_NAMES), ns.server_name, ns.days)
            for name, path in files.items():
                print(f"{name}: {path}" + ("" if name == "ca" else f" (key {path.with_suffix('.key')})"))
            return 0
        elif ns.cmd == "demo":
            plugin = None if ns.store_only else _plugins().get("demo")
            rc = plugin.run(ns, cfg) if plugin is not None else None
            if rc is not None:
                return rc
            from kvstore.demo import run_store_demo

            return run_store_demo(cfg, sessions=ns.sessions * 2, turns=ns.turns + 1, seed=ns.seed)
        else:
            return _plugins()[ns.cmd].run(ns, cfg)
    except KVStoreError as e:
        print(f"kvstore: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
