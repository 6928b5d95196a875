"""Configuration: one dataclass tree, filled from (later wins) defaults, a YAML file,
``KVSTORE_<SECTION>__<KEY>`` environment variables and ``section.key=value`` overrides.

Unknown keys are refused by name. Sizes accept suffixes: ``512MiB``, ``2GiB``, ``1.5GB``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.meta.policy import POLICIES
from kvstore.tls import TlsConfig
from kvstore.tls import validate as validate_tls

ENV_PREFIX = "KVSTORE_"


@dataclass
class MetaConfig:
    listen: str = "127.0.0.1:7100"
    max_batch_keys: int = 16384
    max_block_bytes: int = 1 << 30
    put_timeout_s: float = 30.0
    lease_ttl_s: float = 10.0
    daemon_ttl_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    sweep_interval_s: float = 0.1
    # Lets AdvanceClock skew the service's clock: for tests of deadlines, never in production.
    allow_clock_skew: bool = False
    # Tier moves: demote DRAM to SSD above the high watermark, down to the low one.
    dram_high_watermark: float = 0.9
    dram_low_watermark: float = 0.8
    tier_interval_s: float = 0.05
    # Eviction, demotion order and admission: "adaptive" (recency or frequency, whichever the
    # traffic rewards, see kvstore.meta.policy) or "lru" (recency only, every block stored).
    cache_policy: str = "adaptive"
    # The device tier (kvstore.meta.engines): an engine's reported holdings lapse this long after
    # its last report unless it names another time to live; at most this many engines.
    engine_ttl_s: float = 3.0
    max_engines: int = 1024
    # Engines one tenant may report, and keys one engine's holdings may count.
    max_engines_per_tenant: int = 64
    max_engine_blocks: int = 1 << 20
    # Sign a capability ticket for every placement handed out, so that daemons serve a data-port
    # entry only to whom the service gave it (kvstore.tickets); false: daemons check none.
    data_tickets: bool = True
    # A read ticket's life (at least its lease's): it names one generation of one block, served
    # only while the extent holds exactly that, so a client may read a block it knows again without
    # the service until then (kvstore.client.locations). 0: the lease's end.
    read_ticket_ttl_s: float = 600.0
    # Identities, roles and tenants (kvstore.meta.auth); empty: every caller trusted, one tenant.
    auth_file: str = ""
    # The secret tenant key masks derive from (made on first start); empty: <auth_file>.secret.
    tenant_secret_file: str = ""
    # Bytes one tenant may hold in read leases and in pins (0: no bound), so that no tenant can
    # keep the pool's space from eviction.
    tenant_max_leased_bytes: int = 0
    tenant_max_pinned_bytes: int = 0
    move_batch_bytes: int = 64 << 20
    # Deadline of the service's calls to a daemon inside a client's call (commit, tombstones).
    daemon_rpc_timeout_s: float = 5.0
    # Prometheus /metrics over HTTP: -1 = off, 0 = any free port (printed in the READY line).
    # `kvstore serve` exposes the service's and its daemon's metrics on this one port.
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    # The lookup port (kvstore.meta.lookup_port): plain lookups without gRPC, on the host of
    # meta.listen. -1 = off, 0 = any free port (advertised in lookup answers). It carries no
    # identity, so a service with TLS or tenants never serves it.
    lookup_port: int = 0


@dataclass
class DaemonConfig:
    meta: str = "127.0.0.1:7100"
    # Stable identity across restarts; empty = kept in data_dir/daemon.id.
    daemon_id: str = ""
    # Address to bind and advertise for the data port and the control API.
    host: str = "127.0.0.1"
    data_port: int = 0
    control_port: int = 0
    data_dir: str = "./kvstore-data"
    dram_bytes: int = 1 << 30
    shm_dir: str = "/dev/shm"
    # Equal host ids mean clients can map this daemon's shared memory; empty = auto.
    host_id: str = ""
    # SSD segment: 0 = none. Files go under ssd_dir (default: data_dir/ssd).
    ssd_bytes: int = 0
    ssd_dir: str = ""
    ssd_direct_io: bool = True
    # fast: the OS flushes (survives any process crash); durable: fsync before acknowledging.
    ssd_durability: str = "fast"
    # auto: lz4 (plain or byte-shuffled) per block where a sample shrinks by 20 %; off: never.
    ssd_compress: str = "auto"
    # On start, verify every recovered block's payload checksum (not only its header).
    ssd_verify_on_start: bool = True
    # Shared memory that SSD blocks are read into for same-host clients (kvstore.daemon.staging):
    # this many bytes in all (0: none, SSD reads always stream over the data port), one slice per
    # data-port connection that uses it.
    staging_bytes: int = 64 << 20
    staging_slices: int = 4
    # Prometheus /metrics over HTTP: -1 = off, 0 = any free port (printed in the READY line).
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    # SIGTERM: stop taking puts, leave the index, serve reads already handed out for at most
    # this long (the service tells how long its leases on our blocks still run), then exit.
    drain_timeout_s: float = 15.0
    # Reads without a lease (known locations, frames.DIRECT) are served for this long into a
    # drain (within drain_timeout_s), so that a get whose requests were under way when the drain
    # began completes; later ones are misses and go to the service, which no longer lists us.
    drain_direct_grace_s: float = 1.0
    # A daemon retired for good: after its drain it also removes its DRAM segment from
    # shm_dir (by default the segment stays, so that a restart reattaches it warm).
    remove_segment_on_drain: bool = False
    # Data port bounds, so that no peer can make the daemon hold threads or memory at will:
    # connections served at once (more are closed at accept), seconds a connection may sit
    # idle or stall mid-frame before it is closed (above the client's 30 s idle pruning), and
    # the largest block a frame may carry (checked before anything is allocated).
    data_max_connections: int = 512
    data_idle_timeout_s: float = 300.0
    max_block_bytes: int = 1 << 30
    # Clock difference between hosts tolerated when checking a data-port ticket's expiry.
    ticket_skew_s: float = 30.0
    # Commit a put's DRAM block only over its writer's stamp (kvstore.extent): a commit of an
    # unwritten or half-written extent is refused. False only while same-host clients older
    # than the stamp still write (a rolling upgrade): they do not stamp.
    require_write_stamp: bool = True
    # Bearer token for the metadata service (its identity in meta.auth_file, named as the daemon id).
    token: str = ""
    # With mutual TLS: the certificate common names that may call the control API (commit,
    # move, invalidate, inventory), comma-separated: the metadata service's.
    control_peers: str = "meta"


@dataclass
class ClientConfig:
    meta: str = "127.0.0.1:7100"
    # auto: shared memory for daemons on this host, TCP otherwise; or force "shm" / "tcp".
    transport: str = "auto"
    put_timeout_s: float = 0.0  # 0 = the service's default
    lease_ttl_s: float = 0.0
    rpc_timeout_s: float = 10.0
    io_timeout_s: float = 10.0
    retries: int = 2
    host_id: str = ""
    # Threads that copy (and checksum) one large batch in parallel; 1 = the calling thread only.
    io_threads: int = 2
    # Bearer token for the metadata service (a tenant's or an admin's, see kvstore.meta.auth).
    token: str = ""
    # Block locations remembered for reads without the metadata service (kvstore.client.locations);
    # 0 turns those reads off (every get takes a lease).
    location_cache: int = 65536
    # Ask lookups on the service's lookup port when it offers one (kvstore.meta.lookup_port),
    # from the synchronous client's calling thread; false: always over gRPC.
    lookup_port: bool = True
    # How long reads from known locations gather before the client tells the service about them
    # in one Touch: its cache policy sees them, and its hit counters count them, this much later.
    touch_interval_s: float = 0.05


@dataclass
class ClusterConfig:
    # Redis that coordinates a sharded cluster (kvstore.cluster): redis://host:port[/db], or
    # sentinel://host:port[,host:port...]/<master>[/db] with Sentinel. Empty: no cluster; one
    # metadata service at meta.listen (daemon.meta, client.meta), and no Redis is needed.
    redis: str = ""
    # The cluster's name: the prefix of its keys in Redis (several clusters may share one Redis).
    name: str = "kvstore"
    # Metadata shards: fixed when the cluster is first made (the slot map in Redis).
    shards: int = 1
    # The shard this metadata process serves (`kvstore meta`); two processes per shard make a
    # primary and a standby.
    shard: int = 0
    # Address that daemons and clients reach this metadata process at (default meta.listen).
    advertise: str = ""
    # The leader lease: a leader renews it every third of this; a standby takes over when it
    # runs out (a dead leader costs this plus a daemon heartbeat to notice).
    leader_ttl_s: float = 2.0
    # How often a standby tries to take the lease.
    standby_poll_s: float = 0.2


@dataclass
class LogConfig:
    level: str = "info"
    # text: "time LEVEL logger event=... key=value"; json: one JSON object per line, the
    # key=value pairs as fields (plus rpc, request and put/lease ids where there are).
    format: str = "text"


@dataclass
class Config:
    meta: MetaConfig = field(default_factory=MetaConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # Mutual TLS for every server and connection of this process (kvstore.tls).
    tls: TlsConfig = field(default_factory=TlsConfig)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "mi": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "gi": 1 << 30,
          "t": 10**12, "tb": 10**12, "tib": 1 << 40, "ti": 1 << 40}  # fmt: skip


def parse_size(value: Any, what: str = "size") -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"{what}: a size must not be negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise InvalidArgument(f"{what}: cannot read {value!r} as a size (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _coerce(value: Any, typ: str, what: str) -> Any:
    if isinstance(value, (list, dict, tuple, set)) or value is None:
        raise InvalidArgument(f"{what}: expected {typ}, got {value!r}")
    if typ in ("int", "float") and isinstance(value, bool):
        raise InvalidArgument(f"{what}: expected {typ}, got {value!r}")
    try:
        if typ == "int":
            if what.endswith("_bytes"):
                return parse_size(value, what)
            if isinstance(value, float):
                if not value.is_integer():
                    raise InvalidArgument(f"{what}: expected int, got {value!r}")
                return int(value)
            return int(str(value).strip())
        if typ == "float":
            return float(value)
        if typ == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return str(value)
    except InvalidArgument:
        raise
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what}: expected {typ}, got {value!r}") from None


def _apply(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise InvalidArgument(f"{source}: unknown config section {section!r} (known: {', '.join(sections)})")
    sub = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if key not in fields:
        raise InvalidArgument(f"{source}: unknown config key {section}.{key} (known: {', '.join(fields)})")
    typ = fields[key].type if isinstance(fields[key].type, str) else fields[key].type.__name__
    setattr(sub, key, _coerce(value, typ, f"{section}.{key}"))


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Builds the configuration. Raises InvalidArgument naming any unknown or malformed key."""
    cfg = Config()
    env = os.environ if env is None else env
    path = path or env.get(ENV_PREFIX + "CONFIG") or None
    if path:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise InvalidArgument(f"config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise InvalidArgument(f"config file {path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise InvalidArgument(f"config file {path}: expected a mapping of sections")
        for section, values in data.items():
            if not isinstance(values, dict):
                raise InvalidArgument(f"config file {path}: section {section!r} must be a mapping")
            for key, value in values.items():
                _apply(cfg, str(section), str(key), value, f"config file {path}")
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
            _apply(cfg, section, key, value, f"environment {name}")
    for item in overrides:
        name, sep, value = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot:
            raise InvalidArgument(f"override {item!r}: expected section.key=value")
        _apply(cfg, section, key, value, f"override {item!r}")
    validate(cfg)
    return cfg


def client_settings(**overrides: Any) -> tuple[ClientConfig, TlsConfig]:
    """The client and TLS settings of this process's environment (``KVSTORE_CONFIG`` and
    ``KVSTORE_CLIENT__*`` / ``KVSTORE_TLS__*`` variables: a token, certificates), with
    ``overrides`` of client fields on top: how processes that take only a store address (the
    engine's workers and router) still talk to a secured cluster."""
    cfg = load_config()
    for k, v in overrides.items():
        setattr(cfg.client, k, v)
    return cfg.client, cfg.tls


def validate(cfg: Config) -> None:
    """Checks ranges and relations between keys. Raises InvalidArgument naming the key."""
    validate_tls(cfg.tls)

    def positive(section: str, key: str, allow_zero: bool = False) -> None:
        v = getattr(getattr(cfg, section), key)
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidArgument(f"{section}.{key}: must be a finite number, got {v}")
        if v < 0 or (v == 0 and not allow_zero):
            raise InvalidArgument(f"{section}.{key}: must be {'>= 0' if allow_zero else 'positive'}, got {v}")

    def one_of(section: str, key: str, choices: tuple[str, ...]) -> None:
        v = getattr(getattr(cfg, section), key)
        if v not in choices:
            raise InvalidArgument(f"{section}.{key}: must be one of {', '.join(choices)}, got {v!r}")

    m, d = cfg.meta, cfg.daemon
    for key in ("max_batch_keys", "max_block_bytes", "put_timeout_s", "lease_ttl_s", "daemon_ttl_s",
                "heartbeat_interval_s", "sweep_interval_s", "tier_interval_s", "move_batch_bytes",
                "daemon_rpc_timeout_s", "engine_ttl_s", "max_engines", "max_engines_per_tenant",
                "max_engine_blocks"):  # fmt: skip
        positive("meta", key)
    if m.engine_ttl_s > 60:
        raise InvalidArgument(f"meta.engine_ttl_s: at most 60 s, got {m.engine_ttl_s}")
    if m.heartbeat_interval_s >= m.daemon_ttl_s:
        raise InvalidArgument(
            f"meta.heartbeat_interval_s ({m.heartbeat_interval_s}) must be below meta.daemon_ttl_s "
            f"({m.daemon_ttl_s}): a daemon must heartbeat before its lease lapses"
        )
    for key in ("dram_high_watermark", "dram_low_watermark"):
        v = getattr(m, key)
        if not (math.isfinite(v) and 0 <= v <= 1):
            raise InvalidArgument(f"meta.{key}: must be a fraction in [0, 1], got {v}")
    one_of("meta", "cache_policy", tuple(POLICIES))
    for key in ("tenant_max_leased_bytes", "tenant_max_pinned_bytes", "read_ticket_ttl_s"):
        positive("meta", key, allow_zero=True)
    if m.dram_low_watermark >= m.dram_high_watermark:
        raise InvalidArgument(
            f"meta.dram_low_watermark ({m.dram_low_watermark}) must be below meta.dram_high_watermark "
            f"({m.dram_high_watermark})"
        )
    positive("daemon", "dram_bytes")
    # The service reuses a freed extent only twice tickets.SKEW_S past its put's deadline (the
    # skew the daemon allows on its own clock, and as much again for that clock being behind).
    from kvstore.tickets import SKEW_S

    if not 0 <= cfg.daemon.ticket_skew_s <= SKEW_S:
        raise InvalidArgument(
            f"daemon.ticket_skew_s: must be between 0 and {SKEW_S} (the metadata service holds freed extents "
            f"for twice that past a put's deadline), got {cfg.daemon.ticket_skew_s}"
        )
    for key in ("data_max_connections", "data_idle_timeout_s", "max_block_bytes"):
        positive("daemon", key)
    positive("daemon", "ssd_bytes", allow_zero=True)
    positive("daemon", "staging_bytes", allow_zero=True)
    positive("daemon", "staging_slices", allow_zero=True)
    for key in ("data_port", "control_port"):
        v = getattr(d, key)
        if not 0 <= v <= 65535:
            raise InvalidArgument(f"daemon.{key}: must be a port number in [0, 65535], got {v}")
    if not -1 <= m.lookup_port <= 65535:
        raise InvalidArgument(f"meta.lookup_port: must be -1 (off), 0 (any) or a port number, got {m.lookup_port}")
    if m.lookup_port > 0 and (cfg.tls.enabled or m.auth_file):
        raise InvalidArgument(
            "meta.lookup_port: the lookup port carries no identity and is never served with TLS or tenants; set -1"
        )
    for section in ("meta", "daemon"):
        v = getattr(cfg, section).metrics_port
        if not -1 <= v <= 65535:
            raise InvalidArgument(f"{section}.metrics_port: must be -1 (off), 0 (any) or a port number, got {v}")
    positive("daemon", "drain_timeout_s", allow_zero=True)
    positive("daemon", "drain_direct_grace_s", allow_zero=True)
    one_of("daemon", "ssd_durability", ("fast", "durable"))
    one_of("daemon", "ssd_compress", ("auto", "off"))
    one_of("client", "transport", ("auto", "shm", "tcp"))
    for key in ("put_timeout_s", "lease_ttl_s", "retries", "location_cache", "touch_interval_s"):
        positive("client", key, allow_zero=True)
    for key in ("rpc_timeout_s", "io_timeout_s", "io_threads"):
        positive("client", key)
    one_of("log", "level", ("debug", "info", "warning", "error", "critical"))
    one_of("log", "format", ("text", "json"))
    c = cfg.cluster
    for key in ("leader_ttl_s", "standby_poll_s"):
        positive("cluster", key)
    if not 1 <= c.shards <= 256:
        raise InvalidArgument(f"cluster.shards: must be between 1 and 256, got {c.shards}")
    if not 0 <= c.shard < c.shards:
        raise InvalidArgument(f"cluster.shard: must be in [0, cluster.shards={c.shards}), got {c.shard}")
    if c.redis:
        from kvstore.cluster.coord import parse_url

        parse_url(c.redis)


def default_host_id() -> str:
    """Identifies this host for the shared-memory path: hostname plus kernel boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
