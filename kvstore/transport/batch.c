/* Batched checks for a daemon's restart (kvstore.batch, through kvstore.transport.native), with
 * the GIL released: a daemon that reattaches millions of blocks checks each one's header and
 * payload, and at a few microseconds of Python each that took minutes.
 *
 * - seal_many: per extent header, the keyed BLAKE2b-64 seal of its first 56 bytes and its offset
 *   under the daemon's secret (kvstore.extent.Sealer), which its last 8 bytes must equal.
 * - xxh3_many: the xxh3-64 of many ranges of one buffer (payload checksums).
 * - xxh32_many: the xxh32 of the first ``length`` bytes of each fixed-size record of a buffer
 *   (the SSD journal's record CRCs, kvstore.daemon.journal).
 *
 * Offsets, lengths and results are little-endian u64 (u32 for xxh32) arrays, as numpy's "<u8"
 * and "<u4" lay them out. */
#include "native.h"

#include "blake2b.h"

#define SEAL_HEADER 64
#define SEAL_BODY 56

/* BLAKE2b's F (blake2b.h) with its twelve rounds written out, so that every message index is a
 * constant: measured 1.7 to 2 times as fast as the loop over the schedule table (blake2b.h) for
 * the one-block MACs here. */
#define B2_ROUND(r)                                                                                   \
    do {                                                                                              \
        KV_B2_G(0, 4, 8, 12, m[KV_B2_SIGMA[r][0]], m[KV_B2_SIGMA[r][1]]);                             \
        KV_B2_G(1, 5, 9, 13, m[KV_B2_SIGMA[r][2]], m[KV_B2_SIGMA[r][3]]);                             \
        KV_B2_G(2, 6, 10, 14, m[KV_B2_SIGMA[r][4]], m[KV_B2_SIGMA[r][5]]);                            \
        KV_B2_G(3, 7, 11, 15, m[KV_B2_SIGMA[r][6]], m[KV_B2_SIGMA[r][7]]);                            \
        KV_B2_G(0, 5, 10, 15, m[KV_B2_SIGMA[r][8]], m[KV_B2_SIGMA[r][9]]);                            \
        KV_B2_G(1, 6, 11, 12, m[KV_B2_SIGMA[r][10]], m[KV_B2_SIGMA[r][11]]);                          \
        KV_B2_G(2, 7, 8, 13, m[KV_B2_SIGMA[r][12]], m[KV_B2_SIGMA[r][13]]);                           \
        KV_B2_G(3, 4, 9, 14, m[KV_B2_SIGMA[r][14]], m[KV_B2_SIGMA[r][15]]);                           \
    } while (0)

/* The 8-byte MAC of one 64-byte message under ``k`` (a key's state for 8-byte MACs), as the
 * little-endian u64 of its bytes. */
static uint64_t mac64(const kv_mac_key *k, const uint8_t msg[64]) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 8; i++) m[i] = kv_load64(msg + 8 * i);
    for (int i = 8; i < 16; i++) m[i] = 0;
    for (int i = 0; i < 8; i++) {
        v[i] = k->h[i];
        v[i + 8] = KV_B2_IV[i];
    }
    v[12] ^= 128 + 64;
    v[14] = ~v[14];
    B2_ROUND(0);
    B2_ROUND(1);
    B2_ROUND(2);
    B2_ROUND(3);
    B2_ROUND(4);
    B2_ROUND(5);
    B2_ROUND(6);
    B2_ROUND(7);
    B2_ROUND(8);
    B2_ROUND(9);
    B2_ROUND(0);
    B2_ROUND(1);
    return k->h[0] ^ v[0] ^ v[8];
}

static int check_u64_array(const Py_buffer *b, const char *what) {
    if (b->len % 8) {
        PyErr_Format(PyExc_ValueError, "%s must be a u64 array", what);
        return 0;
    }
    return 1;
}

const char kv_seal_many_doc[] =
    "seal_many(secret, headers, offsets, out) -> None\n\n"
    "For each 64-byte header in ``headers`` (n * 64 bytes) and its extent's offset (``offsets``,\n"
    "n little-endian u64), out[i] (n little-endian u64) = the seal of its first 56 bytes and the\n"
    "offset: hashlib.blake2b(header[:56] + offset, key=secret, digest_size=8), as a u64.";

