"""Same-host shared memory is the daemon's user's alone: the segment file is mode 0600, made
never through a symbolic link, and a client maps only a file its own user owns; a client that
may not map a segment reads and writes through the data port instead of failing."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.daemon.arena import ShmArena
from kvstore.transport.shm import ShmTransport

KS = KeySpace(ModelFingerprint("shm-access", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(64))
DATA = [np.full(5000, 60 + i, np.uint8) for i in range(len(KEYS))]
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")


def test_the_segment_is_private_and_never_a_link(tmp_path):
    path = tmp_path / "seg"
    a = ShmArena(path, 1 << 20, create=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    a.close()
    os.chmod(path, 0o666)  # widened by someone: narrowed again at the next start
    ShmArena(path, 1 << 20, create=True).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    link = tmp_path / "link"
    link.symlink_to(path)
    for create in (True, False):
        with pytest.raises(OSError):
            ShmArena(link, 1 << 20, create=create)
    t = ShmTransport()
    assert not t.usable(str(link), 1 << 20) and t.usable(str(path), 1 << 20)


@ROOT
def test_a_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "seg"
    ShmArena(path, 1 << 20, create=True).close()
    os.chown(path, 54321, 54321)
    for create in (True, False):
        with pytest.raises(PermissionError, match="owned by uid 54321"):
            ShmArena(path, 1 << 20, create=create)
    assert not ShmTransport().usable(str(path), 1 << 20)


@ROOT
def test_a_client_that_may_not_map_the_segment_uses_the_data_port(store):
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.put(KEYS, DATA).stored == len(KEYS)
        shm_path = c.stats().daemons[0].info.segments[0].shm_path
    os.chown(shm_path, 54321, 54321)  # the daemon keeps its mapping; new clients may not map it
    try:
        with SyncKVStoreClient(store.meta_addr) as c:
            out = [np.zeros(5000, np.uint8) for _ in KEYS]
            assert c.get_into(KEYS, out) == len(KEYS)
            assert all(np.array_equal(a, b) for a, b in zip(out, DATA))
            more = KS.block_keys(np.arange(1000, 1064))
            assert c.put(more, DATA).stored == len(more)
            assert c._client._shm.mapped() == 0  # nothing was mapped: all through the data port
    finally:
        os.chown(shm_path, os.geteuid(), os.getegid())
