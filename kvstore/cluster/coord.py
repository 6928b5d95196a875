"""Coordination of a sharded cluster through Redis: the slot map, each shard's leader lease and
fencing epoch, and who is a member.

Keys (``<c>`` is ``cluster.name``)::

    <c>:slots             the slot map (kvstore.cluster.slots.SlotMap.encode), set once, by the
                          first shard process that finds none
    <c>:shard:<k>:leader  "<node>|<address>|<epoch>", with a TTL: shard k's leader lease
    <c>:shard:<k>:epoch   the last epoch handed out for shard k
    <c>:member:<node>     JSON about one process (role, shard, address, host), with a TTL

A lease is taken with a Lua script that sets the leader key only if it does not exist and
advances the epoch in the same step (``SET NX PX``, plus fencing), renewed with a script that
extends it only while it still holds this leader's value, and given up (on a clean stop) with
one that deletes it only then. An epoch is at least the taker's wall clock in milliseconds, so an
epoch that a Redis failover lost (replication is asynchronous) is not handed out a second time as
long as hosts' clocks agree within a lease.

``cluster.redis`` is ``redis://host:port[/db]`` or, with Sentinel, ``sentinel://host:port[,host:port...]/<master>[/db]``:
the primary is then found through the sentinels again after each failure, so the loss of the
Redis primary costs the time Sentinel takes to promote a replica.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from kvstore.cluster.slots import SlotMap, check_shards
from kvstore.errors import InvalidArgument, Unavailable

_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return 0 end
local e = tonumber(redis.call('get', KEYS[2]) or '0') + 1
local floor = tonumber(ARGV[3])
if e < floor then e = floor end
redis.call('set', KEYS[2], e)
redis.call('set', KEYS[1], ARGV[1] .. '|' .. e, 'PX', ARGV[2])
return e
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
return 0
"""
_RESIGN = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Leader:
    node: str
    addr: str
    epoch: int

    @property
    def value(self) -> str:
        return f"{self.node}|{self.addr}|{self.epoch}"

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Leader | None:
        if raw is None:
            return None
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        try:
            node, addr, epoch = text.rsplit("|", 2)
            return cls(node, addr, int(epoch))
        except ValueError:
            raise Unavailable(f"a shard's leader record in Redis is malformed: {text!r}") from None


def parse_url(url: str) -> tuple[str, list[tuple[str, int]], str, int]:
    """``(scheme, [(host, port)], master, db)`` of a ``cluster.redis`` URL."""
    u = urlparse(url)
    if u.scheme not in ("redis", "sentinel"):
        raise InvalidArgument(
            f"cluster.redis must be redis://host:port or sentinel://host:port,.../master, got {url!r}"
        )
    hosts = []
    for part in u.netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"cluster.redis: {part!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in u.path.split("/") if p]
    master = ""
    if u.scheme == "sentinel":
        if not path:
            raise InvalidArgument("cluster.redis: a sentinel:// URL names its master: sentinel://h:p,.../mymaster")
        master = path.pop(0)
    db = int(path[0]) if path and path[0].isdigit() else 0
    return u.scheme, hosts, master, db


