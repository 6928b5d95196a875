"""Unit tests of the service's tombstone delivery bookkeeping (kvstore.meta.daemons.DaemonLink)
that need no daemon: heartbeat batches until acknowledged, and a re-registering daemon's
inventory filtered by the batch it may not have applied."""

from __future__ import annotations

import asyncio

import pytest
from test_index import BLK, SEG, dspec, k, make, pk, put

from kvstore.meta.daemons import _FAILED, DaemonLink, _failed
from kvstore.meta.records import InventoryItem


def where(idx, i: int):  # noqa: ANN001, ANN201
    """Block ``i``'s location (a kvstore.meta.index.Location)."""
    return idx.locations(idx.lookup(pk(i), with_locations=True)[2])[0]


def test_heartbeat_batch_is_resent_until_acknowledged_then_the_next_one_goes():
    idx, _ = make()
    link = DaemonLink(idx)
    put(idx, 0, 1)
    rep0 = where(idx, 0)
    idx.remove(pk(0))
    batch, items = link.heartbeat_batch("d1", 0)
    assert batch and [(t.key, t.offset, t.gen) for t in items] == [(k(0), rep0.offset, rep0.gen)]
    assert link.heartbeat_batch("d1", 0) == (batch, items)  # not acknowledged: sent again
    idx.remove(pk(1))
    assert link.heartbeat_batch("d1", batch - 1) == (batch, items)  # a stale ack changes nothing
    nxt, items2 = link.heartbeat_batch("d1", batch)  # acknowledged: the next batch
    assert nxt != batch and [t.key for t in items2] == [k(1)]
    assert link.heartbeat_batch("d1", nxt) == (0, [])


def test_reregistration_is_filtered_by_the_unacknowledged_batch():
    """The daemon got the batch with a heartbeat but restarted before applying it: its
    inventory still lists the removed block, which must not come back."""
    idx, _ = make()
    link = DaemonLink(idx)
    put(idx, 0)
    rep = where(idx, 0)
    item = InventoryItem(k(0), rep.offset, BLK, rep.checksum, 0, rep.gen)
    idx.remove(pk(0))
    batch, items = link.heartbeat_batch("d1", 0)
    assert items and not idx.tombstones.get("d1")
    link.requeue("d1")  # what the RegisterDaemon handler does first
    assert idx.register_daemon(dspec(), {SEG: [item]}) == 1  # refused
    assert idx.lookup(pk(0))[0] == 0
    # The tombstone goes out again (a fresh batch), until the daemon applies it.
    batch2, again = link.heartbeat_batch("d1", batch)
    assert batch2 and [t.key for t in again] == [k(0)]
    idx.check_integrity()


# ---- failed calls ------------------------------------------------------------------------------
# A CancelledError raised by a call whose channel was closed under it (the daemon was forgotten
# while the call waited) is a failed call, whose tombstones or commit are accounted as not
# delivered; the cancellation of the calling task itself (shutdown) still propagates.


def test_a_call_cancelled_under_a_running_task_is_a_failed_call():
    async def main() -> str:
        call = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(call.cancel)  # the channel closed under the call
        try:
            await call
        except _FAILED as e:
            return _failed(e)
        return "no error"

    assert "CANCELLED" in asyncio.run(main())


def test_the_cancellation_of_the_calling_task_propagates():
    reached = []

    async def caller() -> None:
        call = asyncio.get_running_loop().create_future()
        try:
            await call
        except _FAILED as e:
            _failed(e)
            reached.append("accounted as a failed call")

    async def main() -> None:
        t = asyncio.create_task(caller())
        await asyncio.sleep(0)
        t.cancel()  # shutdown
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())
    assert reached == []
