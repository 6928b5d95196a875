"""Block keys: golden vectors of docs/block-keys.md, an independent reference, cross-process
determinism, scoping, chaining, and input validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import KeySpace, ModelFingerprint, pack_keys, unpack_keys

REPO_ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------
# Golden vectors (docs/block-keys.md, section 11)
# --------------------------------------------------------------------------------------------

FINGERPRINTS = {
    "A": ModelFingerprint("llama-3-8b", "bf16", 32, 8, 128),
    "B": ModelFingerprint(
        "qwen2-7b", "fp8_e4m3", 28, 4, 128, block_size=8, tp_rank=1, tp_size=2, layout="kv,layer,token,head,dim"
    ),
    "C": ModelFingerprint("tiny", "fp16", 1, 1, 1, block_size=1),
}


def iota(n: int) -> list[int]:
    return list(range(n))


def top(n: int) -> list[int]:
    return [4294967295 - i for i in range(n)]


def mul(n: int) -> list[int]:
    return [(i * 2654435761) % 2**32 for i in range(n)]


ROOT_A = "361f33050ad823f3e23e5d022f69697c"

# (id, fingerprint, namespace, algo, extra, tokens, root hex, key hexes)
GOLDEN = [
    (1, "A", "default", "xxh3_128", b"", iota(0), ROOT_A, []),
    (2, "A", "default", "xxh3_128", b"", iota(15), ROOT_A, []),
    (3, "A", "default", "xxh3_128", b"", iota(16), ROOT_A, ["00925bbb37384e90227fe0b76a08acdf"]),
    (
        4,
        "A",
        "default",
        "xxh3_128",
        b"",
        iota(53),
        ROOT_A,
        ["00925bbb37384e90227fe0b76a08acdf", "5779ed6ec472e9c7482563a9b02a6ff6", "a10a0957542cf0873329484f03200399"],
    ),
    (
        5,
        "A",
        "tenant-a",
        "xxh3_128",
        b"",
        iota(53),
        "eccba00e883572dd4dab9129661ae944",
        ["5317c5ddcfbe7fda1c8adc1385da79e7", "974bb01e61cc271807c3c948fa2c7d01", "90f74bcbe4c89dfe17a818fe0220184d"],
    ),
    (
        6,
        "A",
        "default",
        "sha256",
        b"",
        iota(53),
        "b119ec1060efffd6b2de0b3ad0083307",
        ["a415afc9bea34d896bfdc618f5be4399", "2d97ae1e7d1e1de4b471529e553ac45f", "daba2344d99b4bf926118ff621525574"],
    ),
    (
        7,
        "A",
        "default",
        "xxh3_128",
        bytes.fromhex("6c6f72613a37"),
        iota(53),
        ROOT_A,
        ["7fa6333e297fc72cee0a2f07adad43b4", "26c31ed3c85ddaf9a716b770dbc77b41", "d0e2065d67b19182822aca67cd250035"],
    ),
    (
        8,
        "B",
        "tenant-b",
        "xxh3_128",
        b"",
        top(29),
        "c84233dce3c5f1c54128bbc6a1d4e324",
        ["80b8b0dd58bd2eaf7dff0042e63cc5cd", "2b79774ae7c263a7f64b32ff227d11f3", "5df47443cd84fb246f25bc12cacbef75"],
    ),
    (
        9,
        "B",
        "tenant-b",
        "sha256",
        bytes.fromhex("0001feff"),
        top(29),
        "ab8f67d3d59f6c3947b610651df6fae8",
        ["16292cf8f7bd8b9c3b5f35381acd2a3e", "4f24dbf5c79d23e9a49cb212828052a4", "f699379bf0055c952e870d5307a5648e"],
    ),
    (
        10,
        "C",
        bytes.fromhex("c3bc6ec3af2d6e73").decode("utf-8"),
        "sha256",
        bytes.fromhex("696d673a3966"),
        mul(3),
        "d2fd0a977d45f52a43935ddde6f8d76b",
        ["86bff9282587d177009f8155378e2fa0", "fd69e3df1fe8ddfc3b812bd55e9219a2", "a85b6481163676e171b7b6f5a28e0f4c"],
    ),
    (
        11,
        "A",
        "",
        "xxh3_128",
        b"",
        top(32),
        "9de05db7f32d259fa3bcc530a49490a3",
        ["e819330ebcbd8f58346a33fca569ddc9", "515e012f4a48696a70dfd8dfba04dcf2"],
    ),
]


@pytest.mark.parametrize("case", GOLDEN, ids=[f"vector{c[0]}" for c in GOLDEN])
def test_golden_vectors(case):
    _, fp, namespace, algo, extra, tokens, root_hex, key_hexes = case
    ks = KeySpace(FINGERPRINTS[fp], namespace=namespace, algo=algo)
    assert ks.root.hex() == root_hex
    keys = ks.block_keys(tokens, extra=extra)
    assert [k.hex() for k in keys] == key_hexes
    assert all(type(k) is bytes and len(k) == 16 for k in keys)
    assert ks.packed_block_keys(tokens, extra=extra) == bytes.fromhex("".join(key_hexes))


def test_golden_vector_parent_continuation():
    # Vector 12: continue from vector 4's first key.
    ks = KeySpace(FINGERPRINTS["A"])
    parent = bytes.fromhex("00925bbb37384e90227fe0b76a08acdf")
    keys = ks.block_keys(iota(53)[16:], parent=parent)
    assert [k.hex() for k in keys] == ["5779ed6ec472e9c7482563a9b02a6ff6", "a10a0957542cf0873329484f03200399"]


def test_hash_known_answers():
    # Section 3: the hash bindings, including the canonical (big-endian, high-first) xxh3 digest.
    assert xxhash.xxh3_128_digest(b"").hex() == "99aa06d3014798d86001c324468d497f"
    assert xxhash.xxh3_128_digest(b"abc").hex() == "06b05ab6733a618578af5f94892f3950"
    assert hashlib.sha256(b"").digest()[:16].hex() == "e3b0c44298fc1c149afbf4c8996fb924"
    assert hashlib.sha256(b"abc").digest()[:16].hex() == "ba7816bf8f01cfea414140de5dae2223"


def test_worked_example_preimages():
    # Section 10: the root preimage and the block 0 preimage, byte for byte.
    root_preimage = bytes.fromhex(
        "01010c0000006b7673746f72652d726f6f740203080000000100000000000000030208000000787868335f31323804"
        "020700000064656661756c7405020a0000006c6c616d612d332d3862060204000000626631360703080000002000"
        "000000000000080308000000080000000000000009030800000080000000000000000a0308000000100000000000"
        "00000b030800000000000000000000000c030800000001000000000000000d02170000006c617965722c6b762c74"
        "6f6b656e2c686561642c64696d"
    )
    assert len(root_preimage) == 198
    assert ref_root_preimage(FINGERPRINTS["A"], "default", "xxh3_128") == root_preimage
    root = xxhash.xxh3_128_digest(root_preimage)
    assert root.hex() == ROOT_A
    block0 = bytes.fromhex("140110000000") + root + bytes.fromhex("150440000000") + struct.pack("<16I", *range(16))
    assert len(block0) == 92
    assert xxhash.xxh3_128_digest(block0).hex() == "00925bbb37384e90227fe0b76a08acdf"
    with_extra = block0 + bytes.fromhex("1601060000006c6f72613a37")
    assert xxhash.xxh3_128_digest(with_extra).hex() == "7fa6333e297fc72cee0a2f07adad43b4"


# --------------------------------------------------------------------------------------------
# Independent reference, written from docs/block-keys.md (no kvstore.keys internals)
# --------------------------------------------------------------------------------------------


def ref_field(tag: int, typ: int, payload: bytes) -> bytes:
    return struct.pack("<BBI", tag, typ, len(payload)) + payload


def ref_str(tag: int, s: str) -> bytes:
    return ref_field(tag, 2, s.encode("utf-8"))


def ref_u64(tag: int, v: int) -> bytes:
    return ref_field(tag, 3, struct.pack("<Q", v))


def ref_hash(algo: str, data: bytes) -> bytes:
    if algo == "xxh3_128":
        return xxhash.xxh3_128(data).intdigest().to_bytes(16, "big")
    assert algo == "sha256"
    return hashlib.sha256(data).digest()[:16]


def ref_root_preimage(fp: ModelFingerprint, namespace: str, algo: str) -> bytes:
    return (
        ref_field(1, 1, b"kvstore-root")
        + ref_u64(2, 1)
        + ref_str(3, algo)
        + ref_str(4, namespace)
        + ref_str(5, fp.model_id)
        + ref_str(6, fp.dtype)
        + ref_u64(7, fp.num_layers)
        + ref_u64(8, fp.num_kv_heads)
        + ref_u64(9, fp.head_dim)
        + ref_u64(10, fp.block_size)
        + ref_u64(11, fp.tp_rank)
        + ref_u64(12, fp.tp_size)
        + ref_str(13, fp.layout)
    )


def ref_block_keys(
    fp: ModelFingerprint, namespace: str, algo: str, tokens: list[int], extra: bytes = b"", parent: bytes | None = None
) -> list[bytes]:
    bs = fp.block_size
    prev = parent if parent is not None else ref_hash(algo, ref_root_preimage(fp, namespace, algo))
    out = []
    for i in range(len(tokens) // bs):
        block = tokens[i * bs : (i + 1) * bs]
        data = ref_field(20, 1, prev) + ref_field(21, 4, struct.pack(f"<{bs}I", *block))
        if extra:
            data += ref_field(22, 1, extra)
        prev = ref_hash(algo, data)
        out.append(prev)
    return out


def random_fingerprint(rng: random.Random) -> ModelFingerprint:
    tp_size = rng.choice([1, 2, 4, 8])
    return ModelFingerprint(
        model_id=rng.choice(["m", "llama-3-8b", "Qwen/Qwen2-7B@rev-é"]),
        dtype=rng.choice(["bf16", "fp16", "fp8_e4m3"]),
        num_layers=rng.randint(1, 128),
        num_kv_heads=rng.randint(1, 64),
        head_dim=rng.choice([64, 128, 256]),
        block_size=rng.choice([1, 2, 3, 7, 16, 32, 64]),
        tp_rank=rng.randrange(tp_size),
        tp_size=tp_size,
        layout=rng.choice(["layer,kv,token,head,dim", "kv,layer,token,head,dim", ""]),
    )


@pytest.mark.parametrize("seed", range(40))
def test_matches_independent_reference(seed):
    rng = random.Random(seed)
    fp = random_fingerprint(rng)
    namespace = rng.choice(["default", "", "tenant-a", "ünï-ns"])
    algo = rng.choice(["xxh3_128", "sha256"])
    extra = rng.choice([b"", b"\x00", b"lora:7", bytes(rng.randrange(256) for _ in range(40))])
    n = rng.randint(0, 5 * fp.block_size + fp.block_size - 1)
    hi = rng.choice([2**8, 2**17, 2**32])
    tokens = [rng.randrange(hi) for _ in range(n)]
    ks = KeySpace(fp, namespace=namespace, algo=algo)
    expected = ref_block_keys(fp, namespace, algo, tokens, extra)
    assert ks.block_keys(tokens, extra=extra) == expected
    # numpy input of any integer dtype that holds the values gives the same keys
    for dtype in (np.int64, np.uint32, np.uint64):
        assert ks.block_keys(np.array(tokens, dtype=dtype), extra=extra) == expected
    # parent continuation from a random block boundary
    if expected:
        j = rng.randrange(len(expected))
        tail = tokens[(j + 1) * fp.block_size :]
        assert ks.block_keys(tail, extra=extra, parent=expected[j]) == expected[j + 1 :]
        assert ref_block_keys(fp, namespace, algo, tail, extra, parent=expected[j]) == expected[j + 1 :]


# --------------------------------------------------------------------------------------------
# Determinism across processes
# --------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys
    from kvstore.keys import KeySpace, ModelFingerprint
    out = []
    for fp, ns, algo, extra, tokens in json.loads(sys.stdin.read()):
        ks = KeySpace(ModelFingerprint(**fp), namespace=ns, algo=algo)
        out.append([k.hex() for k in ks.block_keys(tokens, extra=bytes.fromhex(extra))])
    print(json.dumps(out))
    """
)


