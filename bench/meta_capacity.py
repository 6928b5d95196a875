#!/usr/bin/env python3
"""One-key operations per second that one store sustains, with 1, 4 and 8 client processes,
next to Redis on the same objects in the same run.

    python bench/meta_capacity.py            # 5 s per point
    python bench/meta_capacity.py --quick    # 1.5 s per point

Servers: ``kvstore serve`` (one metadata service process and one daemon) and ``redis-server``
(persistence off), both on loopback, started here. Objects: 2,000 blocks of 4 KiB, put once.
Each client process (separate Python processes, started at once, each with its own connection)
loops for the same wall time over the objects in a seeded random order:

- lookups: kvstore ``lookup([key])`` against Redis ``EXISTS key``, on the metadata service's
  lookup port (the default) and over gRPC (``client.lookup_port=false``);
- gets: kvstore ``get_into([key], [buf])`` against Redis ``GET key``; every result is compared
  with the object's bytes. kvstore's client knows where the blocks are once it has read them (one
  warm-up pass over the objects first; Redis gets the same pass), so its gets are served from the
  daemon's shared memory without the metadata service (``shm``) or by the daemon's data port
  (``tcp``); the same gets through a lease each (``client.location_cache=0``) are measured too.

Figures (``bench/results/meta_capacity.json``): ops/s per system, operation and process count,
and ``single_key_get_ops_over_redis`` / ``single_key_lookup_ops_over_redis`` (the best of 1/4/8
processes, kvstore / Redis; target >= 0.5 for gets). This machine has 2 cores shared by servers
and clients: more processes than cores measure contention as much as capacity.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.peers_servers import KVStoreServer, RedisServer  # noqa: E402

OBJECTS = 2000
SIZE = 4096
PROCS = (1, 4, 8)
QUICK_PROCS = (1, 4)  # --quick: fewer points (each starts its processes and warms them up)
RESULTS = REPO / "bench" / "results" / "meta_capacity.json"
# The figures that the peer comparison's JSON (bench/results/peers.json) carries as well.
CAPACITY_FIELDS = (
    "single_key_lookup_grpc_ops_over_redis",
    "single_key_get_ops_over_redis",
    "single_key_get_tcp_ops_over_redis",
    "single_key_get_leased_ops_over_redis",
    "single_key_lookup_ops_over_redis",
)


def carry(capacity: dict, peers: dict) -> None:
    """Copies this benchmark's figures into a peers.json result, saying which run they are from."""
    peers.update({k: capacity[k] for k in CAPACITY_FIELDS if k in capacity})
    peers["capacity_source"] = f"`{capacity['command']}`, {capacity['date']} (bench/results/meta_capacity.json)"


def _keys() -> list[bytes]:
    from kvstore import KeySpace, ModelFingerprint

    ks = KeySpace(ModelFingerprint("bench-capacity", "bf16", 1, 1, 8))
    return [ks.block_keys(np.arange(i * 16, i * 16 + 16))[0] for i in range(OBJECTS)]


