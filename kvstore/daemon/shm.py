"""The daemons' shared memory in ``daemon.shm_dir`` (``/dev/shm``): what is there, whether a live
daemon holds it, and removing what none does (``kvstore shm list``, ``kvstore shm clean``).

A daemon keeps in that folder, under its daemon id:

- ``kvstore-<id>-dram``: its DRAM segment (:class:`~kvstore.daemon.arena.ShmArena`), beside it
  ``.stamp`` (the write-stamp key), ``.served`` (the lock that says it serves reads without a
  lease) and ``.owner`` (:func:`write_owner`: the daemon id, its data directory, pid and host);
- ``kvstore-<id>-staging``: its staging region (:mod:`kvstore.daemon.staging`), with an SSD segment.

A daemon stopped on purpose keeps its DRAM segment, so that a restart on the same data
directory reattaches it warm, and says so in its log (:func:`kept`); its staging region goes. One
that died keeps both. The folder is memory: a segment nobody restarts holds its bytes until it is
removed or the host reboots.

Liveness is the daemon's own lock, never a guess from names or pids: a daemon holds an exclusive
``flock`` on each of its regions for as long as it runs, and the kernel drops it the moment the
process dies. A region whose lock can be taken is held by no daemon (stale). ``clean`` takes a
stale region's lock and removes the region and its sidecars while it holds it; a daemon that
starts on the same path meanwhile waits for the lock, then makes a new region (it checks that the
file it locked is still the one at the path). Sidecars whose region is gone are removed under a
placeholder region made and locked for the purpose. Files of another user are listed, never
removed. Regions made by a daemon from before the ``.owner`` record are listed with the daemon id
their name carries and an unknown data directory.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.daemon.arena import SIDECARS

_REGION = re.compile(r"^kvstore-(?P<id>.+)-(?P<kind>dram|staging)$")
HELD, STALE, UNKNOWN = "held", "stale", "unknown"


def region_path(shm_dir: str | os.PathLike, daemon_id: str, kind: str) -> Path:
    """Where a daemon's ``kind`` region ("dram" or "staging") lies."""
    return Path(shm_dir) / f"kvstore-{daemon_id}-{kind}"


def write_owner(dram_path: str, daemon_id: str, data_dir: str | os.PathLike, staging_path: str = "") -> None:
    """Records beside the DRAM segment which daemon made its regions (``<dram>.owner``, JSON,
    mode 0600), for ``kvstore shm list``. Written at every start, after the segment's lock."""
    rec = {
        "daemon_id": daemon_id,
        "data_dir": str(Path(data_dir).resolve()),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": round(time.time(), 3),
        "staging": staging_path,
    }
    fd = os.open(dram_path + ".owner", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)


