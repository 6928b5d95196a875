/* What the native read paths share (copy.c: the shared-memory copy; recv.c: the data-port
 * receive): headers, module naming, argument helpers. See copy.c. */
#ifndef KV_NATIVE_H
#define KV_NATIVE_H

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

static inline double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* A Python int as u64: 1, or 0 when it does not fit (negative, 2**64 or more), or -1 with an
 * error set when it is not an int. */
static inline int as_u64(PyObject *o, uint64_t *out) {
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

static inline void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* recv.c */
PyObject *kv_recv_blocks(PyObject *self, PyObject *args);
extern const char kv_recv_blocks_doc[];

#endif