def _obj(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


def _worker(system: str, op: str, addr: str, seconds: float, seed: int, start_at: float, out) -> None:  # noqa: ANN001
    keys = _keys()
    objs = [_obj(i) for i in range(OBJECTS)]
    order = np.random.default_rng(seed).permutation(OBJECTS).tolist()
    buf = np.zeros(SIZE, np.uint8)
    if system == "redis":
        import redis

        r = redis.Redis(host="127.0.0.1", port=int(addr), socket_timeout=60)
        one = (lambda k, i: r.exists(k) == 1) if op == "lookup" else (lambda k, i: r.get(k) == objs[i].tobytes())
        for i in order:  # the same warm-up pass kvstore gets
            r.get(keys[i])
        close = r.close
    else:
        from kvstore import SyncKVStoreClient
        from kvstore.config import ClientConfig

        if system == "kvstore-grpc":  # lookups over gRPC, not the lookup port
            cfg = ClientConfig(lookup_port=False)
        else:
            transport, _, leased = system.removeprefix("kvstore-").partition("-")
            cfg = ClientConfig(transport=transport, location_cache=0 if leased else 65536)
        c = SyncKVStoreClient(addr, cfg)
        for i in order:  # learns where the blocks are (a router or an engine has read them before)
            c.get_into([keys[i]], [buf])

        def one(k: bytes, i: int) -> bool:
            if op == "lookup":
                return c.lookup([k]) == 1
            return c.get_into([k], [buf]) == 1 and np.array_equal(buf, objs[i])

        close = c.close
    while time.time() < start_at:
        time.sleep(0.001)
    n = bad = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = order[n % OBJECTS]
        bad += int(not one(keys[i], i))
        n += 1
    close()
    out.put((n, bad))


def measure(system: str, op: str, addr: str, procs: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 3.0 + 0.5 * procs  # every process connected and warmed up first
    ps = [ctx.Process(target=_worker, args=(system, op, addr, seconds, s, start_at, q)) for s in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=120 + seconds) for _ in ps]
    for p in ps:
        p.join(30)
    n, bad = sum(r[0] for r in res), sum(r[1] for r in res)
    if bad:
        raise SystemExit(f"meta_capacity: {system} {op}: {bad} wrong or missing answers")
    return {"ops": n, "ops_per_s": round(n / seconds)}


LOOKUP_LABELS = {"kvstore-shm": "kvstore (lookup port)", "kvstore-grpc": "kvstore (gRPC)"}
LABELS = {
    "redis": "Redis",
    "kvstore-shm": "kvstore (shm, known locations)",
    "kvstore-tcp": "kvstore (tcp, known locations)",
    "kvstore-shm-leased": "kvstore (shm, a lease per get)",
    "kvstore-tcp-leased": "kvstore (tcp, a lease per get)",
}


def lookup_lines(result: dict) -> list[str]:
    if "single_key_lookup_grpc_ops_over_redis" not in result:  # a record from before the lookup port
        return [
            f"- `single_key_lookup_ops_over_redis` = **{result['single_key_lookup_ops_over_redis']:.2f}**: every "
            "lookup is a round trip to the one metadata process through Python gRPC, the same that caps leased "
            "gets (an Acquire each) at about a thousand per second above."
        ]
    return [
        f"- `single_key_lookup_ops_over_redis` = **{result['single_key_lookup_ops_over_redis']:.2f}** (target >= 0.5):"
        " lookups on the metadata service's lookup port (a framed socket beside gRPC, asked from the calling"
        f" thread); over gRPC {result['single_key_lookup_grpc_ops_over_redis']:.2f}, the round trip through Python"
        " gRPC that also caps leased gets (an Acquire each) at about a thousand per second above. Both servers are"
        " one process each (the metadata service answers the port on its event loop, between its gRPC calls).",
    ]


def render(result: dict) -> str:
    points, seconds = result["points"], result["seconds_per_point"]
    procs = result.get("processes", PROCS)
    lines = [
        "## One-key operations per second with 1, 4 and 8 client processes (`bench/meta_capacity.py`)",
        "",
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}",
        f"- Machine: {result['machine']}",
        f"- Setup: `kvstore serve` (one metadata process, one daemon) and `redis-server`, loopback; "
        f"{result['objects']:,} objects of {result['object_bytes']} B; each client process loops {seconds:g} s "
        "over them in a seeded random order after one warm-up pass (kvstore's client then knows where every "
        "block is); every get is checked byte for byte. Lookups are kvstore `lookup([key])` (a round trip "
        "to the metadata service: on its lookup port, or over gRPC) against Redis `EXISTS`; gets are `get_into([key])` against `GET`. Servers "
        "and clients share 2 cores.",
        "",
        "| operation | system | " + " | ".join(f"{n} process{'es' if n > 1 else ''}" for n in procs) + " |",
        "|---|---|" + "---|" * len(procs),
    ]
    for op, systems in points.items():
        for system, per in systems.items():
            label = LOOKUP_LABELS.get(system, "kvstore") if op == "lookup" and system != "redis" else LABELS[system]
            lines.append(f"| {op} | {label} | " + " | ".join(f"{per[str(n)]['ops_per_s']:,}/s" for n in procs) + " |")
    lines += [
        "",
        f"- `single_key_get_ops_over_redis` = **{result['single_key_get_ops_over_redis']:.2f}** (target >= 0.5, "
        f"best of {'/'.join(map(str, procs))} processes); over TCP "
        f"{result['single_key_get_tcp_ops_over_redis']:.2f}; with a lease per get "
        f"{result['single_key_get_leased_ops_over_redis']:.2f}.",
        *lookup_lines(result),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from bench.report import machine, update_section

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--render-only", action="store_true", help="rebuild the RESULTS.md section from --out")
    ns = ap.parse_args(argv)
    if ns.render_only:
        update_section("capacity", render(json.loads(ns.out.read_text())))
        return 0
    seconds = 1.5 if ns.quick else 5.0
    t0 = time.time()
    points: dict[str, dict[str, dict[str, dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-capacity-") as tmpdir:
        tmp = Path(tmpdir)
        with KVStoreServer(tmp, "256MiB") as kv, RedisServer(tmp) as rs:
            import redis

            from kvstore import SyncKVStoreClient

            keys = _keys()
            with SyncKVStoreClient(kv.meta) as c:
                assert c.put(keys, [_obj(i) for i in range(OBJECTS)]).stored == OBJECTS
            r = redis.Redis(host="127.0.0.1", port=rs.port)
            r.mset({k: _obj(i).tobytes() for i, k in enumerate(keys)})
            r.close()
            plan = [("redis", "lookup"), ("kvstore-shm", "lookup"), ("kvstore-grpc", "lookup"), ("redis", "get"), ("kvstore-shm", "get"),
                    ("kvstore-tcp", "get"), ("kvstore-shm-leased", "get"), ("kvstore-tcp-leased", "get")]  # fmt: skip
            procs = QUICK_PROCS if ns.quick else PROCS
            with tqdm(total=len(plan) * len(procs), desc="capacity", unit="point") as bar:
                for system, op in plan:
                    addr = str(rs.port) if system == "redis" else kv.meta
                    for n in procs:
                        bar.set_postfix_str(f"{system} {op} x{n}")
                        m = measure(system, op, addr, n, seconds)
                        points.setdefault(op, {}).setdefault(system, {})[str(n)] = m
                        bar.update(1)

    def best(op: str, system: str) -> int:
        return max(m["ops_per_s"] for m in points[op][system].values())

    result = {
        "command": "python bench/meta_capacity.py" + (" --quick" if ns.quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "seconds_per_point": seconds,
        "objects": OBJECTS,
        "processes": list(procs),
        "object_bytes": SIZE,
        "points": points,
        "single_key_get_ops_over_redis": round(best("get", "kvstore-shm") / best("get", "redis"), 3),
        "single_key_get_tcp_ops_over_redis": round(best("get", "kvstore-tcp") / best("get", "redis"), 3),
        "single_key_get_leased_ops_over_redis": round(best("get", "kvstore-shm-leased") / best("get", "redis"), 3),
        "single_key_lookup_ops_over_redis": round(best("lookup", "kvstore-shm") / best("lookup", "redis"), 3),
        "single_key_lookup_grpc_ops_over_redis": round(best("lookup", "kvstore-grpc") / best("lookup", "redis"), 3),
        "wall_s": round(time.time() - t0, 1),
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    peers = ns.out.with_name("peers.json")
    if peers.exists():  # the peer comparison's JSON carries these figures too
        p = json.loads(peers.read_text())
        carry(result, p)
        peers.write_text(json.dumps(p, indent=2) + "\n")
    if not ns.no_report:
        update_section("capacity", render(result))
    print(json.dumps({k: v for k, v in result.items() if k != "points"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
