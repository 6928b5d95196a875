/* Batched copy + verify for the read paths (kvstore.transport.native).
 *
 * A read of small blocks spends most of its time between GIL-free calls when each block takes a
 * copy call and a checksum call from Python. Here a whole run of blocks is one call: the
 * arguments are taken apart while the GIL is held, then the copies, the xxh3-64 checksums of the
 * copies and the header comparisons run with the GIL released.
 *
 * recv.c does the same for the per-entry part of a data-port READ answer (recv_blocks); both
 * are one module, with what they share in native.h.
 *
 * Built twice by setup.py (optional extensions): _copy (the compiler's default vector unit) and
 * _copy_avx2 (-mavx2, imported only where _copy.has_avx2() says the CPU has AVX2); KV_MODULE
 * names the module. Needs xxhash.h
 * (Debian: libxxhash-dev); xxh3-64 is stable across xxhash versions since 0.8.0, so these
 * checksums equal the xxhash Python package's.
 */
#include "native.h"

#include <time.h>
#include <unistd.h>

/* The part of an extent header a read compares (kvstore.extent, struct "<4sHH16sQQQ"): magic,
 * version, flags (0: committed, uncompressed), key, length, checksum, generation. */
#define PREFIX_BYTES 8
#define KEY_BYTES 16
#define HEAD_BYTES 48

/* Placement fields (kvstore.wire.Placement, a NamedTuple). */
enum { P_OFFSET = 2, P_LENGTH = 3, P_CHECKSUM = 4, P_GEN = 5, P_KEY = 7, P_FIELDS = 8 };

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t length;
    uint64_t checksum;
    const uint8_t *header; /* where the extent's header is (NULL: not compared) */
    uint8_t head[HEAD_BYTES];
} block_t;

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Copies src to dst and returns the xxh3-64 of the copy. A block is copied and checksummed chunk
 * by chunk, so that each chunk is checksummed while it is still in L1 instead of being read back
 * from L2 or beyond once the whole block is copied, and the core's loads of the next chunk's
 * source overlap less with hashing. A chunk's source and its copy together fill half of L1d
 * (chunk_bytes()): measured on a 48 KiB L1d, 12-16 KiB chunks ran at 0.93-0.99 of a plain memcpy
 * of 64 KiB to 2 MiB blocks, against 0.62-0.86 for a whole-block copy then checksum and 0.81-0.86
 * for 4 KiB chunks. A block no larger than a chunk is copied whole and checksummed in one call. */
#define CHUNK_MIN 4096
#define CHUNK_MAX 16384
static uint64_t chunk_size; /* set once, when the module loads */
static uint64_t chunk_bytes(void) {
    if (chunk_size == 0) {
        uint64_t c = CHUNK_MIN;
#ifdef _SC_LEVEL1_DCACHE_SIZE
        long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
        if (l1 > 0) c = (uint64_t)l1 / 4;
#endif
        c &= ~(uint64_t)4095; /* whole pages, a multiple of xxh3's 64-byte stripes */
        chunk_size = c < CHUNK_MIN ? CHUNK_MIN : c > CHUNK_MAX ? CHUNK_MAX : c;
    }
    return chunk_size;
}

static uint64_t copy_hash(uint8_t *dst, const uint8_t *src, uint64_t len, XXH3_state_t *state) {
    uint64_t chunk = chunk_bytes();
    if (len <= chunk) {
        memcpy(dst, src, len);
        return XXH3_64bits(dst, len);
    }
    XXH3_64bits_reset(state);
    for (uint64_t o = 0; o < len; o += chunk) {
        uint64_t l = len - o < chunk ? len - o : chunk;
        memcpy(dst + o, src + o, l);
        XXH3_64bits_update(state, dst + o, l);
    }
    return XXH3_64bits_digest(state);
}

/* Copies and verifies blocks[0..n) in order; returns how many leading blocks passed. */
static Py_ssize_t run_blocks(block_t *b, Py_ssize_t n, double deadline) {
    XXH3_state_t state;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (monotonic_s() > deadline) return i;
        if (b[i].header != NULL && memcmp(b[i].header, b[i].head, HEAD_BYTES) != 0) return i;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (copy_hash(b[i].dst, b[i].src, b[i].length, &state) != b[i].checksum) return i;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        /* The header read again after the copy: an extent freed or reused meanwhile had its
         * header cleared (or rewritten with another key or generation) first. */
        if (b[i].header != NULL && memcmp(b[i].header, b[i].head, HEAD_BYTES) != 0) return i;
    }
    return n;
}

