/* What the native read paths share (copy.c: the shared-memory copy; recv.c: the data-port
 * receive; serve.c: the daemon's answers to READ frames on DRAM; batch.c: the batched checks of
 * a restart): headers, module naming, argument helpers. See copy.c. */
#ifndef KV_NATIVE_H
#define KV_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifndef KV_MODULE
#define KV_MODULE _copy
#endif
#define KV_STR2(x) #x
#define KV_STR(x) KV_STR2(x)
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)

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

/* serve.c */
PyObject *kv_check_reads(PyObject *self, PyObject *args);
extern const char kv_check_reads_doc[];
PyObject *kv_serve_reads(PyObject *self, PyObject *args);
extern const char kv_serve_reads_doc[];
PyObject *kv_blake2b_mac(PyObject *self, PyObject *args);
extern const char kv_blake2b_mac_doc[];

/* batch.c */
PyObject *kv_seal_many(PyObject *self, PyObject *args);
extern const char kv_seal_many_doc[];
PyObject *kv_xxh3_many(PyObject *self, PyObject *args);
extern const char kv_xxh3_many_doc[];
PyObject *kv_xxh32_many(PyObject *self, PyObject *args);
extern const char kv_xxh32_many_doc[];

#endif
