"""Prometheus metrics of the metadata service and the cache daemon (``prometheus-client``).

Each server owns a :class:`~prometheus_client.CollectorRegistry` (``kvstore serve`` shares one
between its service and its daemon) and serves it over HTTP (:class:`MetricsHttp`):

- per-RPC latency histograms and error counts by status code, recorded by
  :mod:`kvstore.rpc` for every method of every server (:func:`rpc_metrics`);
- everything else is read at scrape time from the counters and state the servers keep anyway
  (:class:`MetaCollector`, :class:`DaemonCollector`), so that the request paths pay nothing
  for it. A scrape runs on the HTTP server's thread: it copies dicts (atomic under the GIL)
  before it walks them.

Labels are bounded: service, method, code, tier, daemon, segment, transport; never a key or a
request id.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from kvstore.meta.duel import MODES

if TYPE_CHECKING:
    from kvstore.daemon.server import CacheDaemon
    from kvstore.meta.api import IndexApi

# 50 us .. 10 s: a local lookup is ~0.1 ms, a put of a big batch or a tier move seconds.
RPC_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0, 10.0)  # fmt: skip

_TIER_NAMES = {1: "dram", 2: "ssd", 3: "gpu"}


class RpcMetrics:
    """Latency and errors of every RPC a server answers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "kvstore_rpc_duration_seconds",
            "Time to answer an RPC, by service and method (every outcome)",
            ["service", "method"],
            registry=registry,
            buckets=RPC_BUCKETS,
        )
        self.errors = Counter(
            "kvstore_rpc_errors_total",
            "RPCs answered with a status other than OK, by service, method and status code",
            ["service", "method", "code"],
            registry=registry,
        )

    def method(self, service: str, method: str) -> tuple[Any, Any]:
        """The (histogram child, errors-by-code function) of one method, bound once."""
        child = self.duration.labels(service, method)
        errors = self.errors

        def error(code: str) -> None:
            errors.labels(service, method, code).inc()

        return child, error


_rpc_lock = threading.Lock()


def rpc_metrics(registry: CollectorRegistry) -> RpcMetrics:
    """The registry's one :class:`RpcMetrics` (servers sharing a registry share it)."""
    with _rpc_lock:
        m = getattr(registry, "_kvstore_rpc", None)
        if m is None:
            m = RpcMetrics(registry)
            registry._kvstore_rpc = m  # type: ignore[attr-defined]
        return m


