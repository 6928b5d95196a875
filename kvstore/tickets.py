"""Capability tickets for the data port.

Every daemon makes a random ticket key each time it registers with the metadata service and hands
it over with the registration (mutual TLS where configured), so no ticket of an earlier
registration serves. For every placement the
service hands out, it signs what the holder may do with that one extent:

    mac = BLAKE2b-128(key = daemon's ticket key,
                      op u8 | segment_id u32 | offset u64 | length u64 | gen u64 | expiry u32 | block key 16s)

``op`` is READ (an Acquire's locations: ``expiry`` = the lease's end, or ``meta.read_ticket_ttl_s``
from now if that is later) or WRITE (a PutStart's placements: ``expiry`` = the reservation's end); ``expiry`` is in
wall-clock seconds. A read ticket names one generation of one block, which the daemon serves only
while its extent holds exactly that (eviction, removal or reuse ends it sooner than any expiry), so
it may outlive the lease: a client reads a block it knows again without asking the service
(:mod:`kvstore.client.locations`). The client
sends the MAC and expiry with each data-port entry, and the daemon serves an entry only if the
MAC matches what it names and the expiry has not passed (with ``SKEW_S`` of tolerance between
hosts' clocks). So a peer cannot read or write an extent the service did not give it, nor use a
read ticket to write, nor one ticket for another extent or generation; a write ticket replayed
after its block was committed, or used after its reservation ended and the extent went to a later
put, is refused by the daemon (that generation, or a later one, is already sealed there).

Keyed BLAKE2b is a MAC by design (RFC 7693 section 3.3; no HMAC construction needed), and costs
about a microsecond per placement in Python.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict

TICKET = struct.Struct("<16sI")  # mac | expiry: 20 bytes per location
_SIGNED = struct.Struct("<BIQQQI16s")
MAC_BYTES = 16
KEY_BYTES = 32
SKEW_S = 30
NO_TICKET = bytes(TICKET.size)
READ = 1
WRITE = 2


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


# A keyed hasher per ticket key, copied for each MAC: the key block is hashed once, not per
# ticket (a few keys live in a process: its own daemon's, or one per daemon the service knows).
_KEYED: dict[bytes, object] = {}
_KEYED_MAX = 1024


def _keyed(key: bytes):  # noqa: ANN202 - a hashlib object
    h = _KEYED.get(key)
    if h is None:
        if len(_KEYED) >= _KEYED_MAX:
            _KEYED.clear()
        h = _KEYED[key] = hashlib.blake2b(digest_size=MAC_BYTES, key=key)
    return h.copy()  # type: ignore[attr-defined]


def mac(key: bytes, op: int, segment_id: int, offset: int, length: int, gen: int, expiry: int, block: bytes) -> bytes:
    h = _keyed(key)
    h.update(_SIGNED.pack(op, segment_id, offset, length, gen, expiry, block))
    return h.digest()


def issue(
    key: bytes, op: int, segment_id: int, offset: int, length: int, gen: int, block: bytes, ttl_s: float
) -> bytes:
    """A ticket (mac | expiry) for one extent; empty key: no ticket (zeros)."""
    if not key:
        return NO_TICKET
    expiry = int(time.time() + ttl_s) + 1
    return TICKET.pack(mac(key, op, segment_id, offset, length, gen, expiry, block), expiry)


def issue_many(keys: list[bytes], op: int, rows: list[tuple[int, int, int, int, bytes]], ttl_s: float) -> bytes:
    """Tickets for many extents at once (one clock read, one keyed hasher per daemon key):
    ``keys[i]`` signs ``rows[i]`` = (segment_id, offset, length, gen, block key); an empty key
    signs nothing (zeros)."""
    expiry = int(time.time() + ttl_s) + 1
    bases: dict[bytes, object] = {}
    pack, tpack = _SIGNED.pack, TICKET.pack
    out = []
    for key, (seg, off, length, gen, block) in zip(keys, rows):
        if not key:
            out.append(NO_TICKET)
            continue
        base = bases.get(key)
        if base is None:
            base = bases[key] = _keyed(key)
        h = base.copy()  # type: ignore[attr-defined]
        h.update(pack(op, seg, off, length, gen, expiry, block))
        out.append(tpack(h.digest(), expiry))
    return b"".join(out)


def check(
    key: bytes,
    op: int,
    segment_id: int,
    offset: int,
    length: int,
    gen: int,
    expiry: int,
    block: bytes,
    tag: bytes,
    skew_s: float = SKEW_S,
) -> str:
    """Why the ticket does not allow this entry ("" when it does); ``skew_s`` tolerates clocks
    that differ between hosts."""
    if expiry + skew_s < time.time():
        return "ticket expired"
    if not hmac.compare_digest(tag, mac(key, op, segment_id, offset, length, gen, expiry, block)):
        return "ticket does not match this entry (another extent, generation, operation or daemon key)"
    return ""


# ---- control calls -----------------------------------------------------------------------------
#
# Where the service has identities (meta.auth_file) but the control channel has no mutual TLS, the
# daemon's control API (commit, invalidate, move, inventory) must still obey the service alone: a
# peer that can reach the control port could otherwise list every tenant's blocks, drop them, or
# seal one tenant's extent under another tenant's key. The service signs each call with the key the
# daemon handed it at registration (the ticket key: no other secret to distribute), over the method,
# the shard, a wall-clock stamp, a random nonce and the request's deterministic encoding:
#
#     kvstore-control: "<shard>.<stamp>.<nonce hex>.<mac hex>"
#     mac = BLAKE2b-128(key = ticket key, person = "kvstore-control",
#                       shard u32 | stamp u64 | nonce 8s | method | 0 | request bytes)
#
# The daemon accepts a stamp within its ticket skew of its own clock, and each signature once
# (it remembers those it accepted for as long as their stamps are accepted): a call seen on the
# wire cannot be played again. This guards against peers that can reach the control port; on a
# network where peers can also read the traffic, use mutual TLS (the ticket key itself travels in
# the registration). The signed bytes are the request as the daemon re-encodes it, so the service
# and its daemons must run the same protocol version of the control messages.

CONTROL_MD = "kvstore-control"
_CONTROL_HEAD = struct.Struct("<IQ8s")
NONCE_BYTES = 8


def control_mac(key: bytes, method: str, shard: int, stamp: int, nonce: bytes, body: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=MAC_BYTES, key=key, person=b"kvstore-control")
    h.update(_CONTROL_HEAD.pack(shard, stamp, nonce))
    h.update(method.encode() + b"\0")
    h.update(body)
    return h.digest()


def sign_control(key: bytes, method: str, shard: int, body: bytes) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that signs a control call (none without a key)."""
    if not key:
        return ()
    stamp = int(time.time())
    nonce = os.urandom(NONCE_BYTES)
    tag = control_mac(key, method, shard, stamp, nonce, body)
    return ((CONTROL_MD, f"{shard}.{stamp}.{nonce.hex()}.{tag.hex()}"),)