def _cross_process_inputs():
    rng = random.Random(7)
    cases = []
    for i in range(8):
        fp = random_fingerprint(rng)
        tokens = [rng.randrange(2**32) for _ in range(rng.randint(0, 4 * fp.block_size))]
        extra = b"" if i % 2 else bytes([i, 255 - i])
        ns = ["default", "tenant-a", "", "ünï-ns"][i % 4]
        algo = ("xxh3_128", "sha256")[i % 2]
        cases.append((dataclasses.asdict(fp), ns, algo, extra.hex(), tokens))
    return cases


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_identical_keys_in_other_processes(hashseed):
    cases = _cross_process_inputs()
    here = [
        [k.hex() for k in KeySpace(ModelFingerprint(**fp), ns, algo).block_keys(toks, bytes.fromhex(extra))]
        for fp, ns, algo, extra, toks in cases
    ]
    assert sum(len(k) for k in here) > 0
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == here


# --------------------------------------------------------------------------------------------
# Scoping, full blocks, prefixes and chaining
# --------------------------------------------------------------------------------------------

BASE_FP = ModelFingerprint("llama-3-8b", "bf16", 32, 8, 128, block_size=16, tp_rank=0, tp_size=2)
TOKENS = [(i * 7919 + 3) % 50000 for i in range(100)]  # 6 full blocks of 16, 4 left over