def _owner(dram_path: str) -> dict:
    try:
        fd = os.open(dram_path + ".owner", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        rec = json.loads(os.read(fd, 1 << 16) or b"{}")
    except ValueError:
        return {}
    finally:
        os.close(fd)
    return rec if isinstance(rec, dict) else {}


@dataclass
class Region:
    """One region of a daemon in the folder, with its sidecars (``files``: those present)."""

    path: str
    kind: str  # dram or staging
    daemon_id: str
    state: str = UNKNOWN  # held (a live daemon holds its lock), stale (none does), unknown
    why: str = ""  # for unknown: why the lock could not be probed; for stale: a region already gone
    size: int = 0  # bytes of the region file
    ram: int = 0  # bytes the files take in memory (allocated pages)
    data_dir: str = ""  # the daemon's, from its .owner record ("" unknown)
    pid: int = 0  # the daemon process that last started on it (its record; liveness is the lock's)
    files: list[str] = field(default_factory=list)


def _probe(path: str) -> tuple[str, str]:
    """Whether a live daemon holds the region's lock: a shared lock is tried without waiting
    (a daemon holds an exclusive one) and let go at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return STALE, "the region is gone; only its sidecars are left"
    except OSError as e:
        return UNKNOWN, e.strerror or str(e)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return HELD, ""
    except OSError as e:
        return UNKNOWN, e.strerror or str(e)
    finally:
        os.close(fd)  # the probe's lock goes with it
    return STALE, ""


def scan(shm_dir: str | os.PathLike) -> list[Region]:
    """Every kvstore region (and sidecars left without one) in ``shm_dir``, probed."""
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    found: dict[str, Region] = {}
    for name in names:
        base = next((name[: -len(s)] for s in SIDECARS if name.endswith(s)), name)
        m = _REGION.match(base)
        if m is None or (base != name and m["kind"] != "dram"):
            continue
        path = os.path.join(str(shm_dir), base)
        r = found.get(path)
        if r is None:
            r = found[path] = Region(path, m["kind"], m["id"])
        full = os.path.join(str(shm_dir), name)
        try:
            st = os.stat(full, follow_symlinks=False)
        except FileNotFoundError:
            continue
        r.files.append(full)
        r.ram += st.st_blocks * 512
        if full == path:
            r.size = st.st_size
    owners = {r.daemon_id: _owner(r.path) for r in found.values() if r.kind == "dram"}
    for r in found.values():
        rec = owners.get(r.daemon_id) or _owner(str(region_path(shm_dir, r.daemon_id, "dram")))
        r.data_dir = str(rec.get("data_dir", ""))
        r.pid = int(rec.get("pid", 0) or 0)
        r.state, r.why = _probe(r.path)
    return list(found.values())


def _remove(r: Region) -> bool:
    """Removes a stale region and its sidecars while holding its lock; False (nothing removed)
    where a daemon holds it or took it meanwhile, or it is another user's."""
    try:
        fd = os.open(r.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        # Sidecars without their region: a placeholder region, locked, keeps a daemon that
        # starts on the path now from making new sidecars before these are gone.
        try:
            fd = os.open(r.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return False
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: a daemon started on it meanwhile
        try:
            if os.stat(r.path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False  # another file at the path now
        except FileNotFoundError:
            return False
        for p in [r.path + s for s in SIDECARS] if r.kind == "dram" else []:
            Path(p).unlink(missing_ok=True)
        os.unlink(r.path)  # last: its lock guards the rest
        return True
    finally:
        os.close(fd)


def clean(shm_dir: str | os.PathLike, dry_run: bool = False) -> tuple[list[Region], list[Region]]:
    """Removes every region no live daemon holds (``dry_run``: none). Returns (removed, or what
    would be; kept)."""
    removed, kept = [], []
    for r in scan(shm_dir):
        if r.state == STALE and (dry_run or _remove(r)):
            removed.append(r)
        else:
            if r.state == STALE:  # a daemon took it meanwhile, or it is not ours
                r.state, r.why = _probe(r.path)
            kept.append(r)
    return removed, kept


def kept(dram_path: str, shm_dir: str) -> str:
    """The log line's words for what a daemon stopped on purpose leaves in ``shm_dir``."""
    files = [dram_path, *(dram_path + s for s in SIDECARS)]
    sizes = {p: os.stat(p).st_blocks * 512 for p in files if os.path.exists(p)}
    return (
        f"files={','.join(sizes)} bytes={sum(sizes.values())} reason=warm_restart_on_the_same_data_dir "
        f"remove_with='kvstore shm clean --shm-dir {shm_dir}'"
    )


# ---- the command ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, common) -> None:  # noqa: ANN001 - cli._common
    """``kvstore shm list|clean`` (``common`` adds --config, --set and the log options)."""
    sub = p.add_subparsers(dest="shm_cmd", required=True)
    for name, text in (
        ("list", "every kvstore region and key file in the folder: size, daemon, data directory, held or stale"),
        ("clean", "remove the regions and key files no live daemon holds"),
    ):
        q = sub.add_parser(name, help=text)
        common(q)
        q.add_argument("--shm-dir", help="the folder (default daemon.shm_dir: /dev/shm)")
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if name == "clean":
            q.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def run(ns: argparse.Namespace, shm_dir: str) -> int:
    from kvstore.tables import fmt_bytes, print_table

    if ns.shm_cmd == "list":
        regions, removed = scan(shm_dir), None
    else:
        removed, regions = clean(shm_dir, dry_run=ns.dry_run)
    if ns.json:
        out: dict = {"shm_dir": shm_dir}
        if removed is not None:
            out["dry_run"] = ns.dry_run
            out["removed"] = [asdict(r) for r in removed]
            out["kept"] = [asdict(r) for r in regions]
        else:
            out["regions"] = [asdict(r) for r in regions]
        print(json.dumps(out, indent=2))
        return 0
    if removed is not None:
        verb = "would remove" if ns.dry_run else "removed"
        for r in removed:
            print(
                f"{verb} {r.path} ({r.kind} of daemon {r.daemon_id}, {fmt_bytes(r.ram)} of memory; {len(r.files)} files)"
            )
        total = sum(r.ram for r in removed)
        print(
            f"{verb} {len(removed)} region(s), {fmt_bytes(total)}; kept {len(regions)} (held by a daemon, or not ours)"
        )
        return 0
    if not regions:
        print(f"no kvstore shared memory in {shm_dir}")
        return 0
    rows = [("state", "kind", "size", "memory", "daemon", "pid", "data dir", "path")]
    for r in regions:
        rows.append(
            (r.state if not r.why or r.state == HELD else f"{r.state} ({r.why})", r.kind, fmt_bytes(r.size),
             fmt_bytes(r.ram), r.daemon_id, str(r.pid or "?") if r.state == HELD else "-", r.data_dir or "?", r.path)
        )  # fmt: skip
    print_table(rows)
    stale = [r for r in regions if r.state == STALE]
    if stale:
        print(
            f"\n{len(stale)} stale ({fmt_bytes(sum(r.ram for r in stale))} of memory, held by no daemon): "
            f"`kvstore shm clean --shm-dir {shm_dir}` removes them"
        )
    return 0
