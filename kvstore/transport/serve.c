/* The daemon's READ frames on shared-memory (DRAM) segments served natively
 * (kvstore.daemon.dataport, through kvstore.transport.native), with the GIL released:
 *
 * - check_reads: what kvstore.daemon.dataport.check_entries checks of each entry (a known
 *   segment, the extent inside it, the length limit, and the capability ticket: expiry and
 *   BLAKE2b-128 MAC under the one ticket key) and nothing more. It only says whether every entry
 *   passes; the Python check, run on a frame that does not, says why (the error the peer gets).
 * - serve_reads: per entry, the extent's sealed header (kvstore.extent: magic, version, key,
 *   length, generation, and the BLAKE2b-64 seal of its bytes and offset under the daemon's
 *   secret), then its status byte and payload, gathered up to a MiB (or MAX_IOV buffers) per
 *   sendmsg straight from the arena; a header that does not name the entry's block is a MISMATCH.
 *
 * The same answers as the Python path (DataPort._serve_read on DRAM entries), a few hundred
 * nanoseconds of CPU per entry instead of microseconds of Python holding the GIL. */
#include "native.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "blake2b.h"

#define ENTRY_BYTES 72 /* key 16s | segment u32 | expiry u32 | offset u64 | length u64 | checksum u64 | gen u64 | mac 16s */
#define HEADER_BYTES 64
#define TICKET_READ 1
#define GATHER_BYTES (1u << 20)
#define GATHER_IOV 512 /* kvstore.transport.frames.MAX_IOV */
#define MAX_SEGMENTS 64

typedef struct {
    uint64_t id;
    uint64_t size;
    const uint8_t *base;
} seg_t;

typedef struct {
    const uint8_t *key, *mac;
    uint32_t seg, expiry;
    uint64_t off, len, gen;
} entry_t;

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void entry_at(const uint8_t *p, entry_t *e) {
    e->key = p;
    e->seg = load32(p + 16);
    e->expiry = load32(p + 20);
    e->off = kv_load64(p + 24);
    e->len = kv_load64(p + 32);
    e->gen = kv_load64(p + 48);
    e->mac = p + 56;
}

static const seg_t *find_seg(const seg_t *segs, Py_ssize_t n, uint64_t id) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (segs[i].id == id) return &segs[i];
    return NULL;
}

/* Segment ids and sizes (and, given ``views``, base addresses from their buffers, held in
 * ``bufs``) into ``segs``. Returns the count, or -1 with an error set. */
static Py_ssize_t load_segments(PyObject *ids, PyObject *sizes, PyObject *views, seg_t *segs, Py_buffer *bufs,
                                Py_ssize_t *held) {
    PyObject *iseq = PySequence_Fast(ids, "segment ids must be a sequence");
    if (iseq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(iseq), out = -1;
    PyObject *sseq = NULL, *vseq = NULL;
    if (n > MAX_SEGMENTS) {
        PyErr_Format(PyExc_ValueError, "at most %d segments", MAX_SEGMENTS);
        goto done;
    }
    if (sizes != NULL && (sseq = PySequence_Fast(sizes, "segment sizes must be a sequence")) == NULL) goto done;
    if (views != NULL && (vseq = PySequence_Fast(views, "segment views must be a sequence")) == NULL) goto done;
    if ((sseq && PySequence_Fast_GET_SIZE(sseq) != n) || (vseq && PySequence_Fast_GET_SIZE(vseq) != n)) {
        PyErr_SetString(PyExc_ValueError, "one size or view per segment id");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(PySequence_Fast_GET_ITEM(iseq, i), &segs[i].id) <= 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "segment ids must be u64");
            goto done;
        }
        segs[i].base = NULL;
        if (vseq != NULL) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(vseq, i), &bufs[i], PyBUF_SIMPLE) < 0) goto done;
            *held = i + 1;
            segs[i].base = (const uint8_t *)bufs[i].buf;
            segs[i].size = (uint64_t)bufs[i].len;
        } else if (as_u64(PySequence_Fast_GET_ITEM(sseq, i), &segs[i].size) <= 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "segment sizes must be u64");
            goto done;
        }
    }
    out = n;
done:
    Py_XDECREF(iseq);
    Py_XDECREF(sseq);
    Py_XDECREF(vseq);
    return out;
}

const char kv_check_reads_doc[] =
    "check_reads(entries, segment_ids, segment_sizes, ticket_key, now, skew_s, max_block) -> int\n\n"
    "Whether every entry of a READ frame (``entries``: the packed 72-byte entries) names one of\n"
    "the given segments, an extent inside it, a length of 1..max_block bytes and, with a\n"
    "``ticket_key`` (else b\"\"), a read ticket that has not expired at ``now`` (wall-clock\n"
    "seconds, with ``skew_s`` of tolerance) and whose MAC matches. Returns -1 when all do; the\n"
    "index of the first entry that names no given segment, or fails a check, otherwise.";

