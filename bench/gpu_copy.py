#!/usr/bin/env python3
"""GPU KV copies: the CUDA gather/scatter kernels (``cuda/kv_copy.cu`` through
``engine.kv_copy``) against a plain ``cudaMemcpyAsync`` of the same bytes and against torch
``index_select`` / ``index_copy_``, on one GPU.

    python bench/gpu_copy.py            # 64 and 1024 blocks, about a minute on an H200
    python bench/gpu_copy.py --quick    # 64 blocks only

The block is Llama-3-8B's: 32 layers x 2 (K, V) x 16 tokens x 8 KV heads x 128 dims of bf16 =
2 MiB per block, 64 KiB per layer slice; the paged cache holds 2048 blocks (4 GiB) and the listed
blocks are a random set of it. For 64 and 1024 blocks, each direction (gather = save,
scatter = load), and whole blocks or one layer of each block:

- device-local: cache <-> a contiguous device buffer. Kernel vs ``cudaMemcpyAsync`` device to
  device of the same byte count (``kernel_over_memcpy``) and vs torch on the same tensors
  (``kernel_over_torch``);
- host staging: cache <-> pinned host memory (an ``engine.staging.StagingPool`` slab), in both
  modes (``device``: kernel into device scratch + one ``cudaMemcpyAsync``; ``mapped``: the kernel
  reads or writes the pinned memory directly), vs ``cudaMemcpyAsync`` between a contiguous device
  buffer and the same pinned memory, and vs torch (``index_select`` then ``copy_`` to the host;
  ``.to(device)`` then ``index_copy_``).

The kernels are timed as launched by ``engine.kv_copy`` with block ids already on the device (the
argument checks, which read ids back to the host once per call, are timed separately as
``wrapper_overhead_us``). Times are CUDA-event medians of repeated runs after warm-up; every
measured kernel result is compared with torch's once.

Writes bench/results/gpu.json (``kernel_over_memcpy`` and ``kernel_over_torch``: geometric means
over the device-local cases, each with its minimum) and the "gpu" section of bench/RESULTS.md.
Without a CUDA GPU (or without CuPy able to run the kernels) it exits with status 2 and writes
nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 32, 16, 8, 128
CACHE_BLOCKS = 2048
TARGETS = {"kernel_over_memcpy": 0.9, "kernel_over_torch": 2.0}


def refuse(msg: str) -> int:
    print(f"gpu_copy: {msg}; nothing measured, nothing written", file=sys.stderr)
    return 2


def machine(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    info = {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "sms": props.multi_processor_count,
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    try:
        import cupy

        info["cupy"] = cupy.__version__
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:
        pass
    return info


class Timer:
    def __init__(self, torch, reps: int, warmup: int) -> None:
        self.torch, self.reps, self.warmup = torch, reps, warmup

    def __call__(self, fn: Callable[[], None]) -> float:
        """Median seconds of one ``fn()`` on the current stream."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)


