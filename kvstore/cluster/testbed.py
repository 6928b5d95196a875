"""A whole cluster on one machine, for tests, benchmarks and trying it out: Redis (alone, or a
primary, a replica and three Sentinels), metadata shards with a primary and a standby each, and
cache daemons, every one a separate process; optionally each on its own "host", a network
namespace of its own joined to the others by a bridge (``ip netns``, veth pairs), so that every
byte between hosts crosses TCP and nothing can use another host's shared memory.

    with Testbed(tmp, hosts=3) as tb:            # root, for network namespaces
        tb.start_redis(sentinel=True)
        tb.start_shards(2)                        # primary on one host, standby on the next
        tb.start_daemon(host=2)
        client = SyncKVStoreClient(tb.client_meta, config=tb.client_config())

``hosts=0`` runs everything on loopback instead (no root needed). Addresses of the hosts are in
``10.213.<net>.0/24``, a network of this testbed only; the root namespace is ``.254`` on it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from kvstore.procs import Child, free_port, start, start_listening

# Fast failure detection for a test cluster: leases of 2 s are the default as well.
FAST = (
    "meta.heartbeat_interval_s=0.2",
    "meta.daemon_ttl_s=1.5",
    "meta.sweep_interval_s=0.05",
)


def netns_available() -> str:
    """Why network namespaces cannot be made here ("" if they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kvp{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """``n`` network namespaces on one bridge (host i at 10.213.<net>.<i+1>)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:5]
        self.net = 100 + int(self.tag, 16) % 150
        self.bridge = f"kvb{self.tag}"
        self.names = [f"kvh{self.tag}{i}" for i in range(n)]
        self.root_addr = f"10.213.{self.net}.254"

    def addr(self, i: int) -> str:
        return f"10.213.{self.net}.{i + 1}"

    def _veth(self, i: int) -> str:
        return f"kvv{self.tag}{i}"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.root_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("link", "add", self._veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self._veth(i), "master", self.bridge)
            _ip("link", "set", self._veth(i), "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def link(self, i: int, up: bool) -> None:
        """Cuts host ``i`` off the network (or brings it back): its side of the bridge goes down."""
        _ip("link", "set", self._veth(i), "up" if up else "down")

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def down(self) -> None:
        for i, ns in enumerate(self.names):
            subprocess.run(["ip", "link", "del", self._veth(i)], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class Testbed:
    __test__ = False  # not a test class, whatever its name

    def __init__(self, tmp: Path, hosts: int = 0, name: str = "kvstore", sets: tuple[str, ...] = ()) -> None:
        self.tmp = Path(tmp)
        self.hosts = Hosts(hosts) if hosts else None
        self.name = name
        # The hosts' network is this testbed's own: plaintext is allowed on it (pass tls.* sets
        # to run it with mutual TLS instead).
        self.sets = (*FAST, *(("tls.allow_plaintext=true",) if hosts else ()), *sets)
        self.redis: list[Child] = []  # primary, replica
        self.sentinels: list[Child] = []
        self._redis_at: list[tuple[int, int]] = []  # (host, port) of each Redis server
        self._sentinel_at: list[tuple[int, int, Path]] = []
        self.redis_url = ""
        self.shards: dict[tuple[int, int], Child] = {}  # (shard, replica no.) -> process
        self.shard_hosts: dict[tuple[int, int], int] = {}
        self.daemons: dict[str, Child] = {}
        self.daemon_hosts: dict[str, int] = {}
        self.nshards = 0
        self._logs: list = []
        self._ports = 0

    # ---- hosts -------------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        if self.hosts is not None:
            try:
                self.hosts.up()
            except BaseException:
                self.hosts.down()  # what was made before the failure
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def addr(self, host: int) -> str:
        return self.hosts.addr(host) if self.hosts is not None else "127.0.0.1"

    def _prefix(self, host: int) -> list[str]:
        return self.hosts.prefix(host) if self.hosts is not None else []

    def _log(self, name: str):  # noqa: ANN202
        f = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(f)
        return f

    def _port(self, host: int) -> int:
        """A port for a server on ``host`` (in namespaces, every host has all of its ports)."""
        if self.hosts is None:
            return free_port("127.0.0.1")
        self._ports += 1
        return 21000 + self._ports

    # ---- Redis -------------------------------------------------------------------------------

    def start_redis(self, sentinel: bool = False) -> str:
        """Redis on host 0 (and with ``sentinel`` a replica on host 1 and a Sentinel on each of
        the first three hosts, quorum 2). Returns ``cluster.redis``."""
        port = self._port(0)
        self._redis_at = [(0, port)]
        self.redis.append(self._redis_server(0, port))
        if not sentinel:
            self.redis_url = f"redis://{self.addr(0)}:{port}"
            return self.redis_url
        rhost = 1 if self.hosts else 0
        rport = self._port(rhost)
        self._redis_at.append((rhost, rport))
        self.redis.append(self._redis_server(rhost, rport, replica_of=(self.addr(0), port)))
        sent = []
        for i in range(3):
            host = i if self.hosts is not None and self.hosts.n > i else 0
            sport = self._port(host)
            conf = self.tmp / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {sport}\nbind {self.addr(host)}\nprotected-mode no\ndir {self.tmp}\n"
                f"sentinel monitor kvs {self.addr(0)} {port} 2\n"
                "sentinel down-after-milliseconds kvs 1000\n"
                "sentinel failover-timeout kvs 4000\n"
                "sentinel parallel-syncs kvs 1\n"
            )
            self._sentinel_at.append((host, sport, conf))
            self.sentinels.append(self._sentinel(i))
            sent.append(f"{self.addr(host)}:{sport}")
        self.redis_url = f"sentinel://{','.join(sent)}/kvs"
        return self.redis_url

    def _sentinel(self, i: int) -> Child:
        host, port, conf = self._sentinel_at[i]
        cmd = [*self._prefix(host), "redis-server", str(conf), "--sentinel"]
        return start_listening(
            cmd, port, f"sentinel-{i}", timeout=15, host=self.addr(host), stdout=self._log(f"sentinel-{i}")
        )

    def redis_primary(self) -> tuple[str, int]:
        """The Redis primary as the Sentinels name it now."""
        import redis

        for host, port, _conf in self._sentinel_at:
            try:
                addr = redis.Redis(host=self.addr(host), port=port, socket_timeout=1).sentinel_get_master_addr_by_name(
                    "kvs"
                )
            except redis.RedisError:
                continue
            if addr:
                host = addr[0].decode() if isinstance(addr[0], bytes) else addr[0]
                return host, int(addr[1])
        raise RuntimeError("no Sentinel names a Redis primary")

    def restart_redis_replicas(self) -> int:
        """Restarts, one by one, every Redis server that is not the primary now (as a replica of
        it), then every Sentinel (each with the file it rewrote). Returns how many were restarted."""
        primary = self.redis_primary()
        n = 0
        for i, (host, port) in enumerate(self._redis_at):
            if (self.addr(host), port) == primary:
                continue
            self.redis[i].stop(5)
            self.redis[i] = self._redis_server(host, port, replica_of=primary)
            n += 1
        for i in range(len(self.sentinels)):
            self.sentinels[i].stop(5)
            self.sentinels[i] = self._sentinel(i)
            n += 1
        return n

    def _redis_server(self, host: int, port: int, replica_of: tuple[str, int] | None = None) -> Child:
        cmd = [*self._prefix(host), "redis-server", "--port", str(port), "--bind", self.addr(host),
               "--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(self.tmp)]  # fmt: skip
        if replica_of:
            cmd += ["--replicaof", replica_of[0], str(replica_of[1])]
        return start_listening(cmd, port, "redis", timeout=15, host=self.addr(host), stdout=self._log(f"redis-{port}"))

    # ---- kvstore processes -------------------------------------------------------------------

    def _kvstore(self, args: list[str], host: int, name: str, timeout: float = 60.0) -> Child:
        sets = [a for s in self.sets for a in ("--set", s)]
        return start(
            [*args, "--set", f"cluster.redis={self.redis_url}", "--set", f"cluster.name={self.name}", *sets],
            name=name,
            timeout=timeout,
            stderr=self._log(name),
            prefix=self._prefix(host),
        )

    def start_shard(self, shard: int, replica: int, host: int) -> Child:
        port = self._port(host)
        listen = f"{self.addr(host)}:{port}"
        child = self._kvstore(
            ["meta", "--listen", listen, "--shards", str(self.nshards), "--shard", str(shard)],
            host,
            f"shard{shard}-{replica}",
        )
        self.shards[(shard, replica)] = child
        self.shard_hosts[(shard, replica)] = host
        return child

    def start_shards(self, shards: int, standby: bool = True) -> None:
        """Per shard a primary (started first, so it leads) and a standby, on the next host."""
        self.nshards = shards
        n = self.hosts.n if self.hosts is not None else 1
        for k in range(shards):
            self.start_shard(k, 0, k % n)
        self.wait_leaders()
        if standby:
            for k in range(shards):
                self.start_shard(k, 1, (k + 1) % n)

    def leaders(self, timeout: float = 30.0) -> list:
        """Each shard's leader as Redis has it (asked again while Redis fails over)."""
        import asyncio

        from kvstore.cluster.coord import Coordinator
        from kvstore.errors import Unavailable

        async def read() -> list:
            c = Coordinator(self.redis_url, self.name)
            deadline = time.monotonic() + timeout
            try:
                while True:
                    try:
                        return await c.leaders(self.nshards)
                    except Unavailable:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.1)
            finally:
                await c.close()

        return asyncio.run(read())

    def wait_leaders(self, timeout: float = 30.0, not_epochs: dict[int, int] | None = None) -> list:
        """Until every shard has a leader (with an epoch other than ``not_epochs``'s)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                leaders = self.leaders(timeout=1.0)
            except Exception:  # noqa: BLE001 - Redis failing over
                leaders = [None] * self.nshards
            if all(
                lead is not None and (not not_epochs or lead.epoch != not_epochs.get(k))
                for k, lead in enumerate(leaders)
            ):
                return leaders
            if time.monotonic() > deadline:
                raise RuntimeError(f"shards without a leader after {timeout} s: {leaders}")
            time.sleep(0.05)

    def leader_process(self, shard: int) -> tuple[int, int]:
        """(shard, replica) of the process that leads ``shard`` now."""
        lead = self.leaders()[shard]
        for (k, r), child in self.shards.items():
            if k == shard and child.alive() and f"-{child.proc.pid}" in lead.node:
                return k, r
        raise RuntimeError(f"no process of shard {shard} is its leader {lead}")

    def start_daemon(self, host: int, name: str | None = None, dram: str = "64MiB", *sets: str) -> Child:
        name = name or f"d{host}-{uuid.uuid4().hex[:6]}"
        args = ["daemon", "--dram", dram, "--data-dir", str(self.tmp / f"daemon-{name}"), "--host", self.addr(host),
                "--set", f"daemon.daemon_id={name}", "--set", f"daemon.host_id=host{host}"]  # fmt: skip
        for s in sets:
            args += ["--set", s]
        child = self._kvstore(args, host, name)
        self.daemons[name] = child
        self.daemon_hosts[name] = host
        return child

    def restart_daemon(self, name: str, timeout: float = 15.0) -> Child:
        """SIGTERM (a drain), then the same daemon again: its segment is reattached."""
        self.daemons[name].stop(timeout, keep_shm=True)
        return self.start_daemon(self.daemon_hosts[name], name)

    @property
    def client_meta(self) -> str:
        return f"{self.redis_url}#{self.name}"

    def client_config(self, **kw: object):  # noqa: ANN201
        """Client settings from the root namespace: TCP only (another host), a host id of its own."""
        from kvstore.config import ClientConfig

        cfg = ClientConfig(meta=self.client_meta, transport="tcp" if self.hosts else "auto", host_id="client-root")
        for k, v in kw.items():
            setattr(cfg, k, v)
        return cfg

    # ---- faults ------------------------------------------------------------------------------

    @staticmethod
    def pause(child: Child) -> None:
        child.proc.send_signal(signal.SIGSTOP)

    @staticmethod
    def resume(child: Child) -> None:
        child.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        procs = [*self.daemons.values(), *self.shards.values(), *self.sentinels, *self.redis]
        for child in procs:
            if child.alive():
                try:
                    child.proc.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for child in procs:
            try:
                child.stop(5)
            except Exception:  # noqa: BLE001 - tear everything down regardless
                child.kill()
        if self.hosts is not None:
            self.hosts.down()
        for f in self._logs:
            f.close()