PyObject *kv_check_reads(PyObject *self, PyObject *args) {
    Py_buffer frame, key;
    PyObject *ids, *sizes, *max_obj;
    double now, skew;
    if (!PyArg_ParseTuple(args, "y*OOy*ddO", &frame, &ids, &sizes, &key, &now, &skew, &max_obj)) return NULL;
    PyObject *result = NULL;
    seg_t segs[MAX_SEGMENTS];
    Py_ssize_t held = 0;
    uint64_t max_block = 0;
    Py_ssize_t nseg = load_segments(ids, sizes, NULL, segs, NULL, &held);
    if (nseg < 0) goto done;
    if (as_u64(max_obj, &max_block) < 0) goto done; /* one that does not fit (negative): no length passes */
    if (frame.len % ENTRY_BYTES != 0) {
        PyErr_SetString(PyExc_ValueError, "entries must be whole 72-byte entries");
        goto done;
    }
    if (key.len > 64) {
        PyErr_SetString(PyExc_ValueError, "a ticket key is at most 64 bytes");
        goto done;
    }
    Py_ssize_t n = frame.len / ENTRY_BYTES, bad = -1;
    const uint8_t *p = (const uint8_t *)frame.buf;
    kv_mac_key mk;
    Py_BEGIN_ALLOW_THREADS
    if (key.len) kv_mac_init(&mk, (const uint8_t *)key.buf, (size_t)key.len, 16);
    for (Py_ssize_t i = 0; i < n && bad < 0; i++) {
        entry_t e;
        entry_at(p + i * ENTRY_BYTES, &e);
        const seg_t *s = find_seg(segs, nseg, e.seg);
        if (s == NULL || e.len == 0 || e.len > max_block || s->size < HEADER_BYTES || e.off > s->size - HEADER_BYTES ||
            e.len > s->size - HEADER_BYTES - e.off) {
            bad = i;
            break;
        }
        if (key.len) {
            /* tickets.mac's message: op u8 | segment u32 | offset u64 | length u64 | gen u64 | expiry u32 | key 16s */
            uint8_t msg[49], mac[16];
            msg[0] = TICKET_READ;
            memcpy(msg + 1, p + i * ENTRY_BYTES + 16, 4);
            kv_store64(msg + 5, e.off);
            kv_store64(msg + 13, e.len);
            kv_store64(msg + 21, e.gen);
            memcpy(msg + 29, p + i * ENTRY_BYTES + 20, 4);
            memcpy(msg + 33, e.key, 16);
            kv_mac(&mk, msg, sizeof msg, mac);
            if ((double)e.expiry + skew < now || !kv_equal(mac, e.mac, 16)) bad = i;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&frame);
    PyBuffer_Release(&key);
    return result;
}

/* Sends iov[0..n) whole on a blocking socket: 0, or an errno. */
static int send_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n;
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        while (n > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0 && sent > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

static const uint8_t STATUS_BYTES[2] = {0, 1}; /* EntryStatus OK, MISMATCH */

/* An entry as serve_reads checked it (copied out of the frame, with its segment's base). */
typedef struct {
    uint8_t key[16];
    uint64_t off, len, gen;
    const uint8_t *base;
} served_t;

/* Whether the extent header ``h`` (a copy) at ``e``'s offset is this daemon's seal of its block. */
static int header_names(const uint8_t *h, const served_t *e, const kv_mac_key *seal) {
    if (memcmp(h, "KVB1", 4) != 0 || h[4] != 2 || h[5] != 0) return 0; /* magic, version 2 (u16) */
    if (memcmp(h + 8, e->key, 16) != 0 || kv_load64(h + 24) != e->len || kv_load64(h + 40) != e->gen) return 0;
    uint8_t msg[64], mac[8];
    memcpy(msg, h, 56);
    kv_store64(msg + 56, e->off);
    kv_mac(seal, msg, sizeof msg, mac);
    return kv_equal(mac, h + 56, 8);
}

const char kv_serve_reads_doc[] =
    "serve_reads(fd, head, entries, segment_ids, segment_views, secret) -> (ok, payload_bytes)\n\n"
    "On the blocking socket ``fd``, sends ``head`` (the response head), then answers the entries\n"
    "of a READ frame: per entry, if the extent at its offset in its segment (``segment_views``:\n"
    "the arenas' buffers) holds a header sealed by ``secret`` for that offset naming the entry's\n"
    "key, length and generation, status OK and the payload, else status MISMATCH. Every entry\n"
    "must name a given segment and fit in it (check_reads), else ValueError and nothing is sent.\n"
    "Returns how many were OK and their bytes. Raises OSError (BlockingIOError past the socket's\n"
    "send timeout) if the socket fails.";

PyObject *kv_serve_reads(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer head, frame, secret;
    PyObject *ids, *views;
    if (!PyArg_ParseTuple(args, "iy*y*OOy*", &fd, &head, &frame, &ids, &views, &secret)) return NULL;
    PyObject *result = NULL;
    seg_t segs[MAX_SEGMENTS];
    Py_buffer bufs[MAX_SEGMENTS];
    Py_ssize_t held = 0;
    served_t *es = NULL;
    Py_ssize_t nseg = load_segments(ids, NULL, views, segs, bufs, &held);
    if (nseg < 0) goto done;
    if (frame.len % ENTRY_BYTES != 0) {
        PyErr_SetString(PyExc_ValueError, "entries must be whole 72-byte entries");
        goto done;
    }
    if (secret.len < 1 || secret.len > 64) {
        PyErr_SetString(PyExc_ValueError, "a sealing secret is 1..64 bytes");
        goto done;
    }
    Py_ssize_t n = frame.len / ENTRY_BYTES;
    es = PyMem_Malloc((n ? n : 1) * sizeof(served_t));
    if (es == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every entry is checked before any byte goes (one outside its segment is refused whole),
     * and served from that checked copy, whatever the caller's buffer holds meanwhile. */
    for (Py_ssize_t i = 0; i < n; i++) {
        entry_t e;
        entry_at((const uint8_t *)frame.buf + i * ENTRY_BYTES, &e);
        const seg_t *s = find_seg(segs, nseg, e.seg);
        if (s == NULL || s->size < HEADER_BYTES || e.off > s->size - HEADER_BYTES || e.len > s->size - HEADER_BYTES - e.off) {
            PyErr_Format(PyExc_ValueError, "entry %zd is outside the given segments", i);
            goto done;
        }
        memcpy(es[i].key, e.key, 16);
        es[i].off = e.off;
        es[i].len = e.len;
        es[i].gen = e.gen;
        es[i].base = s->base;
    }
    Py_ssize_t ok = 0;
    unsigned long long bytes = 0;
    int err = 0;
    struct iovec iov[GATHER_IOV];
    kv_mac_key seal;
    Py_BEGIN_ALLOW_THREADS
    kv_mac_init(&seal, (const uint8_t *)secret.buf, (size_t)secret.len, 8);
    int k = 0;
    size_t gathered = 0;
    if (head.len) { /* the response head goes in the first send */
        iov[k].iov_base = head.buf;
        iov[k++].iov_len = (size_t)head.len;
    }
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        const served_t *e = &es[i];
        uint8_t h[HEADER_BYTES];
        memcpy(h, e->base + e->off, HEADER_BYTES); /* a copy: the arena may change under us */
        if (header_names(h, e, &seal)) {
            iov[k].iov_base = (void *)&STATUS_BYTES[0];
            iov[k++].iov_len = 1;
            iov[k].iov_base = (void *)(e->base + e->off + HEADER_BYTES);
            iov[k++].iov_len = (size_t)e->len;
            gathered += (size_t)e->len;
            bytes += e->len;
            ok++;
        } else {
            iov[k].iov_base = (void *)&STATUS_BYTES[1];
            iov[k++].iov_len = 1;
        }
        if (gathered >= GATHER_BYTES || k >= GATHER_IOV - 1) {
            err = send_all(fd, iov, k);
            k = 0;
            gathered = 0;
        }
    }
    if (!err && k) err = send_all(fd, iov, k);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("nK", ok, bytes);
done:
    release_all(bufs, held);
    PyMem_Free(es);
    PyBuffer_Release(&head);
    PyBuffer_Release(&frame);
    PyBuffer_Release(&secret);
    return result;
}

const char kv_blake2b_mac_doc[] =
    "blake2b_mac(key, msg, digest_size) -> bytes\n\n"
    "Keyed BLAKE2b of ``msg`` (1..128 bytes) under ``key`` (1..64 bytes): what check_reads and\n"
    "serve_reads compute, equal to hashlib.blake2b(msg, key=key, digest_size=digest_size).";

PyObject *kv_blake2b_mac(PyObject *self, PyObject *args) {
    Py_buffer key, msg;
    unsigned int outlen;
    if (!PyArg_ParseTuple(args, "y*y*I", &key, &msg, &outlen)) return NULL;
    PyObject *result = NULL;
    if (key.len < 1 || key.len > 64 || msg.len < 1 || msg.len > 128 || outlen < 1 || outlen > 64) {
        PyErr_SetString(PyExc_ValueError, "key 1..64 bytes, message 1..128 bytes, digest 1..64 bytes");
    } else {
        kv_mac_key k;
        uint8_t out[64];
        kv_mac_init(&k, (const uint8_t *)key.buf, (size_t)key.len, outlen);
        kv_mac(&k, (const uint8_t *)msg.buf, (size_t)msg.len, out);
        result = PyBytes_FromStringAndSize((const char *)out, outlen);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&msg);
    return result;
}
