"""The device tier: blocks that inference engines hold in their own paged caches.

An engine (a worker of ``engine/``, or any engine with a connector) reports in batches which
blocks its cache took and dropped, as vLLM's and Dynamo's KV events do. The index keeps, per
key, the engines that hold it, so that a lookup can say which engine holds how much of a prefix
on its device, next to what the store holds in DRAM and on SSD, and a router can send a request
where its prefix already is. These are not replicas the store can read: the bytes live in the
engine; to move a block to another engine, a router asks its holder to put it into the store
(the engine worker's ``POST /export``), and the other engine loads it from there.

Liveness: every report carries a time to live; an engine that stops reporting (killed, hung,
cut off) loses all its holdings when it passes, and one that leaves on purpose drops them at
once. A report with ``reset`` replaces everything the engine reported before (its first report
after a start, so a restarted engine never keeps its predecessor's holdings).

Bounds: at most ``max_engines`` engines (``max_per_owner`` per tenant) and ``max_blocks`` keys
per engine; keys beyond are not recorded (counted), never an error, since losing a hint costs a
recomputation, not data.

Pure state, time from the index's clock, like the rest of :mod:`kvstore.meta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument, ResourceExhausted


@dataclass
class Engine:
    engine_id: str
    url: str
    deadline: float
    owner: str = ""  # the tenant that reports it ("" without credentials)
    keys: set[bytes] = field(default_factory=set)


class EngineTier:
    def __init__(
        self, max_engines: int = 1024, max_blocks: int = 1 << 20, max_ttl_s: float = 60.0, max_per_owner: int = 0
    ) -> None:
        self.max_engines = max_engines
        self.max_blocks = max_blocks
        self.max_ttl_s = max_ttl_s
        # Engines one tenant may report (0: no bound beyond max_engines), so that one tenant
        # cannot take every slot.
        self.max_per_owner = max_per_owner
        self.per_owner: dict[str, int] = {}
        self.engines: dict[str, Engine] = {}
        self.holders: dict[bytes, set[str]] = {}
        self.counters = {"engine_reports": 0, "engine_keys_dropped": 0, "engines_expired": 0, "engines_left": 0}

    @classmethod
    def for_limits(cls, limits) -> EngineTier:  # noqa: ANN001 - records.IndexLimits
        """The device tier an index with these limits keeps."""
        return cls(limits.max_engines, limits.max_engine_blocks, limits.max_engine_ttl_s, limits.max_engines_per_tenant)

    def __len__(self) -> int:
        return len(self.engines)

    def report(
        self,
        engine_id: str,
        url: str,
        added: list[bytes],
        removed: list[bytes],
        reset: bool,
        ttl_s: float,
        now: float,
        leave: bool = False,
        owner: str = "",
    ) -> int:
        """Applies one batch of an engine's events; returns how many keys it now holds."""
        if not engine_id or len(engine_id) > 512:  # the service's id: tenant, NUL, the engine's own
            raise InvalidArgument("engine_id: 1 to 512 characters")
        if len(url) > 1024:
            raise InvalidArgument("url: at most 1024 characters")
        if not 0 < ttl_s <= self.max_ttl_s:
            raise InvalidArgument(f"ttl: {ttl_s:g} s is outside (0, {self.max_ttl_s:g}] s")
        e = self.engines.get(engine_id)
        if leave:
            if e is not None:
                self.drop(engine_id)
                self.counters["engines_left"] += 1
            return 0
        if e is None:
            if len(self.engines) >= self.max_engines:
                raise ResourceExhausted(f"{len(self.engines)} engines report already, the limit of {self.max_engines}")
            mine = self.per_owner.get(owner, 0)
            if self.max_per_owner and owner and mine >= self.max_per_owner:
                raise ResourceExhausted(
                    f"{mine} engines of {owner or 'this caller'} report already, the limit of {self.max_per_owner} "
                    "(meta.max_engines_per_tenant)"
                )
            e = self.engines[engine_id] = Engine(engine_id, url, now + ttl_s, owner)
            self.per_owner[owner] = mine + 1
        elif reset:
            self._forget(e, list(e.keys))
        self.counters["engine_reports"] += 1
        e.url, e.deadline = url or e.url, now + ttl_s
        self._forget(e, removed)
        for k in added:
            if k in e.keys:
                continue
            if len(e.keys) >= self.max_blocks:
                self.counters["engine_keys_dropped"] += 1
                continue
            e.keys.add(k)
            self.holders.setdefault(k, set()).add(engine_id)
        return len(e.keys)

    def _forget(self, e: Engine, keys: list[bytes]) -> None:
        for k in keys:
            if k in e.keys:
                e.keys.discard(k)
                who = self.holders.get(k)
                if who is not None:
                    who.discard(e.engine_id)
                    if not who:
                        del self.holders[k]

    def drop(self, engine_id: str) -> int:
        """Forgets an engine and everything it held; returns how many keys."""
        e = self.engines.pop(engine_id, None)
        if e is None:
            return 0
        left = self.per_owner[e.owner] - 1
        if left:
            self.per_owner[e.owner] = left
        else:
            del self.per_owner[e.owner]
        n = len(e.keys)
        self._forget(e, list(e.keys))
        return n

    def expire(self, now: float) -> int:
        gone = [i for i, e in self.engines.items() if e.deadline < now]
        for i in gone:
            self.drop(i)
        self.counters["engines_expired"] += len(gone)
        return len(gone)

    def held(self, keys: list[bytes]) -> dict[str, tuple[str, bytearray]]:
        """For each engine holding any of ``keys``: (url, one byte per key, 1 where it holds it)."""
        out: dict[str, tuple[str, bytearray]] = {}
        get = self.holders.get
        for i, k in enumerate(keys):
            who = get(k)
            if not who:
                continue
            for eid in who:
                row = out.get(eid)
                if row is None:
                    row = out[eid] = (self.engines[eid].url, bytearray(len(keys)))
                row[1][i] = 1
        return out

    def check_integrity(self) -> None:
        n = 0
        for eid, e in self.engines.items():
            assert e.engine_id == eid
            for k in e.keys:
                assert eid in self.holders.get(k, ()), f"engine {eid} holds {k.hex()} unindexed"
            n += len(e.keys)
        assert sum(len(w) for w in self.holders.values()) == n, "holder sets disagree with engines' keys"
        assert all(self.holders.values()), "an empty holder set is kept"
        owners: dict[str, int] = {}
        for e in self.engines.values():
            owners[e.owner] = owners.get(e.owner, 0) + 1
        assert owners == self.per_owner, f"engines per owner {self.per_owner} != {owners}"


class DeviceTier:
    """The index's side (a mixin of :class:`kvstore.meta.index.Index`): engines' reports (the
    per-tier lookup that answers with them is :meth:`kvstore.meta.reads.Reads.tiers`)."""

    def report_engine(
        self,
        engine_id: str,
        url: str,
        added: bytes,
        removed: bytes,
        reset: bool = False,
        ttl_s: float = 0.0,
        leave: bool = False,
        owner: str = "",
    ) -> int:
        """An engine's batch of cache events (:mod:`kvstore.meta.engines`); returns how many
        keys it holds now. Validates everything before changing anything."""
        ttl = self._timeout(ttl_s, self.limits.engine_ttl_s, self.limits.max_engine_ttl_s, "engine ttl")
        add = self._keys(added, "added") if added else []
        drop = self._keys(removed, "removed") if removed else []
        return self.engine_tier.report(engine_id, url, add, drop, reset, ttl, self.clock.now(), leave, owner)
