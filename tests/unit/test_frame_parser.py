"""The data port's frame parser (kvstore.transport.frames.check_head and
kvstore.daemon.entries.check_entries) on random bytes, property-based: every input is either
refused with FrameError or accepted with every accepted entry inside its segment, within the
block limit and (with a ticket key) carrying a ticket for exactly that entry. The same parser
runs longer under atheris: tests/fuzz/atheris_frames.py."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import tickets
from kvstore.daemon.entries import check_entries
from kvstore.extent import HEADER_SIZE
from kvstore.transport.frames import ENTRY, MAGIC, MAX_ENTRIES, REQ_HEAD, VERSION, FrameError, Op, check_head

SEGMENTS = {1: SimpleNamespace(size=64 << 20), 2: SimpleNamespace(size=1 << 30)}
LIMIT = 1 << 20
KEY = b"\x07" * tickets.KEY_BYTES
EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "400"))


# Tickets the parser remembers as verified, shared across examples (as a daemon's data port does),
# so that the property tests also drive the remembered path.
VERIFIED: dict = {}


def parse(data: bytes, key: bytes = b"", verified: dict | None = VERIFIED) -> tuple[int, list] | None:
    """The parser as the daemon runs it on one frame; None where it refuses the frame."""
    try:
        op, _rid, count = check_head(data[: REQ_HEAD.size])
        body = data[REQ_HEAD.size : REQ_HEAD.size + count * ENTRY.size]
        if len(body) < count * ENTRY.size:
            return None  # the daemon would wait for the rest, then see the peer close
        entries = list(ENTRY.iter_unpack(body)) if count else []
        check_entries(entries, op, SEGMENTS, LIMIT, key, tickets.SKEW_S, verified)
        return op, entries
    except FrameError:
        return None


def _accepted_invariants(op: int, entries: list, key: bytes) -> None:
    assert op in (Op.READ, Op.WRITE, Op.PING) and len(entries) <= MAX_ENTRIES
    for k, seg, expiry, off, length, _c, gen, tag in entries:
        assert seg in SEGMENTS and 0 < length <= LIMIT and off + HEADER_SIZE + length <= SEGMENTS[seg].size
        if key and op != Op.PING:
            top = tickets.READ if op == Op.READ else tickets.WRITE
            assert tickets.check(key, top, seg, off, length, gen, expiry, k, tag) == ""


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=600), st.booleans())
def test_random_bytes(data: bytes, keyed: bool):
    key = KEY if keyed else b""
    got = parse(data, key)
    if got is not None:
        _accepted_invariants(*got, key)


_entry = st.tuples(
    st.binary(min_size=16, max_size=16),
    st.sampled_from([0, 1, 2, 3]),
    st.integers(0, 2**32 - 1),
    st.one_of(st.integers(0, 2 << 30), st.integers(0, 2**64 - 1)),
    st.one_of(st.integers(0, 2 << 20), st.integers(0, 2**64 - 1)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(min_size=16, max_size=16),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.sampled_from([Op.READ, Op.WRITE, Op.PING, 0, 9]), st.lists(_entry, max_size=8), st.booleans())
def test_structured_frames(op: int, entries: list, keyed: bool):
    key = KEY if keyed else b""
    data = REQ_HEAD.pack(MAGIC, VERSION, op, 0, 1, len(entries)) + b"".join(ENTRY.pack(*e) for e in entries)
    got = parse(data, key)
    if got is not None:
        _accepted_invariants(*got, key)


def test_a_signed_entry_is_accepted_and_any_change_refused():
    k, seg, off, length, gen = b"b" * 16, 1, 4096, 5000, 77
    tag, expiry = tickets.TICKET.unpack(tickets.issue(KEY, tickets.READ, seg, off, length, gen, k, 10))
    good = (k, seg, expiry, off, length, 0, gen, tag)
    head = REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, 1)
    assert parse(head + ENTRY.pack(*good), KEY) is not None
    for i in (0, 1, 2, 3, 4, 6, 7):
        bad = list(good)
        bad[i] = bad[i] + 1 if isinstance(bad[i], int) else bytes([bad[i][0] ^ 1]) + bad[i][1:]
        assert parse(head + ENTRY.pack(*bad), KEY) is None, f"field {i} changed and still accepted"
    write = REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1)
    assert parse(write + ENTRY.pack(*good), KEY) is None  # a read ticket does not write
    assert parse(head + ENTRY.pack(*good), b"\x08" * tickets.KEY_BYTES) is None  # another daemon key
    assert time.time() < expiry + tickets.SKEW_S


def test_a_remembered_ticket_still_expires_and_the_memory_is_bounded(monkeypatch):
    from kvstore.daemon import entries

    k, seg, off, length, gen = b"c" * 16, 2, 8192, 4000, 5
    tag, expiry = tickets.TICKET.unpack(tickets.issue(KEY, tickets.READ, seg, off, length, gen, k, 10))
    frame = REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, 1) + ENTRY.pack(k, seg, expiry, off, length, 0, gen, tag)
    verified: dict = {}
    assert parse(frame, KEY, verified) is not None
    assert len(verified) == 1
    assert parse(frame, KEY, verified) is not None  # remembered
    later = time.time() + 10 + tickets.SKEW_S + 5
    monkeypatch.setattr(entries.time, "time", lambda: later)
    assert parse(frame, KEY, verified) is None  # past its expiry, remembered or not
    monkeypatch.undo()
    monkeypatch.setattr(entries, "_VERIFIED_MAX", 4)
    for g in range(10):
        t, e = tickets.TICKET.unpack(tickets.issue(KEY, tickets.READ, seg, off, length, g, k, 10))
        f = REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, 1) + ENTRY.pack(k, seg, e, off, length, 0, g, t)
        assert parse(f, KEY, verified) is not None
        assert len(verified) <= 4
