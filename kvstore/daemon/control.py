"""The cache daemon's gRPC control API (``DaemonControl``): what the metadata service has it do
(``Commit``, ``Invalidate``, ``Move``) and what it asks (``Info``, ``GetInventory``), each call
checked first to come from the service (:meth:`Control._check`). Statuses by cause through
:mod:`kvstore.rpc`; the segment work itself is :class:`kvstore.daemon.server.CacheDaemon`'s.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvstore import tickets
from kvstore.errors import PermissionDenied
from kvstore.v1 import daemon_pb2

if TYPE_CHECKING:
    from kvstore.daemon.server import CacheDaemon


class Control:
    """The daemon's gRPC control API (statuses by cause through :mod:`kvstore.rpc`)."""

    def __init__(self, daemon: CacheDaemon) -> None:
        self.daemon = daemon
        self.peers = {p.strip() for p in daemon.cfg.control_peers.split(",") if p.strip()}
        self.seen = tickets.SeenSignatures(daemon.cfg.ticket_skew_s)

    def _check(self, context, method: str, request, shard: int | None = None) -> None:  # noqa: ANN001
        """Only the metadata service may drive the daemon. With mutual TLS: a certificate whose
        common name is listed in daemon.control_peers. Without it, where the service has
        identities (this daemon has a token): a call signed with the ticket key the daemon gave
        that shard's service (:func:`kvstore.tickets.sign_control`), unless that service said it
        hands out no tickets (then nothing on this daemon is protected, and registration logged
        it). Without identities the service's own API is open to any peer, and so is this one.
        In-process calls carry no context."""
        if context is None:
            return
        d = self.daemon
        if d.tls is not None and d.tls.enabled:
            names = {cn.decode(errors="replace") for cn in (context.auth_context() or {}).get("x509_common_name", ())}
            if not names & self.peers:
                raise PermissionDenied(
                    f"the control API serves only {sorted(self.peers)}, not {sorted(names) or 'anonymous'}"
                )
            return
        if not d.cfg.token:
            return
        value = dict(context.invocation_metadata() or ()).get(tickets.CONTROL_MD)
        got = tickets.parse_control(value) if isinstance(value, str) else None
        if got is None:
            links = d.links if shard is None else d.links[shard : shard + 1]
            if links and all(link.tickets is False for link in links):
                return
            raise PermissionDenied(f"{method}: the control API serves only the metadata service (an unsigned call)")
        sig_shard, stamp, nonce, tag = got
        if shard is not None and sig_shard != shard:
            raise PermissionDenied(f"{method}: signed for shard {sig_shard}, asks for shard {shard}")
        if sig_shard >= len(d.links):
            raise PermissionDenied(f"{method}: signed for shard {sig_shard}, this daemon knows {len(d.links)}")
        link = d.links[sig_shard]
        why = tickets.check_control(
            link.ticket_key, method, sig_shard, stamp, nonce, tag, request.SerializeToString(deterministic=True),
            d.cfg.ticket_skew_s,
        )  # fmt: skip
        if why:
            raise PermissionDenied(f"{method}: {why}")
        if not self.seen.first(tag):
            raise PermissionDenied(f"{method}: this signed call was already served (a replay)")

    async def Info(self, request, context):
        self._check(context, "Info", request)
        return self.daemon.info()

    async def GetInventory(self, request, context):
        self._check(context, "GetInventory", request)
        invs, discarded = await asyncio.to_thread(self.daemon.inventory, request.verify)
        return daemon_pb2.InventoryResponse(inventory=invs, discarded=discarded)

    # Commit, Invalidate and Move are carried out through their link (MetaLink.carry_out): a
    # registration of the daemon with that shard waits for the calls made for the one before
    # to end before it takes its inventory (kvstore.daemon.links.MetaLink.register).

    async def Move(self, request, context):
        self._check(context, "Move", request, request.shard)
        self.daemon.check_epoch(request.shard, request.epoch, request.registration)
        link = self.daemon.links[request.shard]
        reg = request.registration
        # A batch of moves is long (SSD writes): one made for a registration that has ended
        # stops at its next block rather than hold the new one up.
        current = (lambda: link.registration == reg) if reg else None
        return await link.carry_out(asyncio.to_thread(self.daemon.move, request, current))

    async def Commit(self, request, context):
        self._check(context, "Commit", request, request.shard)
        self.daemon.check_epoch(request.shard, request.epoch, request.registration)
        return await self.daemon.links[request.shard].carry_out(self.daemon.run(self.daemon.commit, request))

    async def Invalidate(self, request, context):
        self._check(context, "Invalidate", request, request.shard)
        self.daemon.check_epoch(request.shard, request.epoch, request.registration)
        link = self.daemon.links[request.shard]
        cleared = await link.carry_out(self.daemon.run(self.daemon.invalidate, request.invalidations))
        return daemon_pb2.InvalidateResponse(cleared=cleared)