PyDoc_STRVAR(read_many_doc,
    "read_many(arena, header_size, places, dests, keys, deadline, prefix) -> int\n\n"
    "Copies each placement's payload (arena[offset + header_size : ... + length]) into dests[i]\n"
    "and checks the copy's xxh3-64 against the placement's checksum; with ``keys`` (a list, not\n"
    "None) the extent's header must also name the block (prefix, the placement's key or keys[i],\n"
    "length, checksum, generation) before and after the copy. Stops at the first block that fails\n"
    "any check, lies outside the arena, has a buffer of another size, or starts after ``deadline``\n"
    "(time.monotonic seconds; inf: none). Returns how many leading blocks were loaded.");

static PyObject *read_many(PyObject *self, PyObject *args) {
    PyObject *arena_obj, *places, *dests, *keys;
    Py_ssize_t header_size;
    double deadline;
    Py_buffer prefix;
    if (!PyArg_ParseTuple(args, "OnOOOdy*", &arena_obj, &header_size, &places, &dests, &keys, &deadline, &prefix))
        return NULL;
    PyObject *result = NULL;
    Py_buffer arena = {0};
    Py_buffer *views = NULL;
    block_t *blocks = NULL;
    Py_ssize_t held = 0, n = 0;
    PyObject *pseq = NULL, *dseq = NULL, *kseq = NULL;
    if (prefix.len != PREFIX_BYTES) {
        PyErr_SetString(PyExc_ValueError, "prefix must be 8 bytes");
        goto done;
    }
    if (header_size < HEAD_BYTES) {
        PyErr_SetString(PyExc_ValueError, "header_size too small");
        goto done;
    }
    if (PyObject_GetBuffer(arena_obj, &arena, PyBUF_SIMPLE) < 0) goto done;
    pseq = PySequence_Fast(places, "places must be a sequence");
    dseq = pseq ? PySequence_Fast(dests, "dests must be a sequence") : NULL;
    if (dseq == NULL) goto done;
    if (keys != Py_None && (kseq = PySequence_Fast(keys, "keys must be a sequence or None")) == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(pseq);
    if (PySequence_Fast_GET_SIZE(dseq) < n) n = PySequence_Fast_GET_SIZE(dseq);
    if (kseq != NULL && PySequence_Fast_GET_SIZE(kseq) < n) n = PySequence_Fast_GET_SIZE(kseq);
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    blocks = PyMem_Malloc((n ? n : 1) * sizeof(block_t));
    if (views == NULL || blocks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Takes the run apart; the first block that cannot be read ends it (what follows is not
     * loaded, as in the Python path). */
    Py_ssize_t runnable = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PySequence_Fast_GET_ITEM(pseq, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) < P_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "places must hold kvstore.wire.Placement tuples");
            goto done;
        }
        /* A value that cannot be a real one (a negative offset, 2**64 or more) is a block that
         * fails, as in the Python path, not an error. */
        uint64_t off, length, csum, gen;
        int f1 = as_u64(PyTuple_GET_ITEM(p, P_OFFSET), &off), f2 = as_u64(PyTuple_GET_ITEM(p, P_LENGTH), &length);
        int f3 = as_u64(PyTuple_GET_ITEM(p, P_CHECKSUM), &csum), f4 = as_u64(PyTuple_GET_ITEM(p, P_GEN), &gen);
        if (f1 < 0 || f2 < 0 || f3 < 0 || f4 < 0) goto done;
        if (!f1 || !f2 || !f3 || !f4 || off > (uint64_t)arena.len ||
            (uint64_t)header_size > (uint64_t)arena.len - off ||
            length > (uint64_t)arena.len - off - (uint64_t)header_size) {
            runnable = i;
            break;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dseq, i), &views[i], PyBUF_WRITABLE) < 0) goto done;
        held = i + 1;
        if ((uint64_t)views[i].len != length) {
            runnable = i;
            break;
        }
        block_t *b = &blocks[i];
        b->src = (const uint8_t *)arena.buf + off + header_size;
        b->dst = views[i].buf;
        b->length = length;
        b->checksum = csum;
        b->header = NULL;
        if (kseq != NULL) {
            PyObject *k = PyTuple_GET_ITEM(p, P_KEY);
            if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) == 0) k = PySequence_Fast_GET_ITEM(kseq, i);
            if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != KEY_BYTES) {
                PyErr_SetString(PyExc_ValueError, "keys must be 16-byte bytes");
                goto done;
            }
            memcpy(b->head, prefix.buf, PREFIX_BYTES);
            memcpy(b->head + PREFIX_BYTES, PyBytes_AS_STRING(k), KEY_BYTES);
            put_le64(b->head + PREFIX_BYTES + KEY_BYTES, length);
            put_le64(b->head + PREFIX_BYTES + KEY_BYTES + 8, csum);
            put_le64(b->head + PREFIX_BYTES + KEY_BYTES + 16, gen);
            b->header = (const uint8_t *)arena.buf + off;
        }
    }
    Py_ssize_t loaded;
    Py_BEGIN_ALLOW_THREADS
    loaded = run_blocks(blocks, runnable, deadline);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(loaded);