class MetricsHttp:
    """``GET /metrics`` for one registry, on its own thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: Any = None
        self.port = 0

    def start(self, host: str, port: int) -> int:
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    if labels:
        fam = CounterMetricFamily(name, doc, labels=list(labels))
        fam.add_metric(list(labels.values()), value)
        return fam
    return CounterMetricFamily(name, doc, value=value)


def _counters(prefix: str, docs: tuple[tuple[str, str], ...], values: dict, labels: dict[str, str]) -> Iterator[Metric]:
    """``prefix<name>_total`` for each (name, help) of ``docs``, valued from ``values``."""
    for name, doc in docs:
        yield _counter(f"{prefix}{name}_total", doc, values.get(name, 0), labels)


# A daemon's own counters (CacheDaemon.counters), exported as kvstore_daemon_<name>_total.
DAEMON_COUNTERS = (
    ("registrations", "Registrations with the metadata service (each with a full inventory)"),
    (
        "stale_epoch_refused",
        "Control calls refused because they came from a metadata shard's former leader (older epoch)",
    ),
    (
        "stale_registration_refused",
        "Control calls refused because they were made for an earlier registration of this daemon",
    ),
    ("heartbeat_failures", "Heartbeats that failed (service unreachable or an error)"),
    ("commits", "Blocks committed at the service's request"),
    ("invalidations", "Blocks dropped at the service's request"),
    ("moves", "Tier moves carried out"),
    ("moves_failed", "Tier moves that failed their checks"),
)
_SSD_COUNTERS = (
    ("reads", "SSD blocks read"),
    ("read_bytes", "SSD payload bytes read"),
    ("writes", "SSD blocks written"),
    ("write_bytes", "SSD payload bytes written (before compression)"),
    ("stored_bytes", "SSD bytes stored (after compression)"),
    ("compressed", "SSD blocks stored compressed"),
    ("checksum_failures", "SSD blocks that failed their checksum on read"),
    ("journal_full", "SSD journal appends refused (journal full)"),
)


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


# Index counters exported one to one: name in Index.counters -> (metric name, help).
_META_COUNTERS = {
    "lookups": ("kvstore_meta_lookups_total", "Lookup calls"),
    "lookup_keys": ("kvstore_meta_lookup_keys_total", "Keys asked by lookups"),
    "lookup_hit_keys": ("kvstore_meta_lookup_hit_keys_total", "Keys of lookups that were in the leading cached run"),
    "acquires": ("kvstore_meta_acquires_total", "Acquire (get) calls"),
    "hit_bytes": (
        "kvstore_meta_hit_bytes_total",
        "Bytes of blocks gets loaded: under a lease (Acquire) and from known locations (Touch)",
    ),
    "puts": ("kvstore_meta_puts_total", "PutStart calls"),
    "put_keys": ("kvstore_meta_put_keys_total", "Blocks committed by puts"),
    "put_bytes": ("kvstore_meta_put_bytes_total", "Bytes committed by puts"),
    "put_ssd_keys": ("kvstore_meta_put_ssd_keys_total", "Blocks put straight to SSD (DRAM had no room)"),
    "dedup_keys": ("kvstore_meta_dedup_keys_total", "Put keys skipped because they were stored or in flight"),
    "no_space_keys": ("kvstore_meta_no_space_keys_total", "Put keys refused for lack of evictable space"),
    "not_admitted_keys": (
        "kvstore_meta_not_admitted_keys_total",
        "Put keys the cache policy did not store (colder than what they would evict)",
    ),
    "touches": ("kvstore_meta_touches_total", "Chains that clients read from locations they held (Touch)"),
    "touched_keys": (
        "kvstore_meta_touched_keys_total",
        "Stored keys that clients read from locations they held, without a lease (Touch)",
    ),
    "commit_failed_keys": ("kvstore_meta_commit_failed_keys_total", "Put keys whose daemon did not commit them"),
    "evictions": ("kvstore_meta_evictions_total", "Blocks evicted (their last copy dropped for space)"),
    "evicted_bytes": ("kvstore_meta_evicted_bytes_total", "Bytes of evicted blocks"),
    "dropped_clean": ("kvstore_meta_dropped_clean_total", "DRAM copies dropped because an SSD copy exists"),
    "demoted": ("kvstore_meta_demotions_total", "Blocks demoted DRAM -> SSD"),
    "demoted_bytes": ("kvstore_meta_demoted_bytes_total", "Bytes demoted DRAM -> SSD"),
    "promoted": ("kvstore_meta_promotions_total", "Blocks promoted SSD -> DRAM"),
    "promoted_bytes": ("kvstore_meta_promoted_bytes_total", "Bytes promoted SSD -> DRAM"),
    "moves_failed": ("kvstore_meta_moves_failed_total", "Tier moves that failed"),
    "corrupt_reported": ("kvstore_meta_checksum_failures_total", "Blocks reported corrupt by readers (dropped)"),
    "removed": ("kvstore_meta_removed_total", "Blocks removed by Remove"),
    "daemons_lost": ("kvstore_meta_daemons_lost_total", "Daemons dropped because their lease lapsed"),
    "daemons_drained": ("kvstore_meta_daemons_drained_total", "Daemons that left through a drain"),
    "expired_puts": ("kvstore_meta_expired_puts_total", "Put reservations that passed their deadline"),
    "expired_leases": ("kvstore_meta_expired_leases_total", "Read leases that passed their deadline"),
    "tombstones": ("kvstore_meta_tombstones_total", "Committed blocks dropped that daemons must forget"),
    "tombstones_dropped": ("kvstore_meta_tombstones_dropped_total", "Tombstones dropped over the bound"),
    "stall_grace": (
        "kvstore_meta_stall_grace_total",
        "Sweeps that woke late and did not count the lag against daemons",
    ),
}


class MetaCollector:
    """The metadata service's state and counters, read at scrape time."""

    def __init__(self, index: IndexApi) -> None:
        self.index = index

    def collect(self) -> Iterator[Metric]:
        idx = self.index
        c = dict(idx.counters)
        for name, (metric, doc) in _META_COUNTERS.items():
            yield _counter(metric, doc, c.get(name, 0))
        hits = CounterMetricFamily(
            "kvstore_meta_hits_total",
            "Blocks gets loaded, by tier read: under a lease (Acquire) and from known locations (Touch, "
            "counted up to kvstore_meta_touch_interval_seconds late)",
            labels=["tier"],
        )
        ssd = c.get("ssd_hit_keys", 0)
        hits.add_metric(["dram"], c.get("hit_keys", 0) - ssd)
        hits.add_metric(["ssd"], ssd)
        yield hits
        yield _counter("kvstore_meta_misses_total", "Keys gets asked for that were not loaded", c.get("miss_keys", 0))
        yield GaugeMetricFamily(
            "kvstore_meta_touch_interval_seconds",
            "How late reads from known locations reach the hit counters: the longest touch interval "
            "clients reported in the last minute (0: none reported)",
            value=idx.touch_interval_s,
        )
        yield GaugeMetricFamily("kvstore_meta_keys", "Blocks in the index", value=len(idx))
        pol = idx.policy.stats()
        yield GaugeMetricFamily(
            "kvstore_meta_policy_frequency_mode",
            f"1 while the {idx.policy.name} cache policy evicts and admits by frequency, 0 by recency",
            value=pol.get("policy_frequency_mode", 0),
        )
        yield GaugeMetricFamily(
            "kvstore_meta_policy_second_chance_mode",
            f"1 while the {idx.policy.name} cache policy evicts by recency with a second chance for blocks read again",
            value=pol.get("policy_second_chance_mode", 0),
        )
        yield _counter(
            "kvstore_meta_policy_mode_switches_total",
            "Times the adaptive cache policy changed mode",
            pol.get("policy_mode_switches", 0),
        )
        cal = GaugeMetricFamily(
            "kvstore_meta_policy_calibration",
            "Prefix hits the index earned per hit of the mode's shadow cache while in that mode (1: the shadow "
            "predicts the index; the adaptive policy weighs each shadow by it)",
            labels=["mode"],
        )
        for mode in MODES:
            cal.add_metric([mode], pol.get(f"policy_{mode}_calibration_permille", 1000) / 1000)
        yield cal
        yield GaugeMetricFamily(
            "kvstore_meta_puts_outstanding", "Put reservations not yet committed", value=len(idx.puts)
        )
        yield GaugeMetricFamily("kvstore_meta_leases_outstanding", "Read leases held", value=len(idx.leases))
        yield GaugeMetricFamily("kvstore_meta_moves_in_flight", "Tier moves handed to daemons", value=len(idx.moves))
        pending = sum(len(v) for v in list(idx.tombstones.values()))
        yield GaugeMetricFamily(
            "kvstore_meta_tombstones_pending", "Tombstones not yet applied by daemons", value=pending
        )
        now = idx.clock.now()
        up = GaugeMetricFamily(
            "kvstore_meta_daemon_up", "1 while the daemon's lease is current", labels=["daemon", "host"]
        )
        age = GaugeMetricFamily(
            "kvstore_meta_daemon_heartbeat_age_seconds", "Seconds since the daemon's last heartbeat", labels=["daemon"]
        )
        seg_lbl = ["daemon", "segment", "tier"]
        cap = GaugeMetricFamily("kvstore_meta_segment_capacity_bytes", "Segment capacity", labels=seg_lbl)
        used = GaugeMetricFamily("kvstore_meta_segment_used_bytes", "Segment bytes allocated", labels=seg_lbl)
        blocks = GaugeMetricFamily("kvstore_meta_segment_blocks", "Blocks held by the segment", labels=seg_lbl)
        leased = GaugeMetricFamily("kvstore_meta_segment_leased_blocks", "Blocks leased or moving", labels=seg_lbl)
        pinned = GaugeMetricFamily("kvstore_meta_segment_pinned_blocks", "Pinned blocks", labels=seg_lbl)
        held = GaugeMetricFamily(
            "kvstore_meta_segment_held_bytes",
            "Bytes of unfinished puts held back until their write tickets lapse (counted in used bytes)",
            labels=seg_lbl,
        )
        for d in list(idx.daemons.values()):
            did = d.spec.daemon_id
            up.add_metric([did, d.spec.host_id], 1.0 if d.deadline >= now else 0.0)
            age.add_metric([did], max(0.0, now - d.last_heartbeat))
            for seg in list(d.segments.values()):
                lv = [did, str(seg.spec.segment_id), _TIER_NAMES.get(int(seg.spec.tier), "?")]
                cap.add_metric(lv, seg.alloc.capacity)
                used.add_metric(lv, seg.alloc.used)
                blocks.add_metric(lv, seg.blocks)
                leased.add_metric(lv, seg.leased)
                pinned.add_metric(lv, seg.pinned)
                held.add_metric(lv, seg.quarantined)
        yield from (up, age, cap, used, blocks, leased, pinned, held)


