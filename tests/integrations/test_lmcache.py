"""kvstore as LMCache's second tier, end to end: ``lmcache server`` (its separate-process mode,
which runs on CPU) with the kvstore plugin, vLLM's own ``LMCacheMPConnector`` in front, a real
store behind. After the LMCache server restarts with an empty first tier, the prefix comes from
kvstore and vLLM generates the same tokens."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, flip_byte, wait_until

from bench import vllm_engine as ve

if ve.vllm_available():
    pytest.skip(ve.vllm_available(), allow_module_level=True)
pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="lmcache is not installed")
if not shutil.which("lmcache", path=str(Path(sys.executable).parent)):
    pytest.skip("the lmcache command is not installed", allow_module_level=True)

from kvstore import SyncKVStoreClient  # noqa: E402

pytestmark = pytest.mark.timeout(600)
CHUNK = 64  # LMCache's chunk: two vLLM blocks of 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [sys.executable, "-c", f"from bench.vllm_engine import make_tiny_llama; make_tiny_llama({str(path)!r})"],
        cwd=REPO,
        check=True,
        timeout=300,
    )
    return path


def test_a_restarted_lmcache_server_gets_the_prefix_from_kvstore(cluster, model, tmp_path):
    cluster.start_meta()
    cluster.start_daemon(dram="128MiB")
    prompts = [ve.prompt(9 * CHUNK + 5, seed=1), ve.prompt(3 * CHUNK + 40, seed=2)]
    alone = ve.run_generate(model, prompts, tmp_path, "--single-process")
    lm = ve.LMCacheServer(cluster.meta_addr, chunk=CHUNK, log=tmp_path / "lmcache-1.log")
    try:
        first = ve.run_generate(model, prompts, tmp_path, "--lmcache-port", str(lm.port))
        assert first["tokens"] == alone["tokens"]
        with SyncKVStoreClient(cluster.meta_addr) as c:
            wait_until(lambda: c.stats().keys >= 9 + 3)  # every full chunk reached the second tier
    finally:
        lm.stop()
    # A new LMCache server (empty first tier) and a new vLLM engine: the chunks come from kvstore.
    lm = ve.LMCacheServer(cluster.meta_addr, chunk=CHUNK, log=tmp_path / "lmcache-2.log")
    try:
        second = ve.run_generate(model, prompts, tmp_path, "--lmcache-port", str(lm.port))
        assert second["tokens"] == alone["tokens"]
        assert second["cached"][0] >= 8 * CHUNK and second["cached"][1] >= 2 * CHUNK, second["cached"]
    finally:
        lm.stop()
    # Every stored chunk corrupted in place (a flipped payload byte): kvstore's checksums turn the
    # loads into misses, LMCache reports them as such, vLLM computes: the same tokens.
    from kvstore.extent import HEADER_SIZE, MAGIC

    raw = Path(cluster.shm_paths[0]).read_bytes()
    flipped = 0
    i = raw.find(MAGIC)
    while i != -1:
        flip_byte(cluster.shm_paths[0], i + HEADER_SIZE + 100)
        flipped += 1
        i = raw.find(MAGIC, i + HEADER_SIZE)
    assert flipped >= 12
    lm = ve.LMCacheServer(cluster.meta_addr, chunk=CHUNK, log=tmp_path / "lmcache-3.log")
    try:
        third = ve.run_generate(model, prompts, tmp_path, "--lmcache-port", str(lm.port))
        assert third["tokens"] == alone["tokens"]
        assert third["cached"] == [0, 0]
    finally:
        lm.stop()
