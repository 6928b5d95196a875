"""The adaptive cache policy's state beside the block table's columns
(:mod:`kvstore.meta.policy`): access counts and their aging, the history of blocks seen but not stored, the duel of
modes (:mod:`kvstore.meta.duel`), second chance's spells, and the deferral of accesses. What the
modes do with them, and where the parameters come from, is told in :mod:`kvstore.meta.policy`.

A count is stored packed as ``epoch << 8 | count``: it halves once per epoch it missed
(TinyLFU's reset, done lazily), so aging costs nothing up front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvstore.meta.duel import FREQUENCY, MAX_COUNT, MODES, SECOND_CHANCE, Duel

T = TypeVar("T")
PENDING_MAX = 1 << 16  # queued accesses (keys) that force a drain
EPOCH_SHIFT = 8


def until(items: Iterable[T], size: Callable[[T], int], want: int) -> list[T]:
    """The first ``items`` whose sizes add up to ``want`` (the last one may pass it)."""
    out: list[T] = []
    acc = 0
    for it in items:
        if acc >= want:
            break
        out.append(it)
        acc += size(it)
    return out


def aged(packed: int, epoch: int) -> int:
    """A count stored as ``epoch << 8 | count``, aged to ``epoch`` (halved once per epoch)."""
    return (packed & MAX_COUNT) >> min(8, epoch - (packed >> EPOCH_SHIFT))


class AdaptiveCounts:
    """What the adaptive policy keeps beside the table (a mixin): counts' aging, the history of
    blocks not stored, the duel of modes, second chance's spells, and the deferral of accesses.
    The policy keeps a stored block's count and mark in columns of the block table
    (:mod:`kvstore.meta.policy`): ``_population``, ``_bump`` and ``_end_spell`` are its part;
    ``params`` (a :class:`~kvstore.meta.records.PolicyParams`) is set before ``_init_counts``."""

    def _init_counts(self) -> None:
        self.epoch = 0
        self._n = 0
        self.history: OrderedDict[bytes, int] = OrderedDict()
        self.duel = Duel(self.params)
        # Second-chance mode's spells, numbered: a block is marked (read again) when its
        # ``again`` is the current spell's number (see _second_chance).
        self._spell = 1
        # With ``defer`` (the service sets it), accesses are queued and accounted at the next
        # drain(): the service drains right after answering, so a read's accounting is off its
        # critical path. Every other method drains first, and the index tells the policy of a
        # block's arrival or departure before its entries change, so the order of events the
        # policy sees, and so every decision, is the same as without.
        self.defer = False
        self._pending: list[tuple[Sequence[bytes], int]] = []
        self._pending_keys = 0

    @property
    def frequency_mode(self) -> bool:
        return self.duel.mode == FREQUENCY

    @property
    def second_chance_mode(self) -> bool:
        return self.duel.mode == SECOND_CHANCE

    @property
    def mode_switches(self) -> int:
        return self.duel.switches

    def _history_limit(self) -> int:
        p = self.params
        return min(p.history_max, int(p.history_factor * max(p.min_population, self._population())))

    def access(self, keys: Sequence[bytes], hits: int) -> None:
        """A read of ``keys`` (a request's chain, hits and misses), of which the index held the
        first ``hits``."""
        if not self.defer:
            self._access(keys, hits)
            return
        self._pending.append((keys, hits))
        self._pending_keys += len(keys)
        if self._pending_keys >= PENDING_MAX:
            self.drain()

    def drain(self) -> None:
        """Accounts the queued accesses, in order."""
        if self._pending:
            pending, self._pending, self._pending_keys = self._pending, [], 0
            for keys, hits in pending:
                self._access(keys, hits)

    def _access(self, keys: Sequence[bytes], hits: int) -> None:
        epoch = self.epoch
        stamp = epoch << EPOCH_SHIFT
        hist = self.history
        spell = self._spell if self.duel.mode == SECOND_CHANCE else 0
        for k in self._bump(keys, stamp, spell):  # the keys not stored: counted in the history
            old = hist.pop(k, None)
            hist[k] = stamp | min(MAX_COUNT, (aged(old, epoch) if old is not None else 0) + 1)
        limit = self._history_limit()
        while len(hist) > limit:
            hist.popitem(last=False)
        self._n += len(keys)
        if self._n >= self.params.age_factor * max(self.params.min_population, self._population()):
            self._n = 0
            self.epoch += 1
        was = self.duel.mode
        self.duel.observe(keys, self._population(), hits)
        if was == SECOND_CHANCE and self.duel.mode != SECOND_CHANCE:
            self._end_spell()
        if self.duel.mode == SECOND_CHANCE and was != SECOND_CHANCE:
            self._spell += 1  # a new spell: marks of an earlier one no longer count

    def _from_history(self, key: bytes) -> int:
        """A block enters the index: its count (packed) out of the history, 0 if none."""
        self.drain()
        old = self.history.pop(key, None)
        return (self.epoch << EPOCH_SHIFT) | aged(old, self.epoch) if old is not None else 0

    def _to_history(self, key: bytes, freq: int) -> None:
        """A block whose count (packed) is ``freq`` leaves the index: the count goes to the history."""
        self.drain()
        c = aged(freq, self.epoch)
        if c:
            self.history[key] = (self.epoch << EPOCH_SHIFT) | c
            if len(self.history) > self._history_limit():
                self.history.popitem(last=False)

    def _history_count(self, key: bytes) -> int:
        old = self.history.get(key)
        return aged(old, self.epoch) if old is not None else 0

    def stats(self) -> dict[str, int]:
        # Read-only, without a drain: the metrics thread calls it while the service runs.
        return {
            "policy_frequency_mode": int(self.frequency_mode),
            "policy_second_chance_mode": int(self.second_chance_mode),
            "policy_mode_switches": self.mode_switches,
            **{f"policy_{m}_keys": n for m, n in zip(MODES, self.duel.keys_in)},
            "policy_history": len(self.history),
            "policy_epoch": self.epoch,
            **{f"policy_{m}_calibration_permille": round(1000 * k) for m, k in zip(MODES, self.duel.calibration())},
        }
