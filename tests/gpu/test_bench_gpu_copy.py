"""``bench/gpu_copy.py``: refuses cleanly without a GPU (status 2, nothing written), and its
summary and report hold together on a synthetic set of measurements."""

from __future__ import annotations

import pytest
from gpu_env import CUDA_OK, REPO

pytest.importorskip("torch", reason="torch is not installed")

from bench import gpu_copy  # noqa: E402


@pytest.mark.skipif(CUDA_OK, reason="a GPU is present: the benchmark would run for real")
def test_refuses_without_a_gpu(tmp_path, capsys):
    results_md = REPO / "bench" / "RESULTS.md"
    before = results_md.read_bytes() if results_md.exists() else None
    out = tmp_path / "gpu.json"
    assert gpu_copy.main(["--quick", "--out", str(out)]) == 2
    assert not out.exists()
    assert (results_md.read_bytes() if results_md.exists() else None) == before
    assert "nothing measured, nothing written" in capsys.readouterr().err


def _cases() -> list[dict]:
    cases = []
    for n in (64, 1024):
        for gran in ("blocks", "layer"):
            nbytes = n * (2 << 20 if gran == "blocks" else 64 << 10)
            for op in ("gather", "scatter"):
                cases.append({"kind": "device", "op": op, "granularity": gran, "blocks": n, "bytes": nbytes,
                              "kernel_gbps": 2000.0, "torch_gbps": 900.0, "memcpy_gbps": 2100.0})  # fmt: skip
                cases.append({"kind": "host", "op": op, "granularity": gran, "blocks": n, "bytes": nbytes,
                              "kernel_device_gbps": 50.0, "kernel_mapped_gbps": 40.0, "torch_gbps": 45.0,
                              "memcpy_gbps": 52.0})  # fmt: skip
        cases.append({"kind": "device", "op": "scatter", "granularity": "32-layers", "blocks": n,
                      "bytes": n * (2 << 20), "kernel_gbps": 1500.0, "kernel_one_launch_gbps": 2000.0})  # fmt: skip
        cases.append({"kind": "wrapper", "blocks": n, "ids_as": "device tensor", "wrapper_overhead_us": 40.0})
    return cases


def test_summary_and_report():
    r = gpu_copy.summarize(_cases(), [64, 1024], 2 << 20, 64 << 10)
    assert r["kernel_over_memcpy"] == pytest.approx(2000 / 2100, abs=1e-3)
    assert r["kernel_over_torch"] == pytest.approx(2000 / 900, abs=1e-3)
    assert r["targets_met"] == {"kernel_over_memcpy": True, "kernel_over_torch": True}
    assert r["staging"]["faster_mode"] == "device"
    assert r["staging"]["default_in_code"] == "device"
    r.update(command="python bench/gpu_copy.py", date="2026-12-02 00:00 UTC",
             machine={"gpu": "GPU", "sms": 132, "gpu_memory_gib": 140.0, "torch": "2", "torch_cuda": "13.0",
                      "python": "3.12"})  # fmt: skip
    md = gpu_copy.render(r)
    assert md.startswith("## GPU KV copies")
    assert md.count("\n| gather |") == 8 and md.count("\n| scatter |") == 8  # 4 device-local and 4 host rows each
    assert "kernel_over_memcpy" in md and "**device**" in md
