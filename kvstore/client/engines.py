"""The client's side of the device tier (:mod:`kvstore.meta.engines`): an engine reports the
blocks its own cache takes and drops, and a router asks where a prompt's blocks are, per tier
and per engine, in one lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, pack_keys
from kvstore.v1 import meta_pb2
from kvstore.wire import U8, leading, unpack

DRAM_BIT, SSD_BIT = 1, 2


@dataclass
class EngineHolding:
    url: str
    held: bytes  # u8 per key: 1 where the engine holds it

    @property
    def leading(self) -> int:
        """How many leading keys of the prompt the engine holds: its device-tier hit."""
        return leading(self.held)


@dataclass
class TierLookup:
    """Where a prompt's blocks are. ``tiers``: per key, bit 0 a DRAM replica, bit 1 an SSD one."""

    keys: int
    tiers: bytes
    engines: dict[str, EngineHolding] = field(default_factory=dict)
    per_tier: bool = True  # False: only the store's leading hit is known (stored_only)

    @classmethod
    def stored_only(cls, keys: int, stored: int) -> TierLookup:
        """What a plain lookup tells: the leading run stored, no tiers, no engines."""
        return cls(keys, bytes([DRAM_BIT] * stored + [0] * (keys - stored)), {}, per_tier=False)

    @property
    def stored(self) -> int:
        """Leading keys the store holds, in either tier (what a get loads)."""
        return leading(self.tiers)

    @property
    def in_dram(self) -> int:
        return leading(self.tiers, DRAM_BIT)

    def device(self, engine_id: str) -> int:
        """Leading keys that ``engine_id`` holds in its own cache (0 when none)."""
        e = self.engines.get(engine_id)
        return e.leading if e is not None else 0


class EngineReports:
    """Mixin of :class:`kvstore.client.client.KVStoreClient`."""

    async def lookup_tiers(self, keys: Sequence[bytes] | bytes) -> TierLookup:
        """Where each key is: per store tier (DRAM, SSD) and per engine holding it in its own
        cache. No side effects."""
        packed = pack_keys(keys)
        n = len(packed) // KEY_BYTES
        # On the lookup stream when there is one (a call's set-up saved), like every lookup.
        resp = await self._lookup(meta_pb2.LookupRequest(keys=packed, per_tier=True))  # type: ignore[attr-defined]
        tiers = bytes(unpack(resp.tiers, U8, "tiers", n))
        engines = {}
        for e in resp.engines:
            if len(e.held) != n:
                raise InvalidArgument(f"engine {e.engine_id}: {len(e.held)} flags for {n} keys")
            engines[e.engine_id] = EngineHolding(e.url, bytes(e.held))
        return TierLookup(n, tiers, engines)

    async def report_engine_blocks(
        self,
        engine_id: str,
        url: str = "",
        added: Sequence[bytes] = (),
        removed: Sequence[bytes] = (),
        reset: bool = False,
        ttl_s: float = 0.0,
        leave: bool = False,
    ) -> int:
        """One batch of an engine's cache events; returns how many keys it holds, as recorded.
        The holdings lapse unless another report follows within ``ttl_s`` (0: the service's
        default, ``meta.engine_ttl_s``)."""
        req = meta_pb2.ReportEngineBlocksRequest(
            engine_id=engine_id,
            url=url,
            added=pack_keys(added) if len(added) else b"",
            removed=pack_keys(removed) if len(removed) else b"",
            reset=reset,
            ttl_ms=int(ttl_s * 1000),
            leave=leave,
        )
        resp = await self._rpc(self._stub.ReportEngineBlocks, req)  # type: ignore[attr-defined]
        return resp.held
