"""Clients forget what daemons that left held open: idle data-port connections are closed after
their idle time, and shared-memory mappings of segments that are gone or replaced are dropped."""

from __future__ import annotations

import os
import socket

import numpy as np

from kvstore.daemon.arena import ShmArena
from kvstore.transport import tcp as tcp_mod
from kvstore.transport.shm import ShmTransport
from kvstore.transport.tcp import TcpTransport


def test_idle_connections_are_closed_after_their_idle_time_and_capped():
    t = TcpTransport()
    pairs = [socket.socketpair() for _ in range(tcp_mod.MAX_IDLE + 4)]
    for a, _b in pairs:
        t._give_back("d:1", a)
    assert t.idle() == tcp_mod.MAX_IDLE  # the oldest beyond the cap were closed
    assert pairs[0][0].fileno() == -1 and pairs[-1][0].fileno() != -1
    assert t.prune(idle_s=3600) == 0
    assert t.prune(idle_s=0) == tcp_mod.MAX_IDLE and t.idle() == 0
    assert all(a.fileno() == -1 for a, _b in pairs)
    for _a, b in pairs:
        b.close()


def test_mappings_of_removed_or_replaced_segments_are_dropped(tmp_path):
    paths = [str(tmp_path / f"seg{i}") for i in range(3)]
    owners = [ShmArena(p, 1 << 20, create=True) for p in paths]
    t = ShmTransport()
    arenas = [t.arena(p, 1 << 20) for p in paths]
    view = arenas[0].array[:16]  # a read in progress keeps its mapping valid
    assert t.prune() == 0 and t.mapped() == 3
    os.unlink(paths[0])  # a retired daemon's segment
    os.unlink(paths[1])
    owners.append(ShmArena(paths[1], 1 << 20, create=True))  # recreated: another file
    assert t.prune() == 2 and t.mapped() == 1
    assert np.all(view == view)  # still readable
    assert t.arena(paths[1], 1 << 20) is not arenas[1]
    for a in owners:
        a.close()