PyObject *kv_seal_many(PyObject *self, PyObject *args) {
    Py_buffer secret, headers, offsets, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &secret, &headers, &offsets, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = offsets.len / 8;
    if (secret.len < 1 || secret.len > 64) {
        PyErr_SetString(PyExc_ValueError, "a sealing secret is 1..64 bytes");
    } else if (check_u64_array(&offsets, "offsets")) {
        if (headers.len != n * SEAL_HEADER || out.len != n * 8) {
            PyErr_SetString(PyExc_ValueError, "headers must be 64 bytes and out 8 bytes per offset");
        } else {
            kv_mac_key k;
            kv_mac_init(&k, (const uint8_t *)secret.buf, (size_t)secret.len, 8);
            const uint8_t *h = headers.buf, *o = offsets.buf;
            uint8_t *seals = out.buf;
            Py_BEGIN_ALLOW_THREADS
            uint8_t msg[SEAL_HEADER];
            for (Py_ssize_t i = 0; i < n; i++) {
                memcpy(msg, h + i * SEAL_HEADER, SEAL_BODY);
                memcpy(msg + SEAL_BODY, o + 8 * i, 8);
                kv_store64(seals + 8 * i, mac64(&k, msg));
            }
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&secret);
    PyBuffer_Release(&headers);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&out);
    return result;
}

const char kv_xxh3_many_doc[] =
    "xxh3_many(buf, starts, lengths, out) -> None\n\n"
    "out[i] = xxh3-64 of buf[starts[i] : starts[i] + lengths[i]] (starts, lengths and out: n\n"
    "little-endian u64). Raises ValueError, hashing nothing, if any range is outside ``buf``.";

PyObject *kv_xxh3_many(PyObject *self, PyObject *args) {
    Py_buffer buf, starts, lengths, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &buf, &starts, &lengths, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = starts.len / 8;
    if (!check_u64_array(&starts, "starts")) goto done;
    if (lengths.len != starts.len || out.len != starts.len) {
        PyErr_SetString(PyExc_ValueError, "starts, lengths and out must be u64 arrays of one length");
        goto done;
    }
    const uint8_t *base = buf.buf, *s = starts.buf, *l = lengths.buf;
    uint8_t *o = out.buf;
    uint64_t size = (uint64_t)buf.len;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t a = kv_load64(s + 8 * i), len = kv_load64(l + 8 * i);
        if (a > size || len > size - a) {
            bad = i;
            break;
        }
    }
    if (bad < 0)
        for (Py_ssize_t i = 0; i < n; i++)
            kv_store64(o + 8 * i, XXH3_64bits(base + kv_load64(s + 8 * i), (size_t)kv_load64(l + 8 * i)));
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "range %zd lies outside the buffer", bad);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&out);
    return result;
}

const char kv_xxh32_many_doc[] =
    "xxh32_many(buf, stride, length, out) -> None\n\n"
    "out[i] = xxh32 (seed 0) of buf[i * stride : i * stride + length] for each whole record of\n"
    "``stride`` bytes in ``buf`` (out: one little-endian u32 per record).";

PyObject *kv_xxh32_many(PyObject *self, PyObject *args) {
    Py_buffer buf, out;
    Py_ssize_t stride, length;
    if (!PyArg_ParseTuple(args, "y*nnw*", &buf, &stride, &length, &out)) return NULL;
    PyObject *result = NULL;
    if (stride < 1 || length < 0 || length > stride) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= length <= stride and stride >= 1");
    } else if (out.len != (buf.len / stride) * 4) {
        PyErr_SetString(PyExc_ValueError, "out must hold one u32 per whole record");
    } else {
        Py_ssize_t n = buf.len / stride;
        const uint8_t *b = buf.buf;
        uint8_t *o = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t h = XXH32(b + i * stride, (size_t)length, 0);
            for (int j = 0; j < 4; j++) o[4 * i + j] = (uint8_t)(h >> (8 * j));
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&out);
    return result;
}
