"""The optional native part of kvstore: batched copy + verify for the read paths
(kvstore/transport/copy.c, recv.c), the daemon's answers to reads of DRAM blocks (serve.c) and
the batched header and checksum checks of its restart (batch.c); see kvstore.transport.native.
Everything else is in pyproject.toml.

Built twice: for the compiler's default vector unit, and with AVX2 (used where the CPU has it).
Both are optional: without a C compiler or xxhash.h (Debian: libxxhash-dev, which
scripts/setup.sh installs) kvstore installs without them and reads through its Python path.
"""

import platform

from setuptools import Extension, setup

SRC = [
    "kvstore/transport/copy.c", "kvstore/transport/recv.c", "kvstore/transport/serve.c", "kvstore/transport/batch.c",
]  # fmt: skip
DEPENDS = ["kvstore/transport/native.h", "kvstore/transport/blake2b.h"]
FLAGS = ["-O3", "-std=c11", "-Wall"]


def ext(name: str, extra: list[str]) -> Extension:
    return Extension(
        f"kvstore.transport.{name}", SRC, define_macros=[("KV_MODULE", name)], extra_compile_args=FLAGS + extra,
        depends=DEPENDS, optional=True,
    )  # fmt: skip


modules = [ext("_copy", [])]
if platform.machine().lower() in ("x86_64", "amd64"):
    modules.append(ext("_copy_avx2", ["-mavx2"]))
setup(ext_modules=modules)