FIELD_CHANGES = {
    "model_id": "llama-3-8b-instruct",
    "dtype": "fp16",
    "num_layers": 31,
    "num_kv_heads": 4,
    "head_dim": 64,
    "block_size": 8,
    "tp_rank": 1,
    "tp_size": 4,
    "layout": "kv,layer,token,head,dim",
}


def test_every_fingerprint_field_is_covered():
    assert set(FIELD_CHANGES) == {f.name for f in dataclasses.fields(ModelFingerprint)}


@pytest.mark.parametrize("field_name", sorted(FIELD_CHANGES))
def test_each_fingerprint_field_changes_keys(field_name):
    base = KeySpace(BASE_FP)
    other = KeySpace(dataclasses.replace(BASE_FP, **{field_name: FIELD_CHANGES[field_name]}))
    assert other.root != base.root
    a, b = base.block_keys(TOKENS), other.block_keys(TOKENS)
    assert a and b
    assert not set(a) & set(b)


def test_namespace_algo_and_extra_change_keys():
    base = KeySpace(BASE_FP).block_keys(TOKENS)
    variants = {
        "namespace": KeySpace(BASE_FP, namespace="tenant-a").block_keys(TOKENS),
        "empty namespace": KeySpace(BASE_FP, namespace="").block_keys(TOKENS),
        "algo": KeySpace(BASE_FP, algo="sha256").block_keys(TOKENS),
        "extra": KeySpace(BASE_FP).block_keys(TOKENS, extra=b"lora:1"),
        "extra zero byte": KeySpace(BASE_FP).block_keys(TOKENS, extra=b"\x00"),
        "other extra": KeySpace(BASE_FP).block_keys(TOKENS, extra=b"lora:2"),
    }
    seen = set(base)
    for name, keys in variants.items():
        assert len(keys) == len(base), name
        assert not seen & set(keys), name
        seen |= set(keys)
    # an empty extra adds no field: identical to no extra
    assert KeySpace(BASE_FP).block_keys(TOKENS, extra=b"") == base


