// kv_copy.cu: move KV blocks between the engine's paged cache and contiguous staging buffers.
//
// The paged cache is one contiguous array
//
//     cache[num_blocks][num_layers][2 (k, v)][block_size][num_kv_heads][head_dim]
//
// so block b, all layers, is one contiguous run of `block_bytes` bytes at cache + b * block_bytes,
// and its layer l is a run of `layer_bytes = block_bytes / num_layers` bytes at
// cache + b * block_bytes + l * layer_bytes.
//
// Staging is contiguous: row r (the r-th listed block, or its layer slice) is at
// staging + r * row_bytes. Staging may be device memory or pinned host memory mapped into the
// device's address space (zero-copy); the kernels do not care which, the pointer is the same kind.
//
//   gather  (save):  staging[r] <- cache[ids[r]]            (or cache[ids[r]][layer])
//   scatter (load):  cache[ids[r]] <- staging[r]            (or cache[ids[r]][layer])
//
// Entry points (extern "C", one per operation x granularity x element type x index type):
//
//   kv_gather_blocks_{f16,bf16,f32}_{i32,i64}    whole blocks, all layers, in one launch
//   kv_scatter_blocks_{f16,bf16,f32}_{i32,i64}
//   kv_gather_layer_{f16,bf16,f32}_{i32,i64}     the [layer] slice of each listed block
//   kv_scatter_layer_{f16,bf16,f32}_{i32,i64}
//
// The copies move bytes: the element type fixes only the alignment contract (every pointer,
// block_bytes and layer_bytes are multiples of the element size; the caller checks this) and
// the width of the scalar fallback. Rows whose source and destination share their alignment
// modulo 16 (the normal case: allocators hand out 256-byte aligned memory and KV rows are
// multiples of 16 bytes) are copied with 16-byte uint4 loads and stores, with a scalar head and
// tail for any unaligned bytes; other rows fall back to element-wide copies.
//
// Launch shape: block = (KV_COPY_THREADS, 1, 1); grid = (chunks per row, rows, 1), where one
// chunk is KV_COPY_THREADS * KV_COPY_UNROLL * 16 bytes. Both grid dimensions are grid-stride
// loops, so any grid is correct (gridDim.y may be capped at 65535 for many rows); the launcher
// sizes it to one chunk per CTA. A block id outside [0, num_blocks) is skipped, never followed:
// the Python wrapper rejects such ids before launching, this is defence in depth.
//
// No headers are included, so the same source compiles with nvcc and with NVRTC (CuPy's
// RawModule) alike.

#define KV_COPY_THREADS 256
#define KV_COPY_UNROLL 4

typedef unsigned short kv_f16_t;   // IEEE half, moved as its 2 bytes
typedef unsigned short kv_bf16_t;  // bfloat16, moved as its 2 bytes
typedef unsigned int kv_f32_t;     // float, moved as its 4 bytes (no float loads: bits stay exact)
typedef unsigned long long kv_uptr_t;

