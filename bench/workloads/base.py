"""The request stream contract that every workload implements, and its block-key stream."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

import numpy as np

from kvstore.keys import BlockKey, KeySpace, ModelFingerprint

VOCAB = 32000
BLOCK_SIZE = 16

# The benchmarks' fixed scope: every workload's keys are computed in it, so two runs (or two
# processes) give byte-identical key streams for the same seed.
KEYSPACE = KeySpace(ModelFingerprint("bench-llama-8b", "bf16", 32, 8, 128, block_size=BLOCK_SIZE), namespace="bench")


class Request(NamedTuple):
    """One request as a serving engine receives it."""

    arrival_s: float  # seconds from the start of the workload
    prompt: np.ndarray  # token ids, int32, one-dimensional
    output_len: int  # tokens to generate


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random token ids (int32)."""
    return rng.integers(0, VOCAB, int(n), dtype=np.int32)


def scaled(n: float, scale: float, floor: int = 1) -> int:
    """A token count multiplied by ``scale``, never below ``floor``."""
    return max(floor, round(n * scale))


class Workload(ABC):
    """A deterministic stream of requests in arrival order.

    Everything is a pure function of the constructor arguments: two instances with the same
    arguments yield identical requests and keys, in any process. ``scale`` multiplies every
    token length (prompt parts and outputs); ``max_requests`` keeps the first requests in
    arrival order, ``max_time_s`` those arriving before that time. A scaled workload prints
    one line saying how (to stderr, unless ``quiet``) the first time its requests are drawn.
    """

    name: ClassVar[str]

    def __init__(
        self,
        seed: int = 0,
        scale: float = 1.0,
        max_requests: int | None = None,
        max_time_s: float | None = None,
        quiet: bool = False,
    ) -> None:
        if not scale > 0:
            raise ValueError(f"{self.name}: scale must be positive, got {scale}")
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"{self.name}: max_requests must be at least 1, got {max_requests}")
        if max_time_s is not None and not max_time_s > 0:
            raise ValueError(f"{self.name}: max_time_s must be positive, got {max_time_s}")
        self.seed = seed
        self.scale = scale
        self.max_requests = max_requests
        self.max_time_s = max_time_s
        self.quiet = quiet
        self._announced = False

    @abstractmethod
    def _generate(self) -> Iterator[Request]:
        """All requests, in arrival order, before limits."""

    @abstractmethod
    def shape(self) -> str:
        """One line: what this instance generates (sizes after scaling)."""

    def is_scaled(self) -> bool:
        return self.scale != 1.0 or self.max_requests is not None or self.max_time_s is not None

    def scaling(self) -> str:
        """One line saying how this instance is scaled relative to the workload's defaults."""
        parts = []
        if self.scale != 1.0:
            parts.append(f"token lengths x {self.scale:g}")
        if self.max_requests is not None:
            parts.append(f"first {self.max_requests} requests")
        if self.max_time_s is not None:
            parts.append(f"arrivals before {self.max_time_s:g} s")
        return f"{self.name}: " + (", ".join(parts) if parts else "unscaled") + f" ({self.shape()})"

    def announce(self) -> None:
        """Prints the scaling line once, if scaled and not quiet."""
        if self.is_scaled() and not self.quiet and not self._announced:
            print(f"workload {self.scaling()}", file=sys.stderr)
        self._announced = True

    def requests(self) -> Iterator[Request]:
        """The requests, limits applied. Restartable: each call starts over."""
        self.announce()
        for i, req in enumerate(self._generate()):
            if self.max_requests is not None and i >= self.max_requests:
                return
            if self.max_time_s is not None and req.arrival_s >= self.max_time_s:
                return
            yield req

    def arrivals(self) -> list[float]:
        """Arrival times of :meth:`requests`, in order."""
        return [r.arrival_s for r in self.requests()]

    def block_keys(self, keyspace: KeySpace = KEYSPACE) -> list[list[BlockKey]]:
        """Per request, the keys of its prompt's full blocks (a trailing partial block has none)."""
        return [keyspace.block_keys(r.prompt) for r in self.requests()]
