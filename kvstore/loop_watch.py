"""How long a server's event loop is held: a task wakes every :data:`TICK_S` and records how late
it woke (what ran meanwhile without giving the loop back). The service's work at scale (a
registration of millions of blocks, a lost daemon's drop) goes in steps so that this stays
within tens of milliseconds; this is what shows it from outside.

Exported (Prometheus, on the server's registry): the histogram
``kvstore_event_loop_lag_seconds`` and the gauge ``kvstore_event_loop_lag_max_seconds`` (the
longest hold of the last :data:`WINDOW_S` seconds).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

TICK_S = 0.01
WINDOW_S = 60.0
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopWatch:
    """Measures the loop it runs on (:meth:`start`) until :meth:`stop`."""

    def __init__(self, registry: CollectorRegistry, server: str) -> None:
        self.server = server
        self.hist = Histogram(
            "kvstore_event_loop_lag_seconds",
            "How late a timer on the server's event loop fired (the loop was held that long)",
            ["server"],
            registry=registry,
            buckets=BUCKETS,
        ).labels(server)
        self._worst: deque[tuple[float, float]] = deque()  # (when, lag): the window's record holders
        self._task: asyncio.Task | None = None
        registry.register(self)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(TICK_S)
            self.record(max(0.0, loop.time() - t - TICK_S))

    def record(self, lag: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.hist.observe(lag)
        w = self._worst  # lags in decreasing order, each the longest since it was seen
        while w and w[-1][1] <= lag:
            w.pop()
        w.append((now, lag))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._worst and now - self._worst[0][0] > WINDOW_S:
            self._worst.popleft()

    def max_lag(self, now: float | None = None) -> float:
        """The longest hold within the last :data:`WINDOW_S` seconds."""
        self._trim(time.monotonic() if now is None else now)
        return self._worst[0][1] if self._worst else 0.0

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            "kvstore_event_loop_lag_max_seconds",
            f"The longest the server's event loop was held in the last {WINDOW_S:.0f} s",
            labels=["server"],
        )
        fam.add_metric([self.server], self.max_lag())
        yield fam
