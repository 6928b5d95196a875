/* The data port's streamed READ answers received natively (kvstore.transport.tcp, through
 * kvstore.transport.native): on a plain blocking socket, each entry's status byte, then its
 * payload straight into its buffer and the xxh3-64 of it, with the GIL released for the whole
 * answer (taken back only to run Python's signal handlers when a signal interrupts a recv).
 * Staged answers (same-host SSD reads) stay on the Python path, which copies each block as its
 * status arrives; a staged entry here is refused. */
#include "native.h"

#include <errno.h>
#include <sys/socket.h>

/* Entry statuses of a READ answer (kvstore.transport.frames.EntryStatus). */
enum { ST_OK = 0, ST_MISMATCH = 1, ST_CHECKSUM = 2, ST_IO_ERROR = 3, ST_STAGED = 4 };

/* Fills buf[*pos..len) from a blocking socket, advancing *pos: 0, or 1 when the peer closed,
 * or -errno (-EINTR: a signal may have come, as when MSG_WAITALL returns short; the caller lets
 * Python handle it and calls again). */
static int recv_some(int fd, uint8_t *buf, size_t len, size_t *pos) {
    while (*pos < len) {
        ssize_t got = recv(fd, buf + *pos, len - *pos, MSG_WAITALL);
        if (got > 0) {
            *pos += (size_t)got;
            if (*pos < len) return -EINTR;
        } else if (got == 0) {
            return 1;
        } else {
            return -errno;
        }
    }
    return 0;
}

#define SIGNALLED 2 /* a signal handler raised: the exception is set */
#define UNASKED_STAGE 3 /* a staged entry in an answer that named no staging region */

/* recv_some until done; between signals the GIL is taken back (``_save``: the caller's
 * Py_BEGIN_ALLOW_THREADS state) to run Python's handlers, as a Python recv would. */
#define RECV_FULL(err, fd, buf, len)                                  \
    do {                                                              \
        size_t pos_ = 0;                                              \
        while (((err) = recv_some((fd), (buf), (len), &pos_)) == -EINTR) { \
            Py_BLOCK_THREADS                                          \
            int sig_ = PyErr_CheckSignals();                          \
            Py_UNBLOCK_THREADS                                        \
            if (sig_ < 0) {                                           \
                (err) = SIGNALLED;                                    \
                break;                                                \
            }                                                         \
        }                                                             \
    } while (0)

/* Receives a payload of len bytes into buf and returns its xxh3-64 in *sum: 0 or an error as
 * RECV_FULL's. A payload larger than RECV_PIECE is received RECV_PIECE at a time and each piece is
 * checksummed once it is in, while it is still in cache, instead of the whole payload being read
 * back from memory at the end: 2 MiB blocks went from 0.70-0.81 to 0.82-0.86 of the raw socket
 * (bench/store_throughput.py, 2 cores). ``save``: the caller's Py_BEGIN_ALLOW_THREADS state, for
 * RECV_FULL to run Python's signal handlers between recvs. */
#define RECV_PIECE (256u << 10)
static int recv_hashed(int fd, uint8_t *buf, size_t len, XXH3_state_t *state, uint64_t *sum, PyThreadState **save) {
    PyThreadState *_save = *save;
    int err = 0;
    if (len <= RECV_PIECE) { /* one piece: received whole, checksummed in one call */
        RECV_FULL(err, fd, buf, len);
        if (err == 0) *sum = XXH3_64bits(buf, len);
        *save = _save;
        return err;
    }
    XXH3_64bits_reset(state);
    for (size_t done = 0; done < len && err == 0;) {
        size_t piece = len - done < RECV_PIECE ? len - done : RECV_PIECE;
        RECV_FULL(err, fd, buf + done, piece);
        if (err == 0) XXH3_64bits_update(state, buf + done, piece);
        done += piece;
    }
    if (err == 0) *sum = XXH3_64bits_digest(state);
    *save = _save;
    return err;
}

const char kv_recv_blocks_doc[] =
    "recv_blocks(fd, dests, checksums) -> statuses\n\n"
    "Receives the per-entry part of a streamed READ answer from the blocking socket ``fd``\n"
    "(kernel timeouts): per entry a status byte, then for OK len(dests[i]) payload bytes into\n"
    "dests[i], whose xxh3-64 must equal checksums[i] (else its status becomes CHECKSUM); a status\n"
    "no daemon sends counts as MISMATCH. Returns the statuses (bytes, one per entry). Raises\n"
    "ConnectionError if the peer closes or stages a block, TimeoutError if it goes quiet past\n"
    "the socket's timeout, OSError otherwise.";

PyObject *kv_recv_blocks(PyObject *self, PyObject *args) {
    int fd;
    PyObject *dests, *sums;
    if (!PyArg_ParseTuple(args, "iOO", &fd, &dests, &sums)) return NULL;
    PyObject *result = NULL, *dseq = NULL, *cseq = NULL, *status_obj = NULL;
    Py_buffer *views = NULL;
    uint64_t *want = NULL;
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
    status_obj = PyBytes_FromStringAndSize(NULL, n);
    if (views == NULL || want == NULL || status_obj == NULL) {
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
    XXH3_state_t state;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        uint8_t head;
        RECV_FULL(err, fd, &head, 1);
        if (err != 0) break;
        if (head == ST_OK) {
            uint64_t sum;
            err = recv_hashed(fd, (uint8_t *)views[i].buf, (size_t)views[i].len, &state, &sum, &_save);
            if (err != 0) break;
            st[i] = sum == want[i] ? ST_OK : ST_CHECKSUM;
        } else if (head == ST_STAGED) {
            err = UNASKED_STAGE;
        } else {
            st[i] = head == ST_CHECKSUM || head == ST_IO_ERROR ? head : ST_MISMATCH;
        }
    }
    Py_END_ALLOW_THREADS
    if (err == SIGNALLED) goto done;
    if (err == UNASKED_STAGE) {
        PyErr_SetString(PyExc_ConnectionError, "data port staged a block outside its staging region");
        goto done;
    }
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
    result = status_obj;
    status_obj = NULL;
done:
    if (views != NULL) release_all(views, held);
    PyMem_Free(views);
    PyMem_Free(want);
    Py_XDECREF(status_obj);
    Py_XDECREF(dseq);
    Py_XDECREF(cseq);
    return result;
}

