"""Load or recompute: the cost model an engine's connector decides with.

Loading n bytes costs about ``latency + n / bandwidth`` (both fitted on past loads), recomputing
t tokens ``t / prefill throughput`` (measured by the engine). Until both are measured, it loads:
a store that holds a prefix is assumed worth reading until shown otherwise.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Ewma:
    """Exponentially weighted moving average (None until the first sample)."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class LoadCost:
    """Measured load bandwidth and latency, measured prefill throughput, and the decision."""

    def __init__(self, samples: int = 64) -> None:
        self.bandwidth = Ewma()  # bytes/s of loads, latency excluded
        self.latency = Ewma()  # seconds of a load's fixed cost (round trips)
        self.prefill_tps = Ewma()  # tokens/s the engine computes in prefill
        self.effective_bandwidth = Ewma()  # bytes / total seconds of each load, round trips included
        self._samples: deque[tuple[int, float]] = deque(maxlen=samples)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tps.update(tokens / seconds)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """Splits load time into a fixed part (round trips) and a per-byte part by a least-squares
        line over recent loads; until their sizes differ enough to fit one, all of it counts as
        transfer (a conservative bandwidth)."""
        if nbytes <= 0 or seconds <= 0:
            return
        self._samples.append((nbytes, seconds))
        self.effective_bandwidth.update(nbytes / seconds)
        xs = np.array([b for b, _ in self._samples], dtype=float)
        ys = np.array([t for _, t in self._samples], dtype=float)
        if len(xs) >= 4 and xs.std() > 0.2 * xs.mean():
            slope, intercept = np.polyfit(xs, ys, 1)
            if slope > 0:
                self.latency.value = max(0.0, float(intercept))
                self.bandwidth.value = 1.0 / float(slope)
                return
        self.latency.value = 0.0
        self.bandwidth.value = self.effective_bandwidth.value

    def estimate_load_s(self, nbytes: int) -> float | None:
        if self.bandwidth.value is None or self.latency.value is None:
            return None
        return self.latency.value + nbytes / self.bandwidth.value

    def estimate_compute_s(self, tokens: int) -> float | None:
        return None if self.prefill_tps.value is None else tokens / self.prefill_tps.value

    def worth_loading(self, nbytes: int, tokens: int) -> bool:
        t_load, t_compute = self.estimate_load_s(nbytes), self.estimate_compute_s(tokens)
        return t_load is None or t_compute is None or t_load < t_compute