class DaemonCollector:
    """One cache daemon's counters and state, read at scrape time."""

    def __init__(self, daemon: CacheDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        lbl = {"daemon": d.daemon_id}
        yield _gauge(
            "kvstore_daemon_registered",
            "1 while the metadata service knows this daemon and hears its heartbeats (its readiness), 0 while not",
            1.0 if d.health.serving else 0.0,
            lbl,
        )
        yield from _counters("kvstore_daemon_", DAEMON_COUNTERS, dict(d.counters), lbl)
        dp = dict(d.dataport.counters)
        by = CounterMetricFamily(
            "kvstore_daemon_bytes_total", "Payload bytes the daemon moved, by transport and direction",
            labels=["daemon", "transport", "direction"],
        )  # fmt: skip
        by.add_metric([d.daemon_id, "tcp", "read"], dp.get("read_bytes", 0))
        by.add_metric([d.daemon_id, "tcp", "write"], dp.get("write_bytes", 0))
        by.add_metric([d.daemon_id, "staged", "read"], dp.get("staged_bytes", 0))
        blocks = CounterMetricFamily(
            "kvstore_daemon_blocks_total", "Blocks the daemon served or took, by transport and direction",
            labels=["daemon", "transport", "direction"],
        )  # fmt: skip
        blocks.add_metric([d.daemon_id, "tcp", "read"], dp.get("reads", 0))
        blocks.add_metric([d.daemon_id, "tcp", "write"], dp.get("writes", 0))
        blocks.add_metric([d.daemon_id, "staged", "read"], dp.get("staged", 0))
        yield by
        yield blocks
        yield _counter(
            "kvstore_daemon_bad_frames_total", "Data-port frames refused as malformed", dp.get("bad_frames", 0), lbl
        )
        yield _gauge("kvstore_daemon_dataport_connections", "Open data-port connections", d.dataport.connections, lbl)
        yield _counter(
            "kvstore_daemon_dataport_refused_connections_total",
            "Data-port connections closed at accept: daemon.data_max_connections were open",
            dp.get("refused_connections", 0),
            lbl,
        )
        yield _counter(
            "kvstore_daemon_dataport_read_ahead_requests_total",
            "Staged READ requests whose SSD reads began while the request before them was served",
            dp.get("read_ahead_requests", 0),
            lbl,
        )
        yield _counter(
            "kvstore_daemon_dataport_idle_closed_total",
            "Data-port connections closed after daemon.data_idle_timeout_s idle or stalled",
            dp.get("idle_closed", 0),
            lbl,
        )
        seg = GaugeMetricFamily("kvstore_daemon_segment_bytes", "Segment size", labels=["daemon", "tier"])
        seg.add_metric([d.daemon_id, "dram"], d.dram.size)
        if d.ssd is not None:
            s = d.ssd
            seg.add_metric([d.daemon_id, "ssd"], s.size)
            sc = dict(s.counters)
            yield from _counters("kvstore_daemon_ssd_", _SSD_COUNTERS, sc, lbl)
            yield _gauge("kvstore_daemon_ssd_journal_bytes", "Size of the SSD journal", s.journal_bytes, lbl)
            yield _gauge(
                "kvstore_daemon_ssd_recovered_blocks",
                "Blocks recovered from the SSD journal at start",
                sc.get("recovered", 0),
                lbl,
            )
        yield seg
        yield _gauge(
            "kvstore_daemon_recovery_seconds",
            "Seconds the start-up recovery (journal replay, checks) took",
            d.recovery_seconds,
            lbl,
        )
