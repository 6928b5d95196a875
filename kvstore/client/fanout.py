"""What a client of a sharded cluster does with its shards' answers (kvstore.client.shards):
merge their location rows in key order, find a chain's leading hits over all of them, and let
concurrent lookups to one shard share a call.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore import tickets
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.keys import KEY_BYTES
from kvstore.v1 import common_pb2, meta_pb2
from kvstore.wire import ROW_DTYPE


def merge_locations(
    parts: Sequence[tuple[common_pb2.Locations, Sequence[int]]], count: int, asked: bytes
) -> common_pb2.Locations:
    """One Locations of ``count`` rows from shards' Locations, each with the output row of each of
    its rows (``asked``: the keys of the output rows, for rows a shard sent no stored key for)."""
    rows = np.zeros(count, dtype=ROW_DTYPE)
    with_tickets = any(loc.tickets for loc, _ in parts)
    with_keys = any(loc.keys for loc, _ in parts)
    tick = bytearray(count * tickets.TICKET.size) if with_tickets else None
    keys = bytearray(asked[: count * KEY_BYTES]) if with_keys else None
    segments = []
    refs = itertools.count(1)
    for loc, where in parts:
        if not len(where):
            continue
        idx = np.asarray(where, dtype=np.int64)
        # A shard's rows are in key order: those before the merged hit count are a prefix.
        part = np.frombuffer(loc.rows, dtype=ROW_DTYPE)[: len(idx)].copy()
        renumber = {}
        for ref in loc.segments:
            new = renumber[ref.ref] = next(refs)
            segments.append(common_pb2.SegmentRef(ref=new, daemon=ref.daemon, segment_id=ref.segment_id, tier=ref.tier))
        part["ref"] = [renumber.get(int(r), 0) for r in part["ref"]]
        rows[idx] = part
        t = tickets.TICKET.size
        for j, i in enumerate(where):
            if tick is not None and loc.tickets:
                tick[i * t : (i + 1) * t] = loc.tickets[j * t : (j + 1) * t]
            if keys is not None and loc.keys:
                keys[i * KEY_BYTES : (i + 1) * KEY_BYTES] = loc.keys[j * KEY_BYTES : (j + 1) * KEY_BYTES]
    return common_pb2.Locations(
        rows=rows.tobytes() if count else b"",
        segments=segments,
        tickets=bytes(tick) if tick is not None else b"",
        keys=bytes(keys) if keys is not None else b"",
    )


class Coalescer:
    """Per shard: lookups without locations share one call. At most ``INFLIGHT`` calls are in
    flight to the shard; lookups that come meanwhile wait and go together, as one per-key
    ``Lookup`` (up to ``COALESCE_KEYS`` keys), whose per-key answer is split back to each. So
    under load a shard pays its per-call cost once for many callers, and a fan-out over S
    shards costs each shard one call per round, not one per caller."""

    INFLIGHT = 2
    COALESCE_KEYS = 8192

    def __init__(self, meta: Any, shard: int) -> None:  # meta: kvstore.client.shards.ShardedMeta
        self.meta = meta
        self.shard = shard
        self.pending: list[tuple[bytes, asyncio.Future, float | None]] = []
        self.inflight = 0

    async def exists(self, keys: bytes, timeout: float | None) -> np.ndarray:
        n = len(keys) // KEY_BYTES
        if n > self.COALESCE_KEYS:  # alone: its size (and any refusal of it) is its own
            req = meta_pb2.LookupRequest(keys=keys, per_key=True)
            resp = await self.meta.call(self.shard, "Lookup", req, timeout)
            return np.frombuffer(resp.exists, dtype=np.uint8)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((keys, fut, timeout))
        if self.inflight < self.INFLIGHT:
            self.inflight += 1
            asyncio.ensure_future(self._run())
        return await fut

    async def _run(self) -> None:
        try:
            while self.pending:
                batch, room = [], 0
                while self.pending and room + len(self.pending[0][0]) // KEY_BYTES <= self.COALESCE_KEYS:
                    item = self.pending.pop(0)
                    if not item[1].done():  # a caller that gave up is not asked for
                        batch.append(item)
                        room += len(item[0]) // KEY_BYTES
                if batch:
                    await self._send(batch, room)
        finally:
            self.inflight -= 1

    async def _send(self, batch: list, total: int) -> None:
        timeout = min((t for _k, _f, t in batch if t), default=None)
        req = meta_pb2.LookupRequest(keys=b"".join(k for k, _f, _t in batch), per_key=True)
        try:
            resp = await self.meta.lookup_on_stream(self.shard, req, timeout)
            bits = np.frombuffer(resp.exists, dtype=np.uint8)
            if len(bits) != total:
                raise Unavailable(f"shard {self.shard} answered {len(bits)} flags for {total} keys")
        except InvalidArgument as e:
            if len(batch) == 1:
                raise_into(batch, e)
                return
            for item in batch:  # refused together (e.g. over meta.max_batch_keys): each alone
                await self._send([item], len(item[0]) // KEY_BYTES)
            return
        except BaseException as e:  # every caller of the batch gets it, and none waits forever
            raise_into(batch, e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        at = 0
        for k, f, _t in batch:
            n = len(k) // KEY_BYTES
            if not f.done():
                f.set_result(bits[at : at + n])
            at += n


def raise_into(batch: list, e: BaseException) -> None:
    if isinstance(e, asyncio.CancelledError):
        e = Unavailable("lookup cancelled with the client")
    for _k, f, _t in batch:
        if not f.done():
            f.set_exception(e)


def leading(positions: np.ndarray, hit: int, n: int) -> int:
    """The global position of a shard's first miss (``n``: it missed none)."""
    return int(positions[hit]) if hit < len(positions) else n
