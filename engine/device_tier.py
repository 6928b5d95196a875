"""Reports what this engine's paged cache holds to the store's index (the device tier,
``kvstore.meta.engines``), so that a router can see which worker holds which prefix on its
device, as vLLM's and Dynamo's KV events do.

The block manager appends every key its prefix cache takes or drops to ``events`` (a deque:
appends on the engine thread, pops here). Every ``interval_s`` a reporter thread sends what
changed since the last report, netted per key, which also keeps the holdings alive: they lapse
``ttl_s`` after the last report the index got, so a worker that dies (SIGKILL included) loses
them within that time, and one that stops cleanly drops them at once (``close``). The first
report, and the first after a failed one, replaces everything reported before (``reset``)
with the set this reporter mirrors, so a restarted worker or service never keeps stale holdings.
A failed report is logged and retried; it never reaches the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger("engine.device_tier")

# When the index counts other than the reporter does (its per-engine cap, a lost report), resend
# everything at most this often.
RESYNC_S = 5.0


class CacheReporter:
    def __init__(
        self,
        client,  # noqa: ANN001 - kvstore.SyncKVStoreClient
        engine_id: str,
        url: str,
        interval_s: float = 0.25,
        ttl_s: float = 2.0,
        max_batch: int = 8192,
    ) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"the report interval ({interval_s} s) must be positive and below the ttl ({ttl_s} s)")
        self.client = client
        self.engine_id, self.url = engine_id, url
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.max_batch = max_batch  # keys per call, under the service's meta.max_batch_keys
        self.events: deque = deque()
        self.held: set[bytes] = set()  # what the index should hold for us
        self.synced = False
        self.reports = 0
        self.failures = 0
        self.last_ok = 0.0  # monotonic time of the last report the index took
        self.last_reset = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-tier", daemon=True)

    def start(self) -> CacheReporter:
        self._thread.start()
        return self

    def _drain(self) -> tuple[list[bytes], list[bytes]]:
        last: dict[bytes, bool] = {}
        while self.events:
            took, key = self.events.popleft()
            last[key] = took
        added = [k for k, took in last.items() if took and k not in self.held]
        removed = [k for k, took in last.items() if not took and k in self.held]
        self.held.difference_update(removed)
        self.held.update(added)
        return added, removed

    def _send(self, added: list[bytes], removed: list[bytes], reset: bool) -> int:
        """One report in calls of at most ``max_batch`` keys (the reset, if any, in the first);
        returns what the index says the engine holds after the last."""
        held = 0
        first = True
        while first or added or removed:
            rem, removed = removed[: self.max_batch], removed[self.max_batch :]
            add, added = added[: self.max_batch - len(rem)], added[self.max_batch - len(rem) :]
            held = self.client.report_engine_blocks(
                self.engine_id, self.url, add, rem, reset=reset and first, ttl_s=self.ttl_s
            )
            first = False
        return held

    def report_once(self) -> bool:
        now = time.monotonic()
        # The index may have let the holdings lapse (a report stuck past the ttl, a restarted
        # service): then, or when it counts other than we do, everything is sent again.
        if self.synced and now - self.last_ok >= self.ttl_s:
            self.synced = False
        added, removed = self._drain()
        try:
            if self.synced:
                held = self._send(added, removed, reset=False)
            else:
                held = self._send(list(self.held), [], reset=True)
                self.last_reset = now
            self.synced = held == len(self.held) or now - self.last_reset < RESYNC_S
            self.reports += 1
            self.last_ok = time.monotonic()
            return True
        except Exception as e:  # noqa: BLE001 - the store away: report everything once it is back
            self.failures += 1
            if self.synced or self.failures == 1:
                log.warning("event=device_tier_report_failed reason=%r", str(e))
            self.synced = False
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.report_once()
            except Exception:  # noqa: BLE001 - never let the reporter die (events would pile up)
                log.exception("event=device_tier_reporter_error")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops reporting and drops this engine's holdings from the index now."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)  # a report in flight must not land after the leave
        try:
            self.client.report_engine_blocks(self.engine_id, self.url, leave=True, ttl_s=self.ttl_s)
        except Exception as e:  # noqa: BLE001 - they lapse with the ttl anyway
            log.info("event=device_tier_leave_failed reason=%r", str(e))
