"""kvstore.daemon.shm in one process: a segment whose lock is held is never removed, one whose
lock is free is; sidecars left without their segment go too; other files are left alone; a
segment from before the owner record is listed by the id its name carries; and a daemon that
starts on a path while clean removes the segment there gets a new segment, not the removed one."""

from __future__ import annotations

import fcntl
import os
import threading

from kvstore.daemon.arena import ShmArena
from kvstore.daemon.shm import HELD, STALE, clean, scan, write_owner
from tests.conftest import wait_until

MIB = 1 << 20


def _opened(path) -> int:  # noqa: ANN001
    """Descriptors of this process open on ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            pass
    return n


def test_held_is_kept_and_stale_removed(tmp_path):
    a = ShmArena(tmp_path / "kvstore-a-dram", MIB, create=True)
    write_owner(a.path, "a", tmp_path / "data-a")
    b = ShmArena(tmp_path / "kvstore-b-dram", MIB, create=True)
    b.close()  # b's daemon is gone: its files stay, its lock went with it
    (tmp_path / "kvstore-bench-scan-1").write_bytes(b"x")  # not a daemon's
    (tmp_path / "other").write_bytes(b"x")
    try:
        found = {r.daemon_id: r for r in scan(tmp_path)}
        assert found.keys() == {"a", "b"}
        assert found["a"].state == HELD and found["a"].data_dir == str((tmp_path / "data-a").resolve())
        assert found["b"].state == STALE and found["b"].data_dir == ""  # no owner record: unknown
        assert found["a"].size == MIB and found["a"].pid == os.getpid()

        removed, kept = clean(tmp_path, dry_run=True)
        assert [r.daemon_id for r in removed] == ["b"] and os.path.exists(b.path)
        removed, kept = clean(tmp_path)
        assert [r.daemon_id for r in removed] == ["b"] and [r.daemon_id for r in kept] == ["a"]
        assert sorted(os.listdir(tmp_path)) == [
            "kvstore-a-dram", "kvstore-a-dram.owner", "kvstore-a-dram.stamp", "kvstore-bench-scan-1", "other",
        ]  # fmt: skip
        a.view[:4] = b"live"  # the held segment is untouched and in use
    finally:
        a.close()
    assert [r.daemon_id for r in clean(tmp_path)[0]] == ["a"]
    assert sorted(os.listdir(tmp_path)) == ["kvstore-bench-scan-1", "other"]


def test_sidecars_without_their_segment_are_removed(tmp_path):
    (tmp_path / "kvstore-gone-dram.stamp").write_bytes(os.urandom(32))
    (tmp_path / "kvstore-gone-dram.served").write_bytes(b"")
    (found,) = scan(tmp_path)
    assert found.state == STALE and "gone" in found.why and len(found.files) == 2
    assert [r.daemon_id for r in clean(tmp_path)[0]] == ["gone"]
    assert os.listdir(tmp_path) == []


def test_a_staging_region_is_listed_with_its_daemons_record(tmp_path):
    dram = ShmArena(tmp_path / "kvstore-s-dram", MIB, create=True)
    staging = ShmArena(tmp_path / "kvstore-s-staging", MIB, create=True, stamps=False)
    write_owner(dram.path, "s", tmp_path / "data-s", staging.path)
    try:
        found = {r.kind: r for r in scan(tmp_path)}
        assert found["staging"].state == HELD and found["staging"].data_dir == str((tmp_path / "data-s").resolve())
        assert found["staging"].files == [staging.path]
    finally:
        staging.close()
    assert [r.kind for r in clean(tmp_path)[0]] == ["staging"]
    dram.close()


def test_a_daemon_starting_while_clean_removes_its_segment_makes_a_new_one(tmp_path):
    path = tmp_path / "kvstore-race-dram"
    ShmArena(path, MIB, create=True).close()
    # What clean does: the stale segment's lock taken, the files removed, the lock let go.
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    got: list = []
    t = threading.Thread(target=lambda: got.append(ShmArena(path, MIB, create=True)))
    t.start()
    wait_until(lambda: _opened(path) == 2)  # the thread has the old file open, and waits for its lock
    os.unlink(path)
    os.close(fd)
    t.join(10)
    (arena,) = got
    try:
        assert os.stat(path).st_ino == arena.inode  # the file at the path, not the removed one
    finally:
        arena.close()
