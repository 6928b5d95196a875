"""The daemon's control API without mutual TLS, where the service has identities
(kvstore.daemon.control.Control._check, kvstore.tickets.sign_control): only calls the service
signed with the shard's ticket key pass, each once; a signature does not carry over to another
method, shard, request body or key, nor outlive the skew."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from kvstore import tickets
from kvstore.daemon.control import Control
from kvstore.errors import PermissionDenied
from kvstore.v1 import daemon_pb2

KEYS = [os.urandom(32), os.urandom(32)]


class Ctx:
    def __init__(self, md) -> None:  # noqa: ANN001
        self.md = tuple(md)

    def invocation_metadata(self):  # noqa: ANN201
        return self.md


def control(token: str = "node-token", tickets_on: bool | None = True) -> Control:
    cfg = SimpleNamespace(token=token, ticket_skew_s=30.0, control_peers="meta")
    links = [SimpleNamespace(ticket_key=k, tickets=tickets_on) for k in KEYS]
    return Control(SimpleNamespace(cfg=cfg, tls=None, links=links))


def signed(key: bytes, method: str, shard: int, req) -> Ctx:  # noqa: ANN001
    return Ctx(tickets.sign_control(key, method, shard, req.SerializeToString(deterministic=True)))


def test_a_signed_call_passes_once():
    c = control()
    req = daemon_pb2.InvalidateRequest(shard=1, epoch=3)
    ctx = signed(KEYS[1], "Invalidate", 1, req)
    c._check(ctx, "Invalidate", req, 1)
    with pytest.raises(PermissionDenied, match="replay"):
        c._check(ctx, "Invalidate", req, 1)
    c._check(signed(KEYS[1], "Invalidate", 1, req), "Invalidate", req, 1)  # signed anew: a new nonce
    inv = daemon_pb2.InventoryRequest(verify=True)
    c._check(signed(KEYS[0], "GetInventory", 0, inv), "GetInventory", inv)  # no shard in the request


def test_a_signature_is_bound_to_its_call():
    c = control()
    req = daemon_pb2.CommitRequest(shard=0, epoch=1, keys=b"k" * 16)
    other = daemon_pb2.CommitRequest(shard=0, epoch=1, keys=b"x" * 16)
    cases = [
        (signed(KEYS[0], "Commit", 0, other), "Commit", req, 0, "does not match"),  # another body
        (signed(KEYS[0], "Invalidate", 0, req), "Commit", req, 0, "does not match"),  # another method
        (signed(KEYS[1], "Commit", 1, req), "Commit", req, 0, "shard"),  # signed for another shard
        (signed(KEYS[1], "Commit", 0, req), "Commit", req, 0, "does not match"),  # another shard's key
        (signed(os.urandom(32), "Commit", 0, req), "Commit", req, 0, "does not match"),
        (signed(KEYS[0], "Commit", 5, req), "Commit", req, None, "knows 2"),
        (Ctx([]), "Commit", req, 0, "unsigned"),
        (Ctx([(tickets.CONTROL_MD, "0.1.zz.zz")]), "Commit", req, 0, "unsigned"),
    ]
    for ctx, method, r, shard, why in cases:
        with pytest.raises(PermissionDenied, match=why):
            c._check(ctx, method, r, shard)


def test_an_old_stamp_is_refused():
    c = control()
    req = daemon_pb2.MoveRequest(shard=0)
    stamp, nonce = int(time.time()) - 120, os.urandom(tickets.NONCE_BYTES)
    tag = tickets.control_mac(KEYS[0], "Move", 0, stamp, nonce, req.SerializeToString(deterministic=True))
    ctx = Ctx([(tickets.CONTROL_MD, f"0.{stamp}.{nonce.hex()}.{tag.hex()}")])
    with pytest.raises(PermissionDenied, match="stamp"):
        c._check(ctx, "Move", req, 0)


def test_who_is_not_checked():
    req = daemon_pb2.InfoRequest()
    control(token="")._check(Ctx([]), "Info", req)  # no identities: the service is open, so is this
    control(tickets_on=False)._check(Ctx([]), "Info", req)  # the service signs nothing (logged)
    control()._check(None, "Info", req)  # in-process
    with pytest.raises(PermissionDenied):
        control(tickets_on=None)._check(Ctx([]), "Info", req)  # not told yet: refused
