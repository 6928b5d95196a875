"""The tier loop hands each daemon its batch of moves on its own: a daemon whose moves hang
gets no new batch (it is skipped in planning) while the others' batches keep going."""

from __future__ import annotations

import asyncio

from kvstore.config import MetaConfig
from kvstore.meta.service import MetaServer


async def test_a_hanging_daemon_holds_up_only_its_own_moves():
    meta = MetaServer(MetaConfig(listen="127.0.0.1:0", tier_interval_s=0.01, sweep_interval_s=0.01))
    skips: list[set[str]] = []
    ran: dict[str, int] = {"slow": 0, "fast": 0}
    hang = asyncio.Event()

    def plan(max_bytes, skip=()):  # noqa: ANN001, ANN202
        skips.append(set(skip))
        return {d: ["move"] for d in ("slow", "fast") if d not in skip}

    async def run_moves(plans):  # noqa: ANN001, ANN202
        for did in plans:
            ran[did] += 1
            if did == "slow":
                await hang.wait()

    meta.index.plan_moves = plan
    meta.link.run_moves = run_moves
    await meta.start()
    try:
        await asyncio.sleep(0.5)
        assert ran["slow"] == 1  # its one batch is still under way
        assert ran["fast"] >= 10  # the other daemon's batches went on meanwhile
        assert all("slow" in s for s in skips[2:])
        hang.set()
        n = ran["slow"]
        await asyncio.sleep(0.2)
        assert ran["slow"] > n  # planned again once it answered
    finally:
        hang.set()
        await meta.stop()