def parse_control(value: str) -> tuple[int, int, bytes, bytes] | None:
    """(shard, stamp, nonce, mac) of a control signature, None if it is not one."""
    parts = value.split(".")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    if len(parts[2]) != 2 * NONCE_BYTES or len(parts[3]) != 2 * MAC_BYTES:
        return None
    try:
        nonce, tag = bytes.fromhex(parts[2]), bytes.fromhex(parts[3])
    except ValueError:
        return None
    shard, stamp = int(parts[0]), int(parts[1])
    if shard >= 1 << 32 or stamp >= 1 << 64:
        return None
    return shard, stamp, nonce, tag


def check_control(
    key: bytes, method: str, shard: int, stamp: int, nonce: bytes, tag: bytes, body: bytes, skew_s: float
) -> str:
    """Why a signed control call is refused ("" when it is not); replays are the caller's to
    catch (:class:`SeenSignatures`)."""
    if abs(stamp - time.time()) > skew_s + 1:
        return f"signature stamp {stamp} is more than {skew_s:.0f} s from this daemon's clock"
    if not hmac.compare_digest(tag, control_mac(key, method, shard, stamp, nonce, body)):
        return "signature does not match this call (another method, shard, request or key)"
    return ""


class SeenSignatures:
    """Control-call signatures accepted while their stamps are still accepted (a replay of one is
    refused). Thread-safe; memory follows the rate of signed calls over twice the skew."""

    def __init__(self, skew_s: float) -> None:
        self.keep_s = 2 * (skew_s + 1) + 1
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # tag -> forget at (wall clock)
        self._lock = threading.Lock()

    def first(self, tag: bytes) -> bool:
        """Records ``tag``; False if it was seen before (a replay)."""
        now = time.time()
        with self._lock:
            seen = self._seen
            while seen:
                old, until = next(iter(seen.items()))
                if until > now:
                    break
                del seen[old]
            if tag in seen:
                return False
            seen[tag] = now + self.keep_s
            return True