def run(ns: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from engine import kv_copy
    from engine.staging import StagingPool

    counts = [64] if ns.quick else [64, 1024]
    timer = Timer(torch, reps=ns.reps, warmup=2)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev).cuda_stream
    shape = (CACHE_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    block_bytes = cache[0].numel() * cache.element_size()
    layer_bytes = block_bytes // NUM_LAYERS
    max_n = max(counts)
    dev_buf = torch.empty((max_n, *shape[1:]), dtype=cache.dtype, device=dev)  # contiguous staging on the GPU
    dev_src = torch.randn_like(dev_buf)
    scratch = torch.empty_like(dev_buf)
    pool = StagingPool(max_n * block_bytes, 1, pinned=True)
    slab = pool.acquire()
    host_all = slab.torch(torch.bfloat16, (max_n * block_bytes // 2,))
    host_all.copy_(dev_src.reshape(-1))
    rng = np.random.default_rng(0)

    def memcpy(dst: int, src: int, nbytes: int) -> Callable[[], None]:
        return lambda: kv_copy._memcpy_async(dst, src, nbytes, stream, 0)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    cases: list[dict] = []

    def record(kind: str, op: str, gran: str, n: int, nbytes: int, times: dict[str, float]) -> None:
        row = {"kind": kind, "op": op, "granularity": gran, "blocks": n, "bytes": nbytes}
        for name, t in times.items():
            row[f"{name}_gbps"] = round(nbytes / t / 1e9, 2)
        cases.append(row)
        print(json.dumps(row), flush=True)

    for n in counts:
        ids = torch.from_numpy(rng.permutation(CACHE_BLOCKS)[:n].astype(np.int64)).to(dev)
        for gran, layer in (("blocks", None), ("layer", 7)):
            row_bytes = block_bytes if layer is None else layer_bytes
            nbytes = n * row_bytes
            view = cache if layer is None else cache[:, layer]
            rshape = (n, *shape[1:]) if layer is None else (n, *shape[2:])
            out = dev_buf.reshape(-1)[: n * row_bytes // 2].view(rshape)
            src = dev_src.reshape(-1)[: n * row_bytes // 2].view(rshape)
            host = host_all[: n * row_bytes // 2].view(rshape)
            ref = view.index_select(0, ids)

            # -- device-local gather (save into device staging)
            def k_gather(out=out, layer=layer):
                kv_copy._launch("gather", cache, out.data_ptr(), ids, layer, stream)

            k_gather()
            torch.cuda.synchronize()
            assert same(out, ref), "kernel gather differs from torch"
            record("device", "gather", gran, n, nbytes, {
                "kernel": timer(k_gather),
                "torch": timer(lambda out=out, view=view: torch.index_select(view, 0, ids, out=out)),
                "memcpy": timer(memcpy(out.data_ptr(), cache.data_ptr(), nbytes)),
            })  # fmt: skip

            # -- device-local scatter (load from device staging)
            backup = view.index_select(0, ids)

            def k_scatter(src=src, layer=layer):
                kv_copy._launch("scatter", cache, src.data_ptr(), ids, layer, stream)

            k_scatter()
            torch.cuda.synchronize()
            assert same(view.index_select(0, ids), src), "kernel scatter differs from the source"
            record("device", "scatter", gran, n, nbytes, {
                "kernel": timer(k_scatter),
                "torch": timer(lambda view=view, src=src: view.index_copy_(0, ids, src)),
                "memcpy": timer(memcpy(out.data_ptr(), src.data_ptr(), nbytes)),
            })  # fmt: skip
            view.index_copy_(0, ids, backup)

            # -- host staging: gather to pinned host, both modes
            def h_gather_device(host=host, out=out, layer=layer):
                kv_copy._launch("gather", cache, scratch.data_ptr(), ids, layer, stream)
                kv_copy._memcpy_async(host.data_ptr(), scratch.data_ptr(), host.numel() * 2, stream, 0)

            def h_gather_mapped(host=host, layer=layer):
                kv_copy._launch("gather", cache, host.data_ptr(), ids, layer, stream)

            for fn in (h_gather_device, h_gather_mapped):
                host.zero_()
                fn()
                torch.cuda.synchronize()
                assert same(host, ref.cpu()), f"{fn.__name__} differs from torch"
            record("host", "gather", gran, n, nbytes, {
                "kernel_device": timer(h_gather_device),
                "kernel_mapped": timer(h_gather_mapped),
                "torch": timer(lambda host=host, view=view: host.copy_(view.index_select(0, ids), non_blocking=True)),
                "memcpy": timer(memcpy(host.data_ptr(), out.data_ptr(), nbytes)),
            })  # fmt: skip

            # -- host staging: scatter from pinned host, both modes
            def h_scatter_device(host=host, layer=layer):
                kv_copy._memcpy_async(scratch.data_ptr(), host.data_ptr(), host.numel() * 2, stream, 0)
                kv_copy._launch("scatter", cache, scratch.data_ptr(), ids, layer, stream)

            def h_scatter_mapped(host=host, layer=layer):
                kv_copy._launch("scatter", cache, host.data_ptr(), ids, layer, stream)

            for fn in (h_scatter_device, h_scatter_mapped):
                view.index_copy_(0, ids, torch.zeros_like(backup))
                fn()
                torch.cuda.synchronize()
                assert same(view.index_select(0, ids).cpu(), host), f"{fn.__name__} differs from the source"
            record("host", "scatter", gran, n, nbytes, {
                "kernel_device": timer(h_scatter_device),
                "kernel_mapped": timer(h_scatter_mapped),
                "torch": timer(lambda host=host, view=view: view.index_copy_(0, ids, host.to(dev, non_blocking=True))),
                "memcpy": timer(memcpy(out.data_ptr(), host.data_ptr(), nbytes)),
            })  # fmt: skip
            view.index_copy_(0, ids, ref)

        # -- a whole load done layer by layer (32 launches) against one launch for whole blocks
        per_layer = [dev_src[:n, layer].contiguous() for layer in range(NUM_LAYERS)]

        def k_layers(per_layer=per_layer):
            for layer, part in enumerate(per_layer):
                kv_copy._launch("scatter", cache, part.data_ptr(), ids, layer, stream)

        record("device", "scatter", "32-layers", n, n * block_bytes, {
            "kernel": timer(k_layers),
            "kernel_one_launch": timer(lambda: kv_copy._launch("scatter", cache, dev_src.data_ptr(), ids, None, stream)),
        })  # fmt: skip
        del per_layer

        # -- what the public wrapper adds: argument checks (ids read back once) and the launch
        t_wrapper = timer(lambda n=n: kv_copy.gather(cache, ids, out=dev_buf[:n]))
        t_raw = timer(lambda: kv_copy._launch("gather", cache, dev_buf.data_ptr(), ids, None, stream))
        cases.append({"kind": "wrapper", "blocks": n, "ids_as": "device tensor",
                      "wrapper_overhead_us": round((t_wrapper - t_raw) * 1e6, 1)})  # fmt: skip
        print(json.dumps(cases[-1]), flush=True)

    slab.release()
    pool.close()
    return summarize(cases, counts, block_bytes, layer_bytes)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(cases: list[dict], counts: list[int], block_bytes: int, layer_bytes: int) -> dict:
    local = [c for c in cases if c["kind"] == "device" and c["granularity"] in ("blocks", "layer")]
    over_memcpy = [c["kernel_gbps"] / c["memcpy_gbps"] for c in local]
    over_torch = [c["kernel_gbps"] / c["torch_gbps"] for c in local]
    for c in local:
        c["kernel_over_memcpy"] = round(c["kernel_gbps"] / c["memcpy_gbps"], 3)
        c["kernel_over_torch"] = round(c["kernel_gbps"] / c["torch_gbps"], 3)
    host = [c for c in cases if c["kind"] == "host"]
    for c in host:
        best = max(c["kernel_device_gbps"], c["kernel_mapped_gbps"])
        c["faster_mode"] = "device" if c["kernel_device_gbps"] >= c["kernel_mapped_gbps"] else "mapped"
        c["best_over_memcpy"] = round(best / c["memcpy_gbps"], 3)
        c["best_over_torch"] = round(best / c["torch_gbps"], 3)
    # the staging mode to keep as default: the one with less total time over the host cases
    time_device = sum(c["bytes"] / (c["kernel_device_gbps"] * 1e9) for c in host)
    time_mapped = sum(c["bytes"] / (c["kernel_mapped_gbps"] * 1e9) for c in host)
    result = {
        "block": {
            "layers": NUM_LAYERS,
            "kv": 2,
            "tokens": BLOCK_SIZE,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "block_bytes": block_bytes,
            "layer_bytes": layer_bytes,
            "cache_blocks": CACHE_BLOCKS,
        },  # fmt: skip
        "counts": counts,
        "kernel_over_memcpy": round(geomean(over_memcpy), 3),
        "kernel_over_memcpy_min": round(min(over_memcpy), 3),
        "kernel_over_torch": round(geomean(over_torch), 3),
        "kernel_over_torch_min": round(min(over_torch), 3),
        "staging": {
            "faster_mode": "device" if time_device <= time_mapped else "mapped",
            "device_total_s": round(time_device, 4),
            "mapped_total_s": round(time_mapped, 4),
            "default_in_code": None,
        },
        "targets": TARGETS,
        "cases": cases,
    }
    from engine import kv_copy

    result["staging"]["default_in_code"] = kv_copy.DEFAULT_STAGING_MODE
    result["targets_met"] = {k: result[k] >= v for k, v in TARGETS.items()}
    return result


def render(r: dict) -> str:
    b = r["block"]
    m = r["machine"]
    lines = [
        "## GPU KV copies (`bench/gpu_copy.py`)",
        "",
        f"- Command: `{r['command']}`",
        f"- Date: {r['date']}",
        f"- Machine: {m['gpu']} ({m['sms']} SMs, {m['gpu_memory_gib']} GiB), torch {m['torch']} (CUDA {m['torch_cuda']}),"
        f" CuPy {m.get('cupy', '?')}, Python {m['python']}",
        f"- Block: {b['layers']} layers x 2 x {b['tokens']} tokens x {b['kv_heads']} KV heads x {b['head_dim']} dims of"
        f" {b['dtype']} = {b['block_bytes'] >> 20} MiB ({b['layer_bytes'] >> 10} KiB per layer); cache of"
        f" {b['cache_blocks']} blocks, random block ids. CUDA-event medians after warm-up; every kernel result"
        " checked against torch.",
        "- Baselines in the same run: `cudaMemcpyAsync` of the same byte count between contiguous buffers, and"
        " torch `index_select` / `index_copy_` on the same tensors.",
        "",
        "Device-local (cache <-> contiguous device buffer), GB/s of KV moved:",
        "",
        "| op | rows | blocks | kernel | torch | memcpy | kernel/memcpy | kernel/torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        if c["kind"] == "device" and "kernel_over_memcpy" in c:
            lines.append(
                f"| {c['op']} | {c['granularity']} | {c['blocks']} | {c['kernel_gbps']} | {c['torch_gbps']} |"
                f" {c['memcpy_gbps']} | **{c['kernel_over_memcpy']}** | **{c['kernel_over_torch']}** |"
            )
    lines += [
        "",
        "Host staging (cache <-> pinned host memory), GB/s: `device` = kernel into device scratch + one"
        " `cudaMemcpyAsync`; `mapped` = the kernel reads/writes pinned memory directly:",
        "",
        "| op | rows | blocks | device | mapped | torch | memcpy | best/memcpy | best/torch | faster |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        if c["kind"] == "host":
            lines.append(
                f"| {c['op']} | {c['granularity']} | {c['blocks']} | {c['kernel_device_gbps']} |"
                f" {c['kernel_mapped_gbps']} | {c['torch_gbps']} | {c['memcpy_gbps']} | {c['best_over_memcpy']} |"
                f" {c['best_over_torch']} | {c['faster_mode']} |"
            )
    extra = [c for c in r["cases"] if c.get("granularity") == "32-layers"]
    wrap = [c for c in r["cases"] if c["kind"] == "wrapper"]
    lines.append("")
    for c in extra:
        lines.append(
            f"- A load of {c['blocks']} blocks done layer by layer (32 launches): {c['kernel_gbps']} GB/s;"
            f" the same load in one launch: {c['kernel_one_launch_gbps']} GB/s."
        )
    for c in wrap:
        lines.append(
            f"- `kv_copy.gather` argument checks and dispatch, {c['blocks']} block ids on the device:"
            f" {c['wrapper_overhead_us']} us per call over the bare launch."
        )
    s = r["staging"]
    lines += [
        f"- Staging mode with less total time over the host cases: **{s['faster_mode']}** (device"
        f" {s['device_total_s']} s, mapped {s['mapped_total_s']} s); `DEFAULT_STAGING_MODE` in the code:"
        f" `{s['default_in_code']}`.",
        "",
        "| target | measured (geometric mean; min) | goal |",
        "|---|---|---|",
        f"| `kernel_over_memcpy` | {r['kernel_over_memcpy']}; {r['kernel_over_memcpy_min']} | >= {TARGETS['kernel_over_memcpy']} |",
        f"| `kernel_over_torch` | {r['kernel_over_torch']}; {r['kernel_over_torch_min']} | >= {TARGETS['kernel_over_torch']} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 blocks only")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per case (median)")
    ap.add_argument("--no-report", action="store_true", help="do not rewrite bench/RESULTS.md")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu.json")
    ns = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        return refuse("torch is not installed")
    if not torch.cuda.is_available():
        return refuse("no CUDA GPU (torch.cuda.is_available() is False)")
    from engine import kv_copy

    why = kv_copy.kernels_unavailable_reason(0)
    if why:
        return refuse(f"the CUDA kernels cannot run: {why}")
    t0 = time.monotonic()
    result = {
        "command": "python bench/gpu_copy.py" + (" --quick" if ns.quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(torch),
    }
    result.update(run(ns))
    result["seconds"] = round(time.monotonic() - t0, 1)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("kernel_over_memcpy", "kernel_over_torch", "targets_met")}
    summary["staging_faster_mode"] = result["staging"]["faster_mode"]
    print(json.dumps(summary))
    if not ns.no_report:
        from bench.report import update_section

        update_section("gpu", render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
