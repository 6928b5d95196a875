"""``cuda/kv_copy.cu`` builds with nvcc (sm_80, sm_90) and with NVRTC (the compiler CuPy's
RawModule uses at run time), exports every entry point ``engine.kv_copy`` launches, and spills
nothing to local memory. None of this needs a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from gpu_env import REPO

pytest.importorskip("torch", reason="torch is not installed")

from engine import kv_copy  # noqa: E402

CU = REPO / "cuda" / "kv_copy.cu"
NVCC = shutil.which("nvcc") or next(
    (p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc") if Path(p).exists()), None
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit on this machine)")


def test_cuda_folder_is_not_a_python_package():
    # a top-level package named ``cuda`` would shadow NVIDIA's ``cuda`` namespace package
    assert (REPO / "cuda").is_dir()
    assert not (REPO / "cuda" / "__init__.py").exists()
    assert kv_copy.CU_SOURCE == CU and CU.is_file()


def test_launch_constants_match_the_source():
    src = CU.read_text()
    assert re.search(rf"#define KV_COPY_THREADS {kv_copy.THREADS}\b", src)
    assert re.search(rf"#define KV_COPY_UNROLL {kv_copy.UNROLL}\b", src)
    assert "#include" not in src  # NVRTC has no standard headers
    assert len(kv_copy.KERNEL_NAMES) == len(set(kv_copy.KERNEL_NAMES)) == 24


@needs_nvcc
@pytest.mark.parametrize("arch,kind", [("sm_80", "-c"), ("sm_90", "-cubin")], ids=["sm_80-object", "sm_90-cubin"])
def test_nvcc_builds_every_entry_point(tmp_path: Path, arch: str, kind: str):
    out = tmp_path / ("kv_copy.o" if kind == "-c" else "kv_copy.cubin")
    r = subprocess.run(
        [NVCC, f"-arch={arch}", kind, "-Xptxas", "-v", "-Werror", "all-warnings", "-o", str(out), str(CU)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"nvcc -arch={arch} {kind} failed:\n{r.stderr}"
    binary = out.read_bytes()
    missing = [name for name in kv_copy.KERNEL_NAMES if name.encode() not in binary]
    assert not missing, f"entry points missing from the {arch} build: {missing}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert len(spills) >= len(kv_copy.KERNEL_NAMES), r.stderr
    assert all(a == "0" and b == "0" for a, b in spills), f"register spills:\n{r.stderr}"


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception as e:  # CuPy missing, or CuPy without an NVRTC library to load
        pytest.skip(f"NVRTC not available ({type(e).__name__}: {e})")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "compute_90"])
def test_nvrtc_builds_the_source_as_cupy_does(arch: str):
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(CU.read_text(), "kv_copy.cu", [], [])
    options = [*kv_copy.NVRTC_OPTIONS, "--device-as-default-execution-space", f"-arch={arch}"]
    try:
        nvrtc.compileProgram(prog, options)
    except Exception as e:
        pytest.fail(f"NVRTC {arch} failed: {e}\n{nvrtc.getProgramLog(prog)}")
    image = nvrtc.getPTX(prog) if arch.startswith("compute_") else nvrtc.getCUBIN(prog)
    image = image.encode() if isinstance(image, str) else image
    missing = [name for name in kv_copy.KERNEL_NAMES if name.encode() not in image]
    assert not missing, f"entry points missing from the NVRTC {arch} build: {missing}"