namespace kvcopy {

// One contiguous run of `nbytes` from src to dst, shared by all CTAs with the same blockIdx.y.
template <typename T>
__device__ __forceinline__ void copy_run(unsigned char* __restrict__ dst, const unsigned char* __restrict__ src,
                                         long long nbytes) {
    const long long tid = threadIdx.x;
    const long long nthreads = blockDim.x;
    const unsigned int src_mis = (unsigned int)((kv_uptr_t)src & 15ull);
    const unsigned int dst_mis = (unsigned int)((kv_uptr_t)dst & 15ull);

    if (src_mis == dst_mis) {
        // Head (to the first 16-byte boundary) and tail (after the last one): a few elements,
        // done by the first CTA of the row.
        long long head = (long long)((16u - src_mis) & 15u);
        if (head > nbytes) head = nbytes;
        const long long body = (nbytes - head) & ~15ll;
        const long long tail = head + body;
        if (blockIdx.x == 0) {
            for (long long i = tid * (long long)sizeof(T); i < head; i += nthreads * (long long)sizeof(T))
                *reinterpret_cast<T*>(dst + i) = *reinterpret_cast<const T*>(src + i);
            for (long long i = tail + tid * (long long)sizeof(T); i < nbytes; i += nthreads * (long long)sizeof(T))
                *reinterpret_cast<T*>(dst + i) = *reinterpret_cast<const T*>(src + i);
        }
        const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(src + head);
        uint4* __restrict__ d4 = reinterpret_cast<uint4*>(dst + head);
        const long long nvec = body >> 4;
        const long long per_cta = nthreads * KV_COPY_UNROLL;
        for (long long base = (long long)blockIdx.x * per_cta; base < nvec; base += (long long)gridDim.x * per_cta) {
            // All loads first, then all stores: KV_COPY_UNROLL independent 16-byte requests in
            // flight per thread, which is what keeps HBM (or the host link) busy.
            uint4 v[KV_COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < KV_COPY_UNROLL; ++u) {
                const long long i = base + u * nthreads + tid;
                if (i < nvec) v[u] = s4[i];
            }
#pragma unroll
            for (int u = 0; u < KV_COPY_UNROLL; ++u) {
                const long long i = base + u * nthreads + tid;
                if (i < nvec) d4[i] = v[u];
            }
        }
    } else {
        // Differently misaligned source and destination: element-wide copy.
        const long long n = nbytes / (long long)sizeof(T);
        const T* __restrict__ s = reinterpret_cast<const T*>(src);
        T* __restrict__ d = reinterpret_cast<T*>(dst);
        for (long long i = (long long)blockIdx.x * nthreads + tid; i < n; i += (long long)gridDim.x * nthreads)
            d[i] = s[i];
    }
}

// gather: contig[r] <- paged[ids[r]] (+ paged_offset); scatter: the other way round.
template <typename T, typename Idx, bool kGather>
__device__ __forceinline__ void copy_rows(unsigned char* paged, unsigned char* contig, const Idx* __restrict__ ids,
                                          long long n_rows, long long num_blocks, long long block_bytes,
                                          long long paged_offset, long long row_bytes) {
    for (long long r = blockIdx.y; r < n_rows; r += gridDim.y) {
        const long long b = (long long)ids[r];
        if (b < 0 || b >= num_blocks) continue;  // rejected on the host first; never followed here
        unsigned char* p = paged + b * block_bytes + paged_offset;
        unsigned char* c = contig + r * row_bytes;
        if (kGather)
            copy_run<T>(c, p, row_bytes);
        else
            copy_run<T>(p, c, row_bytes);
    }
}

}  // namespace kvcopy

// Whole blocks: row_bytes = block_bytes.
#define KV_COPY_BLOCKS(NAME, T, IDX, GATHER)                                                                   \
    extern "C" __global__ void __launch_bounds__(KV_COPY_THREADS)                                              \
        NAME(unsigned char* cache, unsigned char* staging, const IDX* __restrict__ ids, long long n_rows,      \
             long long num_blocks, long long block_bytes) {                                                    \
        kvcopy::copy_rows<T, IDX, GATHER>(cache, staging, ids, n_rows, num_blocks, block_bytes, 0ll,           \
                                          block_bytes);                                                        \
    }

// One layer: row_bytes = layer_bytes, the slice at layer * layer_bytes inside each block.
#define KV_COPY_LAYER(NAME, T, IDX, GATHER)                                                                    \
    extern "C" __global__ void __launch_bounds__(KV_COPY_THREADS)                                              \
        NAME(unsigned char* cache, unsigned char* staging, const IDX* __restrict__ ids, long long n_rows,      \
             long long num_blocks, long long block_bytes, long long layer, long long layer_bytes) {            \
        kvcopy::copy_rows<T, IDX, GATHER>(cache, staging, ids, n_rows, num_blocks, block_bytes,                \
                                          layer * layer_bytes, layer_bytes);                                   \
    }

#define KV_COPY_ALL(DT, T, IDXN, IDX)                                  \
    KV_COPY_BLOCKS(kv_gather_blocks_##DT##_##IDXN, T, IDX, true)      \
    KV_COPY_BLOCKS(kv_scatter_blocks_##DT##_##IDXN, T, IDX, false)    \
    KV_COPY_LAYER(kv_gather_layer_##DT##_##IDXN, T, IDX, true)        \
    KV_COPY_LAYER(kv_scatter_layer_##DT##_##IDXN, T, IDX, false)

KV_COPY_ALL(f16, kv_f16_t, i32, int)
KV_COPY_ALL(f16, kv_f16_t, i64, long long)
KV_COPY_ALL(bf16, kv_bf16_t, i32, int)
KV_COPY_ALL(bf16, kv_bf16_t, i64, long long)
KV_COPY_ALL(f32, kv_f32_t, i32, int)
KV_COPY_ALL(f32, kv_f32_t, i64, long long)