def test_namespace_field_boundaries_are_unambiguous():
    # Without length tags these two would hash the same concatenated bytes.
    a = KeySpace(dataclasses.replace(BASE_FP, model_id="bc"), namespace="a")
    b = KeySpace(dataclasses.replace(BASE_FP, model_id="c"), namespace="ab")
    assert a.root != b.root


def test_partial_trailing_block_gets_no_key():
    ks = KeySpace(BASE_FP)
    bs = ks.block_size
    assert ks.block_keys([]) == []
    assert ks.block_keys(TOKENS[: bs - 1]) == []
    assert len(ks.block_keys(TOKENS[:bs])) == 1
    full = ks.block_keys(TOKENS[: 3 * bs])
    for extra_tokens in range(bs):
        assert ks.block_keys(TOKENS[: 3 * bs + extra_tokens]) == full
    assert len(ks.block_keys(TOKENS[: 4 * bs])) == 4


def test_prefix_keys_are_leading_keys():
    ks = KeySpace(BASE_FP)
    full = ks.block_keys(TOKENS)
    assert len(full) == len(TOKENS) // ks.block_size
    for n in range(len(TOKENS) + 1):
        assert ks.block_keys(TOKENS[:n]) == full[: n // ks.block_size]
    # a change in block j changes keys j.. and no earlier one
    j = 2
    changed = list(TOKENS)
    changed[j * ks.block_size + 5] += 1
    other = ks.block_keys(changed)
    assert other[:j] == full[:j]
    assert all(x != y for x, y in zip(other[j:], full[j:], strict=True))


def test_parent_continuation_equals_whole_sequence():
    ks = KeySpace(BASE_FP, namespace="tenant-a", algo="sha256")
    bs = ks.block_size
    full = ks.block_keys(TOKENS, extra=b"x")
    for j in range(len(full)):
        assert ks.block_keys(TOKENS[(j + 1) * bs :], extra=b"x", parent=full[j]) == full[j + 1 :]
    # chaining piece by piece rebuilds the whole list
    keys: list[bytes] = []
    for i in range(len(full)):
        parent = keys[-1] if keys else None
        keys += ks.block_keys(TOKENS[i * bs : (i + 1) * bs], extra=b"x", parent=parent)
    assert keys == full
    assert ks.block_keys(TOKENS[:bs], extra=b"x", parent=ks.root) == full[:1]


def test_pure_and_no_state():
    ks = KeySpace(BASE_FP)
    a = ks.block_keys(TOKENS)
    ks.block_keys(list(reversed(TOKENS)))
    assert ks.block_keys(TOKENS) == a
    assert KeySpace(BASE_FP).block_keys(TOKENS) == a


def test_pack_unpack_round_trip():
    keys = KeySpace(BASE_FP).block_keys(TOKENS)
    packed = pack_keys(keys)
    assert len(packed) == 16 * len(keys)
    assert unpack_keys(packed) == keys
    assert pack_keys(packed) == packed
    assert unpack_keys(b"") == []


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, -1] + [0] * 13, r"token ids must lie in \[0, 2\*\*32\)"),
        (np.array([0] * 15 + [-5], dtype=np.int32), r"token ids must lie in \[0, 2\*\*32\)"),
        ([0] * 15 + [2**32], r"token ids must lie in \[0, 2\*\*32\)"),
        (np.array([2**32 + 7] * 16, dtype=np.uint64), r"token ids must lie in \[0, 2\*\*32\)"),
        ([1.0] * 16, r"token_ids must be integers.*float"),
        (np.arange(16, dtype=np.float32), r"token_ids must be integers.*float"),
        ([1, 2.5] + [0] * 14, r"token_ids must be integers"),
        ([True] * 16, r"token_ids must be integers"),
        (["a"] * 16, r"token_ids must be integers"),
        ([[1] * 16, [2] * 16], r"token_ids must be one-dimensional.*\(2, 16\)"),
        (np.zeros((4, 4), dtype=np.int64), r"token_ids must be one-dimensional"),
        (5, r"token_ids must be one-dimensional"),
    ],
    ids=[
        "negative",
        "negative-np",
        "2**32",
        "huge-u64",
        "float-list",
        "float-array",
        "mixed-float",
        "bool",
        "str",
        "2d-list",
        "2d-array",
        "scalar",
    ],
)
def test_bad_tokens_rejected(tokens, match):
    with pytest.raises(InvalidArgument, match=match):
        KeySpace(BASE_FP).block_keys(tokens)