done:
    if (views != NULL) release_all(views, held);
    PyMem_Free(views);
    PyMem_Free(blocks);
    if (arena.obj != NULL) PyBuffer_Release(&arena);
    PyBuffer_Release(&prefix);
    Py_XDECREF(pseq);
    Py_XDECREF(dseq);
    Py_XDECREF(kseq);
    return result;
}

PyDoc_STRVAR(byte_arrays_doc,
    "byte_arrays(objs, array_type, writable) -> bool\n\n"
    "Whether every one of ``objs`` is exactly of ``array_type`` (numpy.ndarray) and exports a\n"
    "1-D, C-contiguous buffer of unsigned bytes (writable, if ``writable``): what a read or a\n"
    "write takes as is, checked for a whole list in one call.");

static PyObject *byte_arrays(PyObject *self, PyObject *args) {
    PyObject *objs, *type;
    int writable;
    if (!PyArg_ParseTuple(args, "OOp", &objs, &type, &writable)) return NULL;
    PyObject *seq = PySequence_Fast(objs, "objs must be a sequence");
    if (seq == NULL) return NULL;
    int ok = 1;
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        Py_buffer view;
        if ((PyObject *)Py_TYPE(o) != type || PyObject_GetBuffer(o, &view, flags) < 0) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        ok = view.ndim == 1 && view.itemsize == 1 && view.format != NULL && strcmp(view.format, "B") == 0;
        PyBuffer_Release(&view);
    }
    Py_DECREF(seq);
    return PyBool_FromLong(ok);
}

/* Whether this CPU has AVX2. Asked of the default build (compiled without -mavx2) before the
 * AVX2 build is imported at all: code compiled with -mavx2 may use AVX2 anywhere, even while
 * the module loads. */
static PyObject *has_avx2(PyObject *self, PyObject *unused) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2"));
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"read_many", read_many, METH_VARARGS, read_many_doc},
    {"byte_arrays", byte_arrays, METH_VARARGS, byte_arrays_doc},
    {"recv_blocks", kv_recv_blocks, METH_VARARGS, kv_recv_blocks_doc},
    {"check_reads", kv_check_reads, METH_VARARGS, kv_check_reads_doc},
    {"serve_reads", kv_serve_reads, METH_VARARGS, kv_serve_reads_doc},
    {"blake2b_mac", kv_blake2b_mac, METH_VARARGS, kv_blake2b_mac_doc},
    {"seal_many", kv_seal_many, METH_VARARGS, kv_seal_many_doc},
    {"xxh3_many", kv_xxh3_many, METH_VARARGS, kv_xxh3_many_doc},
    {"xxh32_many", kv_xxh32_many, METH_VARARGS, kv_xxh32_many_doc},
    {"has_avx2", has_avx2, METH_NOARGS, "Whether this CPU has AVX2 (ask the default build)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, KV_STR(KV_MODULE), NULL, -1, methods};

PyMODINIT_FUNC KV_CAT(PyInit_, KV_MODULE)(void) {
    chunk_bytes();
    return PyModule_Create(&module);
}
