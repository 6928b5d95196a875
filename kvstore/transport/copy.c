/* Batched copy + verify for the read paths (kvstore.transport.native).
 *
 * A read of small blocks spends most of its time between GIL-free calls when each block takes a
 * copy call and a checksum call from Python. Here a whole run of blocks is one call: the
 * arguments are taken apart while the GIL is held, then the copies, the xxh3-64 checksums of the
 * copies and the header comparisons run with the GIL released.
 *
 * recv_blocks does the same for the per-entry part of a data-port READ answer on a plain blocking
 * socket: each entry's status byte, then its payload straight into its buffer and the checksum of
 * it, with the GIL released for the whole answer.
 *
 * Built twice by setup.py (optional extensions): _copy (the compiler's default vector unit) and
 * _copy_avx2 (-mavx2, imported only where _copy.has_avx2() says the CPU has AVX2); KV_MODULE
 * names the module. Needs xxhash.h
 * (Debian: libxxhash-dev); xxh3-64 is stable across xxhash versions since 0.8.0, so these
 * checksums equal the xxhash Python package's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifndef KV_MODULE
#define KV_MODULE _copy
#endif
#define KV_STR2(x) #x
#define KV_STR(x) KV_STR2(x)
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)

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

/* A Python int as u64: 1, or 0 when it does not fit (negative, 2**64 or more), or -1 with an
 * error set when it is not an int. */
static int as_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "placement fields must be ints");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

/* Copies src to dst and returns the xxh3-64 of the copy. A block larger than a core's L2 cache
 * is copied and checksummed chunk by chunk, so that each chunk is checksummed while it is still in
 * L1 rather than read back from L3 or memory; a smaller one is copied whole and checksummed from
 * L2, which measured as fast or faster (64 KiB and 512 KiB blocks; 2 MiB ones gained 5-10 %
 * chunk by chunk). */
#define CHUNK 4096
#define FUSE_ABOVE (1u << 20)
static uint64_t copy_hash(uint8_t *dst, const uint8_t *src, uint64_t len, XXH3_state_t *state) {
    if (len <= FUSE_ABOVE) {
        memcpy(dst, src, len);
        return XXH3_64bits(dst, len);
    }
    XXH3_64bits_reset(state);
    for (uint64_t o = 0; o < len; o += CHUNK) {
        uint64_t l = len - o < CHUNK ? len - o : CHUNK;
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

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
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

/* Entry statuses of a READ answer (kvstore.transport.frames.EntryStatus). */
enum { ST_OK = 0, ST_MISMATCH = 1, ST_CHECKSUM = 2, ST_IO_ERROR = 3, ST_STAGED = 4 };
#define STAGED_OFFSET_BYTES 8

/* Fills buf[0..len) from a blocking socket: 0, or 1 when the peer closed, or -errno. */
static int recv_full(int fd, uint8_t *buf, size_t len) {
    size_t pos = 0;
    while (pos < len) {
        ssize_t got = recv(fd, buf + pos, len - pos, MSG_WAITALL);
        if (got > 0) {
            pos += (size_t)got;
        } else if (got == 0) {
            return 1;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return 0;
}

PyDoc_STRVAR(recv_blocks_doc,
    "recv_blocks(fd, dests, checksums) -> (statuses, staged)\n\n"
    "Receives the per-entry part of a READ answer from the blocking socket ``fd`` (kernel\n"
    "timeouts): per entry a status byte, then for OK len(dests[i]) payload bytes into dests[i],\n"
    "whose xxh3-64 must equal checksums[i] (else its status becomes CHECKSUM), or for STAGED the\n"
    "8-byte offset of the block in the staging region. Returns the statuses (bytes, one per\n"
    "entry) and the (index, offset) of each staged entry. Raises ConnectionError if the peer\n"
    "closes, TimeoutError if it goes quiet past the socket's timeout, OSError otherwise.");

static PyObject *recv_blocks(PyObject *self, PyObject *args) {
    int fd;
    PyObject *dests, *sums;
    if (!PyArg_ParseTuple(args, "iOO", &fd, &dests, &sums)) return NULL;
    PyObject *result = NULL, *dseq = NULL, *cseq = NULL, *status_obj = NULL, *staged = NULL;
    Py_buffer *views = NULL;
    uint64_t *want = NULL, *offsets = NULL;
    Py_ssize_t held = 0, n = 0;
    dseq = PySequence_Fast(dests, "dests must be a sequence");
    cseq = dseq ? PySequence_Fast(sums, "checksums must be a sequence") : NULL;
    if (cseq == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(dseq);
    if (PySequence_Fast_GET_SIZE(cseq) != n) {
        PyErr_SetString(PyExc_ValueError, "one checksum per buffer");
        goto done;
    }
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    want = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    offsets = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    status_obj = PyBytes_FromStringAndSize(NULL, n);
    if (views == NULL || want == NULL || offsets == NULL || status_obj == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(PySequence_Fast_GET_ITEM(cseq, i), &want[i]) <= 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "checksums must be u64");
            goto done;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dseq, i), &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held = i + 1;
    }
    uint8_t *st = (uint8_t *)PyBytes_AS_STRING(status_obj);
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        uint8_t head;
        if ((err = recv_full(fd, &head, 1)) != 0) break;
        if (head == ST_OK) {
            if ((err = recv_full(fd, views[i].buf, (size_t)views[i].len)) != 0) break;
            st[i] = XXH3_64bits(views[i].buf, (size_t)views[i].len) == want[i] ? ST_OK : ST_CHECKSUM;
        } else if (head == ST_STAGED) {
            uint8_t raw[STAGED_OFFSET_BYTES];
            if ((err = recv_full(fd, raw, STAGED_OFFSET_BYTES)) != 0) break;
            uint64_t off = 0;
            for (int b = STAGED_OFFSET_BYTES - 1; b >= 0; b--) off = (off << 8) | raw[b];
            offsets[i] = off;
            st[i] = ST_STAGED;
        } else {
            st[i] = head == ST_CHECKSUM || head == ST_IO_ERROR ? head : ST_MISMATCH;
        }
    }
    Py_END_ALLOW_THREADS
    if (err == 1) {
        PyErr_SetString(PyExc_ConnectionError, "data port closed mid-response");
        goto done;
    }
    if (err == -EAGAIN || err == -EWOULDBLOCK) {
        PyErr_SetString(PyExc_TimeoutError, "data port timed out mid-response");
        goto done;
    }
    if (err < 0) {
        errno = -err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if ((staged = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (st[i] != ST_STAGED) continue;
        PyObject *pair = Py_BuildValue("(nK)", i, (unsigned long long)offsets[i]);
        if (pair == NULL || PyList_Append(staged, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
    }
    result = PyTuple_Pack(2, status_obj, staged);
done:
    if (views != NULL) release_all(views, held);
    PyMem_Free(views);
    PyMem_Free(want);
    PyMem_Free(offsets);
    Py_XDECREF(status_obj);
    Py_XDECREF(staged);
    Py_XDECREF(dseq);
    Py_XDECREF(cseq);
    return result;
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
    {"recv_blocks", recv_blocks, METH_VARARGS, recv_blocks_doc},
    {"has_avx2", has_avx2, METH_NOARGS, "Whether this CPU has AVX2 (ask the default build)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, KV_STR(KV_MODULE), NULL, -1, methods};

PyMODINIT_FUNC KV_CAT(PyInit_, KV_MODULE)(void) { return PyModule_Create(&module); }
