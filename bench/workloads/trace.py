"""Replay of a production trace whose prompts are given as chained 512-token hash-block ids.

The trace (``conversation_trace.jsonl``, see its README) names each 512-token block of a prompt
by an integer id that stands for the block together with every block before it. Replay turns
each id ``h`` into the tokens drawn from ``numpy.random.default_rng(h)``, so equal ids give equal
tokens and the store sees exactly the trace's sharing; the last block of a prompt is cut to the
prompt's length.

Scaling down: ``tokens_per_hash_block`` (or ``scale`` = tokens_per_hash_block / 512) shrinks every
hash block to its first ``tokens_per_hash_block`` tokens and every prompt and output length by
the same factor, keeping the number of hash blocks and so the sharing structure. Keep it a
multiple of the store's block size (16) so that store blocks never straddle two hash blocks.
``max_requests`` / ``max_time_s`` keep the first requests / a leading time window.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bench.workloads.base import KEYSPACE, VOCAB, Request, Workload
from kvstore.keys import BlockKey, KeySpace

TRACE_FILE = "conversation_trace.jsonl"
HASH_BLOCK_TOKENS = 512
_REPO = Path(__file__).resolve().parents[2]
DEFAULT_PATHS = (_REPO.parent / "shared" / "traces" / TRACE_FILE, Path("/work/shared/traces") / TRACE_FILE)


def find_trace(path: str | os.PathLike | None = None) -> Path:
    """The trace file: ``path`` if given, else ``$KVSTORE_TRACE``, else the shared traces folder."""
    if path is not None:
        candidates: tuple[Path, ...] = (Path(path),)
    elif os.environ.get("KVSTORE_TRACE"):
        candidates = (Path(os.environ["KVSTORE_TRACE"]),)
    else:
        candidates = DEFAULT_PATHS
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"trace not found; tried {', '.join(map(str, candidates))} (set KVSTORE_TRACE)")


class TraceRecord(NamedTuple):
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@lru_cache(maxsize=1)
def load_trace(path: Path) -> tuple[TraceRecord, ...]:
    """The trace's records in file order (arrival order). Cached: one file, read once per process."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ids = tuple(int(h) for h in r["hash_ids"])
                out.append(TraceRecord(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]), ids))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e})") from None
    return tuple(out)


@lru_cache(maxsize=8192)
def hash_block_tokens(hash_id: int, n: int = HASH_BLOCK_TOKENS) -> np.ndarray:
    """The first ``n`` tokens of hash block ``hash_id`` (read-only; equal ids, equal tokens)."""
    t = np.random.default_rng(hash_id).integers(0, VOCAB, max(n, HASH_BLOCK_TOKENS), dtype=np.int32)[:n]
    t.flags.writeable = False
    return t


class Trace(Workload):
    """Replays the trace. ``seed`` plays no part: the trace is the data and an id's tokens
    depend on the id alone."""

    name = "trace"

    def __init__(
        self,
        seed: int = 0,
        scale: float = 1.0,
        max_requests: int | None = None,
        max_time_s: float | None = None,
        quiet: bool = False,
        *,
        path: str | os.PathLike | None = None,
        tokens_per_hash_block: int | None = None,
    ) -> None:
        if tokens_per_hash_block is not None:
            if isinstance(tokens_per_hash_block, bool) or not isinstance(tokens_per_hash_block, int):
                raise ValueError(f"trace: tokens_per_hash_block must be an int, got {tokens_per_hash_block!r}")
            scale = tokens_per_hash_block / HASH_BLOCK_TOKENS
        super().__init__(seed, scale, max_requests, max_time_s, quiet)
        self.tph = round(HASH_BLOCK_TOKENS * scale)
        if self.tph < 1 or self.tph != HASH_BLOCK_TOKENS * scale:
            raise ValueError(f"trace: scale {scale} must make a whole number of tokens per hash block")
        self.path = find_trace(path)
        self.records = load_trace(self.path)

    def _prompt_len(self, r: TraceRecord) -> int:
        """The scaled prompt length: same number of hash blocks, the last one cut in proportion."""
        n = len(r.hash_ids)
        want = round(r.input_length * self.tph / HASH_BLOCK_TOKENS)
        return min(n * self.tph, max((n - 1) * self.tph + 1, want))

    def _kept(self) -> Iterator[TraceRecord]:
        for i, r in enumerate(self.records):
            if self.max_requests is not None and i >= self.max_requests:
                return
            if self.max_time_s is not None and r.arrival_s >= self.max_time_s:
                return
            if r.hash_ids:
                yield r

    def shape(self) -> str:
        span = self.records[-1].arrival_s - self.records[0].arrival_s if self.records else 0.0
        return f"{self.path.name}: {len(self.records)} requests over {span:.0f} s"

    def scaling(self) -> str:
        parts = []
        kept = list(self._kept())
        if len(kept) != len(self.records):
            window = kept[-1].arrival_s if kept else 0.0
            parts.append(f"first {len(kept)} of {len(self.records)} requests (arrivals up to {window:.0f} s)")
        if self.tph != HASH_BLOCK_TOKENS:
            parts.append(
                f"{self.tph} tokens per hash block instead of {HASH_BLOCK_TOKENS} "
                f"(prompt and output lengths x {self.tph}/{HASH_BLOCK_TOKENS})"
            )
        return f"{self.name}: " + (", ".join(parts) if parts else "unscaled") + f" ({self.shape()})"

    def _generate(self) -> Iterator[Request]:
        for r in self._kept():
            n = self._prompt_len(r)
            prompt = np.concatenate([hash_block_tokens(h, self.tph) for h in r.hash_ids])[:n]
            yield Request(r.arrival_s, prompt, max(1, round(r.output_length * self.scale)))

    def arrivals(self) -> list[float]:
        return [r.arrival_s for r in self._kept()]

    def block_keys(self, keyspace: KeySpace = KEYSPACE) -> list[list[BlockKey]]:
        """As :meth:`Workload.block_keys`, computed once per hash id instead of once per use.

        Sound because an id stands for its whole prefix: an id's keys continue the chain from
        its predecessor's last key, and a cut last block's keys are a prefix of the whole
        block's. An id met after a different predecessor than before (a trace that breaks
        that rule) falls back to hashing that request's prompt.
        """
        bs = keyspace.block_size
        if self.tph % bs:
            return super().block_keys(keyspace)
        self.announce()
        per_block = self.tph // bs
        cache: dict[int, tuple[int | None, list[BlockKey]]] = {}
        out: list[list[BlockKey]] = []
        for r in self._kept():
            length = self._prompt_len(r)
            keys: list[BlockKey] = []
            parent: BlockKey | None = None
            prev: int | None = None
            for i, h in enumerate(r.hash_ids):
                hit = cache.get(h)
                if hit is None:
                    hit = (prev, keyspace.block_keys(hash_block_tokens(h, self.tph), parent=parent))
                    cache[h] = hit
                elif hit[0] != prev:
                    prompt = np.concatenate([hash_block_tokens(x, self.tph) for x in r.hash_ids])[:length]
                    keys = keyspace.block_keys(prompt)
                    break
                whole = hit[1]
                keys.extend(whole[: min(per_block, (length - i * self.tph) // bs)])
                parent, prev = whole[-1], h
            out.append(keys)
        return out
