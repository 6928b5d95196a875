#!/usr/bin/env python3
"""Store-level peers: kvstore next to what users would run instead, on identical objects, in one run.

    python bench/peers.py                  # full size, a few minutes
    python bench/peers.py --quick          # about a minute
    python bench/peers.py --skip mooncake  # leave a peer out on purpose (repeatable)

Systems, each measured in the same run, on the same seeded objects:

- kvstore, shared-memory path and TCP path: ``kvstore serve`` started here on loopback ephemeral
  ports, ``SyncKVStoreClient`` with ``ClientConfig(transport="shm")`` / ``("tcp")``.
- Redis used as a KV-block store the way LMCache's Redis backend uses it: one key per block, SET /
  GET of the bytes (pipelined for batches), EXISTS over many keys for lookups. ``redis-server`` is
  started here on a loopback ephemeral port with persistence off; redis-py with hiredis.
- Mooncake Store (``mooncake-transfer-engine-non-cuda``): ``mooncake_master``, a storage process
  that contributes the memory segment, and the client, all in a private network namespace
  (``unshare -n``) that holds nothing but loopback, because Mooncake's data ports bind every
  interface. The client there is driven over a pipe and times its own calls.

``scripts/setup.sh`` installs every peer. A peer that cannot run (not installed, no network
namespace) or that fails during the run ends the run with an error that names it and says why, and
nothing is written: only ``--skip NAME`` leaves a peer out, and the report says so.

Per object size (64 KiB, 512 KiB, 2 MiB): put and get GB/s over a batch (medians of interleaved
repetitions; every get is compared byte for byte with what was put), per-object get p50 / p99
(single-object round trips after warm-up); and lookups of 1000 keys per call (keys/s, per-call p50 /
p99). Writes bench/results/peers.json, bench/results/peers_throughput.png and the "peers" section of
bench/RESULTS.md.

The parts: bench/peers_harness.py (plan, objects, keys, the measurements), bench/peers_systems.py
(one adapter per system), bench/peers_servers.py (kvstore and Redis servers, through
kvstore.procs), bench/peers_mooncake.py (Mooncake's network namespace) and bench/peers_report.py
(comparisons, plot, RESULTS.md section, JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.peers_harness import FULL, PEERS, QUICK, SEED, BenchError, Plan, Runner, Suite, SystemFailed  # noqa: E402
from bench.peers_mooncake import start_mooncake  # noqa: E402
from bench.peers_report import write  # noqa: E402
from bench.peers_servers import KVStoreServer, RedisServer  # noqa: E402
from bench.peers_systems import KVStorePeer, RedisPeer  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"


def _start_redis(tmp: Path, plan: Plan, servers: contextlib.ExitStack) -> tuple[Any, dict]:
    try:
        importlib.import_module("redis")
    except ImportError:
        raise BenchError("redis-py is not installed (pip install redis hiredis)") from None
    server = servers.enter_context(RedisServer(tmp))
    return Runner(RedisPeer(server.port)), {
        "status": "ok",
        "version": server.versions(),
        "how": "redis-server on 127.0.0.1 (--save '' --appendonly no); one key per block, "
        "pipelined SET / GET, EXISTS of 1000 keys per lookup (LMCache also keeps a small "
        "metadata key per block; left out here, which favours Redis)",
    }


def _start_mooncake(tmp: Path, plan: Plan, servers: contextlib.ExitStack) -> tuple[Any, dict]:
    print("peers: starting Mooncake in a private network namespace ...", file=sys.stderr)
    mc = start_mooncake(tmp, plan)
    return mc, {
        "status": "ok",
        "version": mc.info["version"],
        "how": "mooncake_master + a storage process (segment "
        f"{mc.info['segment_bytes'] >> 20} MiB) + client, TCP transport, all in a private "
        "network namespace (`unshare -n`, loopback only); batch_put_from / batch_get_into on "
        "registered buffers, get_into per object, batch_is_exist of 1000 keys per lookup",
    }


STARTERS = {"redis": _start_redis, "mooncake": _start_mooncake}


def _certs(tmp: Path) -> dict[str, Any]:
    """A CA and certificates for the server ("meta": `kvstore serve` is its metadata service and
    its daemon) and the client."""
    from kvstore.certs import make
    from kvstore.tls import TlsConfig

    d = tmp / "certs"
    make(d, ("meta", "client"))
    return {
        n: TlsConfig(ca=str(d / "ca.pem"), cert=str(d / f"{n}.pem"), key=str(d / f"{n}.key"))
        for n in ("meta", "client")
    }


def _tls_sets(t: Any) -> tuple[str, ...]:
    return (f"tls.ca={t.ca}", f"tls.cert={t.cert}", f"tls.key={t.key}")


def start_peer(peer: str, tmp: Path, plan: Plan, servers: contextlib.ExitStack) -> tuple[Any, dict]:
    """Starts one peer (its servers go on ``servers``); returns its runner and its entry in the
    report's table of systems. Raises :class:`SystemFailed`, naming the peer and why, when it
    cannot run."""
    try:
        return STARTERS[peer](tmp, plan, servers)
    except Exception as e:
        why = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
        raise SystemFailed(
            peer,
            f"cannot run: {why}. Set it up (bash scripts/setup.sh installs every peer) or leave it out with --skip {peer}",
        ) from e


def run(
    quick: bool = False,
    *,
    out: Path | None = None,
    report: bool = True,
    skip: Sequence[str] = (),
    command: str | None = None,
    progress: bool = True,
) -> dict:
    """Runs the comparison; writes the JSON, the plot and (``report``) the RESULTS.md section.
    Returns the result. Every peer not in ``skip`` is measured: one that cannot run or fails
    raises :class:`SystemFailed` (a :class:`BenchError`), and then nothing is written."""
    from bench.report import machine

    plan = QUICK if quick else FULL
    out = out or RESULTS_DIR / "peers.json"
    systems: dict[str, dict] = {}
    runners: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-peers-") as tmpdir, contextlib.ExitStack() as servers:
        tmp = Path(tmpdir)
        kv = servers.enter_context(KVStoreServer(tmp, "1GiB" if plan.batch_bytes > (64 << 20) else "512MiB"))
        suite: Suite | None = None
        try:
            for t in ("shm", "tcp"):
                runners.append(Runner(KVStorePeer(kv.meta, t)))
                systems[f"kvstore-{t}"] = {
                    "status": "ok",
                    "version": f"kvstore {importlib.metadata.version('kvstore')}",
                    "how": f"`kvstore serve` on 127.0.0.1, SyncKVStoreClient(transport={t!r}); "
                    "capability tickets on (the default)",
                }
            # The same over mutual TLS (every gRPC call and data-port connection), tickets on.
            tls = _certs(tmp)
            kv_tls = servers.enter_context(
                KVStoreServer(tmp, "1GiB" if plan.batch_bytes > (64 << 20) else "512MiB", _tls_sets(tls["meta"]), "tls")
            )
            runners.append(Runner(KVStorePeer(kv_tls.meta, "tcp", tls["client"], name="kvstore-tls")))
            systems["kvstore-tls"] = {
                "status": "ok",
                "version": f"kvstore {importlib.metadata.version('kvstore')}",
                "how": "a second `kvstore serve` with mutual TLS (certificates from `kvstore certs`) and tickets, "
                "SyncKVStoreClient(transport='tcp') with a client certificate",
            }
            for peer in PEERS:
                if peer in skip:
                    systems[peer] = {"status": "skipped", "reason": f"left out with --skip {peer}"}
                    continue
                runner, systems[peer] = start_peer(peer, tmp, plan, servers)
                runners.append(runner)
            suite = Suite(runners, plan, progress=progress)
            measured = suite.run()
        finally:
            if suite is not None:
                suite.close()
            else:
                for r in runners:
                    r.close()
    result = {
        "command": command or "python bench/peers.py" + (" --quick" if quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "seed": SEED,
        "plan": asdict(plan),
        "systems": systems,
        "sizes": measured["sizes"],
        "lookup": measured["lookup"],
    }
    write(result, out, report)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batches and fewer repetitions (about a minute)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "peers.json")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=PEERS,
        help="leave a peer out (a peer not left out that cannot run fails the run)",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rebuild the plot and the RESULTS.md section from --out, measure nothing",
    )
    ns = ap.parse_args(argv)
    if ns.render_only:
        write(json.loads(ns.out.read_text()), ns.out, not ns.no_report)
        return 0
    cmd = "python bench/peers.py" + (" --quick" if ns.quick else "") + "".join(f" --skip {s}" for s in ns.skip)
    try:
        r = run(ns.quick, out=ns.out, report=not ns.no_report, skip=ns.skip, command=cmd)
    except BenchError as e:
        print(f"peers: error: {e}", file=sys.stderr)
        print(f"peers: nothing was written ({ns.out} and bench/RESULTS.md are as they were)", file=sys.stderr)
        return 1
    for size, s in r["sizes"].items():
        for name, m in s["systems"].items():
            print(f"{size:>7} {name:<12} put {m['put_gbps']:6.2f} GB/s  get {m['get_gbps']:6.2f} GB/s  "
                  f"p50 {m['get_p50_ms']:7.3f} ms  p99 {m['get_p99_ms']:7.3f} ms")  # fmt: skip
    for name, lk in r["lookup"].items():
        print(
            f"lookup  {name:<12} {lk['keys_per_s']:>12,} keys/s  p50 {lk['p50_ms']:.3f} ms  p99 {lk['p99_ms']:.3f} ms"
        )
    for name, info in r["systems"].items():
        if info["status"] != "ok":
            print(f"{name}: {info['status']}: {info['reason']}")
    for s in r["losses"]:
        print(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