def test_max_token_id_accepted():
    ks = KeySpace(BASE_FP)
    assert len(ks.block_keys([2**32 - 1] * 16)) == 1


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32])
def test_bad_parent_length_rejected(length):
    with pytest.raises(InvalidArgument, match=rf"parent key must be 16 bytes, got {length}"):
        KeySpace(BASE_FP).block_keys(TOKENS, parent=b"\x01" * length)


@pytest.mark.parametrize("field_name", ["num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_fingerprint_fields_rejected(field_name, value):
    with pytest.raises(InvalidArgument, match=rf"ModelFingerprint\.{field_name} must be a positive int"):
        dataclasses.replace(BASE_FP, **{field_name: value})


@pytest.mark.parametrize(("tp_rank", "tp_size"), [(1, 1), (2, 2), (8, 4), (-1, 2)])
def test_tp_rank_out_of_range_rejected(tp_rank, tp_size):
    with pytest.raises(InvalidArgument, match=r"ModelFingerprint\.tp_rank must be in \[0, "):
        dataclasses.replace(BASE_FP, tp_rank=tp_rank, tp_size=tp_size)


@pytest.mark.parametrize("field_name", ["model_id", "dtype"])
def test_empty_model_id_or_dtype_rejected(field_name):
    with pytest.raises(InvalidArgument, match="must not be empty"):
        dataclasses.replace(BASE_FP, **{field_name: ""})


@pytest.mark.parametrize("algo", ["xxh64", "SHA256", "", "md5"])
def test_unknown_algorithm_rejected(algo):
    with pytest.raises(InvalidArgument, match=rf"unknown hash algorithm '{algo}'"):
        KeySpace(BASE_FP, algo=algo)


def test_non_str_namespace_rejected():
    with pytest.raises(InvalidArgument, match="namespace must be a str"):
        KeySpace(BASE_FP, namespace=b"tenant")  # type: ignore[arg-type]


def test_pack_keys_names_bad_key_index():
    good = b"\x00" * 16
    with pytest.raises(InvalidArgument, match=r"key 2 must be 16 bytes, got 15"):
        pack_keys([good, good, b"\x00" * 15, good])
    with pytest.raises(InvalidArgument, match=r"key 1 must be 16 bytes, got 17"):
        pack_keys([good, b"\x00" * 17])
    with pytest.raises(InvalidArgument, match=r"key 0 must be 16 bytes, got str"):
        pack_keys(["x" * 16])
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        pack_keys(b"\x00" * 33)
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        unpack_keys(b"\x00" * 17)


def test_a_salt_changes_every_key_and_none_keeps_them():
    fp = ModelFingerprint("m", "bf16", 2, 2, 64)
    toks = list(range(64))
    plain = KeySpace(fp, "t").block_keys(toks)
    assert KeySpace(fp, "t", salt=b"").block_keys(toks) == plain  # golden vectors unchanged
    s1 = KeySpace(fp, "t", "sha256", salt=b"s" * 16).block_keys(toks)
    s2 = KeySpace(fp, "t", "sha256", salt=b"z" * 16).block_keys(toks)
    assert not set(s1) & set(s2) and not set(s1) & set(KeySpace(fp, "t", "sha256").block_keys(toks))
    with pytest.raises(InvalidArgument, match="at least 16 bytes"):
        KeySpace(fp, "t", salt=b"short")
