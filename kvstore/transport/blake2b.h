/* Keyed BLAKE2b (RFC 7693) for short messages, as the daemon's native read serving checks
 * them: a data-port ticket's MAC (kvstore.tickets: BLAKE2b-128 of 49 bytes under the ticket key)
 * and an extent header's seal (kvstore.extent: BLAKE2b-64 of 64 bytes under the daemon's
 * secret). Both equal hashlib.blake2b(msg, key=key, digest_size=n). The key block is hashed
 * once per key (kv_mac_init); each MAC is then one compression of its one message block. */
#ifndef KV_BLAKE2B_H
#define KV_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static const uint64_t KV_B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* The message schedule of the 10 distinct rounds; rounds 10 and 11 repeat rounds 0 and 1. */
static const uint8_t KV_B2_SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t kv_load64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline void kv_store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t kv_rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

#define KV_B2_G(a, b, c, d, x, y)              \
    do {                                       \
        v[a] = v[a] + v[b] + (x);              \
        v[d] = kv_rotr64(v[d] ^ v[a], 32);     \
        v[c] = v[c] + v[d];                    \
        v[b] = kv_rotr64(v[b] ^ v[c], 24);     \
        v[a] = v[a] + v[b] + (y);              \
        v[d] = kv_rotr64(v[d] ^ v[a], 16);     \
        v[c] = v[c] + v[d];                    \
        v[b] = kv_rotr64(v[b] ^ v[c], 63);     \
    } while (0)

/* The compression function F: ``t`` bytes hashed so far (this block included), ``last``. */
static void kv_b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = kv_load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = KV_B2_IV[i];
    }
    v[12] ^= t; /* the counter's high word stays 0: messages here are short */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = KV_B2_SIGMA[r % 10];
        KV_B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        KV_B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        KV_B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        KV_B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        KV_B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        KV_B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        KV_B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        KV_B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* A key's state after its key block, for MACs of ``outlen`` bytes (1..64). */
typedef struct {
    uint64_t h[8];
    unsigned outlen;
} kv_mac_key;

/* ``keylen`` 1..64 bytes. */
static void kv_mac_init(kv_mac_key *k, const uint8_t *key, size_t keylen, unsigned outlen) {
    uint8_t block[128] = {0};
    memcpy(block, key, keylen);
    for (int i = 0; i < 8; i++) k->h[i] = KV_B2_IV[i];
    k->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ outlen;
    kv_b2_compress(k->h, block, 128, 0);
    k->outlen = outlen;
}

/* The MAC of ``msg`` (1..128 bytes) into ``out`` (k->outlen bytes). */
static inline void kv_mac(const kv_mac_key *k, const uint8_t *msg, size_t len, uint8_t *out) {
    uint64_t h[8];
    uint8_t block[128] = {0};
    uint8_t full[64];
    memcpy(h, k->h, sizeof h);
    memcpy(block, msg, len);
    kv_b2_compress(h, block, 128 + (uint64_t)len, 1);
    for (int i = 0; i < 8; i++) kv_store64(full + 8 * i, h[i]);
    memcpy(out, full, k->outlen);
}

/* Equal, in time that does not depend on where they differ. */
static inline int kv_equal(const uint8_t *a, const uint8_t *b, size_t n) {
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++) d |= a[i] ^ b[i];
    return d == 0;
}

#endif
