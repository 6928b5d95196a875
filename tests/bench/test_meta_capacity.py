"""The capacity benchmark's report (bench/meta_capacity.py): every measured point becomes a row,
for the process counts that were run, and the target figure says which ratio it is."""

from __future__ import annotations

from bench.meta_capacity import LABELS, render


def result(procs: list[int]) -> dict:
    points = {
        op: {s: {str(n): {"ops": 10 * n, "ops_per_s": 1000 * n} for n in procs} for s in systems}
        for op, systems in (("lookup", ["redis", "kvstore-shm", "kvstore-grpc"]), ("get", list(LABELS)))
    }
    return {
        "command": "python bench/meta_capacity.py --quick",
        "date": "2026-12-03 00:00 UTC",
        "machine": "test",
        "seconds_per_point": 1.5,
        "objects": 2000,
        "object_bytes": 4096,
        "processes": procs,
        "points": points,
        "single_key_get_ops_over_redis": 3.5,
        "single_key_get_tcp_ops_over_redis": 0.25,
        "single_key_get_leased_ops_over_redis": 0.04,
        "single_key_lookup_ops_over_redis": 0.62,
        "single_key_lookup_grpc_ops_over_redis": 0.12,
    }


def test_the_report_has_a_row_per_system_and_a_column_per_process_count():
    text = render(result([1, 4]))
    rows = [line for line in text.splitlines() if line.startswith("| lookup |") or line.startswith("| get |")]
    assert len(rows) == 3 + len(LABELS)
    assert all(row.count("|") == 5 for row in rows)  # operation, system, 1 and 4 processes
    assert "| 1 process | 4 processes |" in text and "8 processes" not in text
    assert "`single_key_get_ops_over_redis` = **3.50** (target >= 0.5, best of 1/4 processes)" in text
    # Lookups do not use known locations: the lookup port and gRPC are the two kvstore rows.
    assert "| lookup | kvstore (lookup port) | 1,000/s | 4,000/s |" in text
    assert "| lookup | kvstore (gRPC) | 1,000/s | 4,000/s |" in text
    assert "`single_key_lookup_ops_over_redis` = **0.62** (target >= 0.5)" in text and "over gRPC 0.12" in text
