"""The report of bench/peers.py: kvstore's advantage over each peer, the sentences that say where
kvstore is behind, the plot, the "peers" section of bench/RESULTS.md, and writing them all
(:func:`write`) with the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.peers_harness import KVSTORE, PEERS

# (metric, label, unit, higher is better)
METRICS = (
    ("put_gbps", "put", "GB/s", True),
    ("get_gbps", "get", "GB/s", True),
    ("get_p50_ms", "get p50", "ms", False),
    ("get_p99_ms", "get p99", "ms", False),
)
LABELS = {
    "kvstore-shm": "kvstore shm",
    "kvstore-tcp": "kvstore tcp",
    "kvstore-tls": "kvstore tcp+mTLS",
    "redis": "Redis",
    "mooncake": "Mooncake",
}
# Targets (field: kvstore system, metric, peer, size, target, "<=" or ">="): ratios kvstore / peer.
TARGETS = {
    "get_p50_64k_over_redis": ("kvstore-shm", "get_p50_ms", "redis", "64KiB", 1.0, "<="),
    "get_p50_64k_tcp_over_mooncake": ("kvstore-tcp", "get_p50_ms", "mooncake", "64KiB", 1.5, "<="),
    "lookup_1caller_over_redis": ("kvstore-shm", "keys_per_s", "redis", "", 1.0, ">="),
    # kvstore over mutual TLS against the same over plain TCP (tickets on in both).
    "tls_get_2m_over_plain": ("kvstore-tls", "get_gbps", "kvstore-tcp", "2MiB", 0.7, ">="),
}


def targets(r: dict) -> dict[str, float]:
    """The target ratios of this run (kvstore / peer), for the peers measured."""
    out = {}
    for field, (kv, metric, peer, size, _t, _op) in TARGETS.items():
        if size:
            s = r["sizes"].get(size, {}).get("systems", {})
            a, b = s.get(kv, {}).get(metric), s.get(peer, {}).get(metric)
        else:
            a, b = r["lookup"].get(kv, {}).get(metric), r["lookup"].get(peer, {}).get(metric)
        if a and b:
            out[field] = round(a / b, 3)
    return out


def compare(r: dict) -> list[dict]:
    """kvstore (each path) against each peer, per metric and size. ``advantage`` > 1 means
    kvstore is better (higher throughput, lower latency)."""
    rows = []

    def add(kv: str, peer: str, metric: str, size: str, a: float, b: float, higher: bool) -> None:
        if a <= 0 or b <= 0:
            return
        rows.append({"kvstore": kv, "peer": peer, "metric": metric, "size": size, "kvstore_value": a,
                     "peer_value": b, "advantage": round(a / b if higher else b / a, 3)})  # fmt: skip

    for kv in KVSTORE:
        for peer in PEERS:
            for size, s in r["sizes"].items():
                a, b = s["systems"].get(kv), s["systems"].get(peer)
                if a and b:
                    for metric, _, _, higher in METRICS:
                        add(kv, peer, metric, size, a[metric], b[metric], higher)
            a, b = r["lookup"].get(kv), r["lookup"].get(peer)
            if a and b:
                add(kv, peer, "lookup_keys_per_s", "1000 keys", a["keys_per_s"], b["keys_per_s"], True)
    return rows


def _fmt(v: float, unit: str) -> str:
    if unit == "keys/s":
        return f"{v / 1e6:.2f} M keys/s" if v >= 1e6 else f"{v / 1e3:.0f} k keys/s"
    return f"{v:.2f} {unit}" if unit == "GB/s" else f"{v:.3g} {unit}"


def losses(r: dict) -> list[str]:
    """One sentence per (kvstore path, peer) naming every metric where kvstore is behind, and by
    how much."""
    units = {m: (label, unit) for m, label, unit, _ in METRICS}
    units["lookup_keys_per_s"] = ("lookups", "keys/s")
    out = []
    for kv in KVSTORE:
        for peer in PEERS:
            parts = []
            for c in r["comparisons"]:
                if c["kvstore"] != kv or c["peer"] != peer or c["advantage"] >= 1:
                    continue
                label, unit = units[c["metric"]]
                higher = c["metric"] not in ("get_p50_ms", "get_p99_ms")
                a, b = c["kvstore_value"], c["peer_value"]
                if c["advantage"] <= 0.5:  # the peer is at least twice as good: say how many times
                    how = f"{1 / c['advantage']:.1f}x {'less' if higher else 'longer'}"
                else:
                    pct = (1 - a / b) * 100 if higher else (a / b - 1) * 100
                    how = f"{pct:.{1 if pct < 1 else 0}f}% {'lower' if higher else 'longer'}"
                where = "" if c["metric"] == "lookup_keys_per_s" else f" at {c['size']}"
                parts.append(f"{label}{where} ({_fmt(a, unit)} vs {_fmt(b, unit)}, {how})")
            if parts:
                out.append(f"{LABELS[kv]} is behind {LABELS[peer]} on " + "; ".join(parts) + ".")
    return out


def _latency_note(r: dict) -> str:
    """Where kvstore's single-object gets lose, the measured reason: each one starts with a
    metadata round trip, whose bare cost is the one-key lookup."""
    if not any(c["metric"] in ("get_p50_ms", "get_p99_ms") and c["advantage"] < 1 for c in r["comparisons"]):
        return ""
    lk = r["lookup"]
    port = [lk[k]["one_key_p50_ms"] for k in ("kvstore-shm", "kvstore-tcp") if k in lk]
    peers = [f"{LABELS[p]} {lk[p]['one_key_p50_ms']:.3f} ms" for p in PEERS if p in lk]
    if not port or not peers:
        return ""
    tls = lk.get("kvstore-tls", {}).get("one_key_p50_ms")
    return (
        "Single-object gets: a kvstore `get_into` of a block whose location the client does not know "
        "begins with a round trip to the metadata service (gRPC `Acquire`, for the read lease and the "
        "placement) before the copy; a Redis GET or a Mooncake `get_into` is one request on an open "
        "connection. One-key lookups show what the round trip costs: "
        f"p50 {min(port):.3f} ms on the service's lookup port (a framed socket, no gRPC)"
        + (f", {tls:.3f} ms over gRPC with mTLS (a service with TLS offers no lookup port)" if tls else "")
        + ", against "
        + ", ".join(peers)
        + ". A batch pays it once per call, which is why the batch GB/s above do not show it."
    )


def plot(r: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(r["sizes"])
    x = np.arange(len(names))
    systems = [s for s in (*KVSTORE, *PEERS) if any(s in r["sizes"][n]["systems"] for n in names)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, metric, title in ((axes[0], "get_gbps", "get"), (axes[1], "put_gbps", "put")):
        for s in systems:
            ys = [r["sizes"][n]["systems"].get(s, {}).get(metric, np.nan) for n in names]
            ax.plot(x, ys, marker="o", label=LABELS[s])
        ax.set_xticks(x, names)
        ax.set_xlabel("object size")
        ax.set_title(f"{title} throughput (batch of {r['plan']['batch_bytes'] >> 20} MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle("kvstore vs peers on identical objects, same host, one run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(r: dict, png: str | None) -> str:
    p = r["plan"]
    ok = [s for s in (*KVSTORE, *PEERS) if r["systems"].get(s, {}).get("status") == "ok"]
    lines = [
        "## kvstore vs Redis and Mooncake Store (`bench/peers.py`)",
        "",
        f"- Command: `{r['command']}`",
        f"- Date: {r['date']}",
        f"- Machine: {r['machine']}",
        f"- Objects: seeded random bytes (seed {r['seed']}), identical for every system; batches of "
        f"{p['batch_bytes'] >> 20} MiB per size; put and get GB/s are medians of {p['reps']} interleaved "
        "repetitions after one uncounted warm-up; every get lands in a zeroed, pre-touched buffer and is "
        f"compared byte for byte with the source. Latency: {p['latency_samples']} single-object gets per "
        f"system and size after warm-up. Lookups: {p['lookup_keys']} existence checks per call, one caller, "
        f"{p['lookup_s']:g} s per system.",
        "",
        "| system | version | how |",
        "|---|---|---|",
    ]
    for s in (*KVSTORE, *PEERS):
        info = r["systems"].get(s)
        if info is None:
            continue
        if info["status"] == "ok":
            lines.append(f"| {LABELS[s]} | {info['version']} | {info['how']} |")
        else:
            lines.append(f"| {LABELS[s]} | {info['status']} | {info['reason']} |")
    lines += [
        "",
        "Single-object gets by kvstore are of blocks whose locations the client already knows (it put "
        "them and read them before): they skip the metadata service, and each is checked against the "
        "extent's header and its checksum after the copy. The last two columns are the same gets from "
        "a client without a location cache (`client.location_cache=0`): an `Acquire` round trip to the "
        "metadata service before each copy, a `Release` after it.",
        "",
        "| object | system | put GB/s | get GB/s | get p50 ms | get p99 ms | leased get p50 ms | leased get p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, s in r["sizes"].items():
        for name in ok:
            m = s["systems"].get(name)
            if m:
                lp50, lp99 = m.get("get_leased_p50_ms"), m.get("get_leased_p99_ms")
                lines.append(
                    f"| {size} | {LABELS[name]} | {m['put_gbps']:.2f} | {m['get_gbps']:.2f} "
                    f"| {m['get_p50_ms']:.3f} | {m['get_p99_ms']:.3f} "
                    f"| {'' if lp50 is None else f'{lp50:.3f}'} | {'' if lp99 is None else f'{lp99:.3f}'} |"
                )
    lines += [
        "",
        "| lookups | 1000 keys per call: keys/s | p50 ms per call | p99 ms per call | one key per call: p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name in ok:
        lk = r["lookup"].get(name)
        if lk:
            lines.append(
                f"| {LABELS[name]} | {lk['keys_per_s']:,} | {lk['p50_ms']:.3f} | {lk['p99_ms']:.3f} "
                f"| {lk['one_key_p50_ms']:.3f} | {lk['one_key_p99_ms']:.3f} |"
            )
    pairs = [(kv, peer) for peer in PEERS for kv in KVSTORE if any(c["kvstore"] == kv and c["peer"] == peer for c in r["comparisons"])]  # fmt: skip
    if pairs:
        lines += [
            "",
            "kvstore's advantage over each peer (> 1: kvstore better; throughput kvstore / peer, latency peer / kvstore):",
            "",
            "| metric | " + " | ".join(f"{LABELS[kv]} vs {LABELS[peer]}" for kv, peer in pairs) + " |",
            "|---|" + "---|" * len(pairs),
        ]
        adv = {(c["kvstore"], c["peer"], c["metric"], c["size"]): c["advantage"] for c in r["comparisons"]}
        rows = [(m, label, size) for size in r["sizes"] for m, label, _, _ in METRICS]
        rows.append(("lookup_keys_per_s", "lookups keys/s", "1000 keys"))
        for m, label, size in rows:
            cells = [adv.get((kv, peer, m, size)) for kv, peer in pairs]
            name = label if m == "lookup_keys_per_s" else f"{label} {size}"
            lines.append(f"| {name} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    lines.append("")
    got = targets(r)
    if got:
        lines += ["Targets:", ""]
        for field, (_kv, _m, _p, _s, target, op) in TARGETS.items():
            if field in got:
                met = got[field] <= target if op == "<=" else got[field] >= target
                lines.append(
                    f"- `{field}` = **{got[field]:.3f}** (target {op} {target:g}: {'met' if met else 'missed'})"
                )
        lines.append("")
    if r["losses"]:
        lines.append("Where kvstore is behind:")
        lines.append("")
        lines += [f"- {s}" for s in r["losses"]]
        why = _latency_note(r)
        if why:
            lines += ["", why]
    elif pairs:
        lines.append("kvstore is ahead of every measured peer on every metric in this run.")
    missing = [s for s in PEERS if r["systems"].get(s, {}).get("status") != "ok"]
    if missing:
        lines += [
            "",
            "Not measured in this run: "
            + "; ".join(f"{LABELS[s]} ({r['systems'].get(s, {}).get('reason', 'not run')})" for s in missing)
            + ". The tables compare kvstore with the remaining systems only.",
        ]
    if png:
        lines += ["", f"![kvstore vs peers](results/{png})"]
    return "\n".join(lines)


def write(r: dict, out: Path, report: bool) -> None:
    """Adds the comparisons and the losses to the result ``r``; writes it as JSON to ``out``, the
    plot next to it and (``report``) the "peers" section of bench/RESULTS.md."""
    r["comparisons"] = compare(r)
    r["losses"] = losses(r)
    r.update(targets(r))
    capacity = out.with_name("meta_capacity.json")
    if capacity.exists():  # one-key operations per second, measured by bench/meta_capacity.py
        from bench.meta_capacity import carry

        carry(json.loads(capacity.read_text()), r)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    png = out.with_name("peers_throughput.png")
    has_plot = plot(r, png)
    if report:
        from bench.report import update_section

        update_section("peers", render(r, png.name if has_plot else None))