class Coordinator:
    """The cluster's state in Redis, for shard processes, daemons, clients and ``kvstore stat``."""

    def __init__(self, url: str, cluster: str = "kvstore", timeout_s: float = 1.0) -> None:
        try:
            import redis.asyncio as aioredis  # the cluster's one dependency; not needed without one
        except ImportError:
            raise InvalidArgument(
                f"a sharded cluster ({url}) needs the redis package: pip install 'kvstore[cluster]'"
            ) from None

        self.url = url
        self.prefix = cluster
        scheme, hosts, master, db = parse_url(url)
        self._errors = (aioredis.RedisError, OSError)
        kw = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if scheme == "sentinel":
            from redis.asyncio.sentinel import Sentinel

            self._sentinel = Sentinel(hosts, sentinel_kwargs=kw, **kw)
            self.r = self._sentinel.master_for(master, db=db, **kw)
        else:
            self._sentinel = None
            self.r = aioredis.Redis(host=hosts[0][0], port=hosts[0][1], db=db, **kw)
        self._acquire = self.r.register_script(_ACQUIRE)
        self._renew = self.r.register_script(_RENEW)
        self._resign = self.r.register_script(_RESIGN)

    def _k(self, *parts: object) -> str:
        return ":".join([self.prefix, *(str(p) for p in parts)])

    async def _do(self, what: str, coro):  # noqa: ANN001, ANN202
        try:
            return await coro
        except self._errors as e:
            raise Unavailable(
                f"cluster coordination (Redis {self.url}) failed to {what}: {type(e).__name__}: {e}"
            ) from e

    async def slot_map(self, shards: int | None = None) -> SlotMap:
        """The cluster's slot map; with ``shards``, made (evenly) if there is none yet, and
        checked to have that many shards."""
        raw = await self._do("read the slot map", self.r.get(self._k("slots")))
        if raw is None:
            if shards is None:
                raise Unavailable(f"cluster {self.prefix!r} has no slot map in Redis yet (no shard has started)")
            made = SlotMap.even(check_shards(shards))
            await self._do("write the slot map", self.r.set(self._k("slots"), made.encode(), nx=True))
            raw = await self._do("read the slot map", self.r.get(self._k("slots")))
        smap = SlotMap.decode(raw.decode())
        if shards is not None and smap.shards != shards:
            raise InvalidArgument(
                f"cluster {self.prefix!r} has {smap.shards} shards in Redis, this process is configured "
                f"with cluster.shards={shards}"
            )
        return smap

    async def acquire(self, shard: int, node: str, addr: str, ttl_s: float) -> int:
        """Takes shard ``shard``'s leader lease if nobody holds it: its new epoch, or 0."""
        floor = int(time.time() * 1000)
        keys = [self._k("shard", shard, "leader"), self._k("shard", shard, "epoch")]
        return int(
            await self._do("take a lease", self._acquire(keys=keys, args=[f"{node}|{addr}", int(ttl_s * 1000), floor]))
        )

    async def renew(self, shard: int, leader: Leader, ttl_s: float) -> bool:
        """Extends the lease while ``leader`` still holds it; False once it does not."""
        keys = [self._k("shard", shard, "leader")]
        return bool(await self._do("renew a lease", self._renew(keys=keys, args=[leader.value, int(ttl_s * 1000)])))

    async def resign(self, shard: int, leader: Leader) -> None:
        await self._do("give a lease up", self._resign(keys=[self._k("shard", shard, "leader")], args=[leader.value]))

    async def lease_left(self, shard: int) -> float:
        """Seconds until shard ``shard``'s leader lease runs out unless renewed (0: none held)."""
        ms = await self._do("read a lease", self.r.pttl(self._k("shard", shard, "leader")))
        return max(0.0, ms / 1000.0)

    async def leaders(self, shards: int) -> list[Leader | None]:
        keys = [self._k("shard", k, "leader") for k in range(shards)]
        return [Leader.parse(v) for v in await self._do("read the leaders", self.r.mget(keys))]

    async def announce(self, node: str, info: dict, ttl_s: float) -> None:
        await self._do("announce a member", self.r.set(self._k("member", node), json.dumps(info), px=int(ttl_s * 1000)))

    async def members(self) -> list[dict]:
        async def scan() -> list:
            return [k async for k in self.r.scan_iter(match=self._k("member", "*"), count=500)]

        keys = await self._do("list the members", scan())
        if not keys:
            return []
        out = []
        for k, v in zip(keys, await self._do("read the members", self.r.mget(keys))):
            if v is not None:
                info = json.loads(v)
                info.setdefault("node", (k.decode() if isinstance(k, bytes) else k).rsplit(":", 1)[-1])
                out.append(info)
        return sorted(out, key=lambda m: (m.get("role", ""), m.get("shard", -1), m["node"]))

    async def close(self) -> None:
        try:
            await self.r.aclose()
        except Exception:  # noqa: BLE001 - closing a connection that is already gone
            pass
