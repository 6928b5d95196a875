// Runs cuda/kv_copy.cu's kernels on the CPU, one thread at a time, to check their index
// arithmetic (rows, chunks, head/tail, grid-stride loops) against torch on any machine.
//
// The kernels use no shared memory, no barriers and no inter-thread communication: each thread
// copies its own bytes, so running the threads of a launch one after another produces exactly
// what the GPU produces. Built by tests/gpu/test_kernel_emulation.py with the host compiler:
//
//     g++ -std=c++17 -O1 -shared -fPIC -o kv_copy_host.so tests/gpu/kv_copy_host.cpp

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)

struct dim3 {
    unsigned int x, y, z;
};
struct uint4 {
    unsigned int x, y, z, w;
};

static dim3 threadIdx, blockIdx, blockDim, gridDim;

#include "../../cuda/kv_copy.cu"

typedef void (*blocks_fn)(unsigned char*, unsigned char*, const void*, long long, long long, long long);
typedef void (*layer_fn)(unsigned char*, unsigned char*, const void*, long long, long long, long long, long long,
                         long long);

// Runs `fn` over grid (gx, gy) x block (bx) with the arguments of engine.kv_copy.launch_plan.
extern "C" int kv_emulate(void* fn, int nargs, unsigned int gx, unsigned int gy, unsigned int bx,
                          const long long* a) {
    if (nargs != 6 && nargs != 8) return -1;
    gridDim = {gx, gy, 1};
    blockDim = {bx, 1, 1};
    for (unsigned int y = 0; y < gy; ++y)
        for (unsigned int x = 0; x < gx; ++x)
            for (unsigned int t = 0; t < bx; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                unsigned char* cache = reinterpret_cast<unsigned char*>(a[0]);
                unsigned char* staging = reinterpret_cast<unsigned char*>(a[1]);
                const void* ids = reinterpret_cast<const void*>(a[2]);
                if (nargs == 6)
                    reinterpret_cast<blocks_fn>(fn)(cache, staging, ids, a[3], a[4], a[5]);
                else
                    reinterpret_cast<layer_fn>(fn)(cache, staging, ids, a[3], a[4], a[5], a[6], a[7]);
            }
    return 0;
}
