// Grouping a chunk's (token, expert) pairs by expert for the grouped GEMMs, on the device (so
// the routing never leaves it and a graph can capture the step):
//   moe_zero      counts = 0
//   moe_count     counts[e] = pairs routed to e (pairs with an expert outside 0..experts are
//                 left out: they get no output, and the caller's NaN-filled output shows them)
//   moe_align     per expert ceil(counts[e] / 64) tiles, tile_starts (prefix), tile_expert,
//                 tile_count; every slot of those tiles set to -1; cursors zeroed
//   moe_scatter   each pair into the next free slot of its expert's tiles
// The order of pairs inside an expert's tiles depends on the atomics' arrival; no result does
// (each pair's row is computed from its own token and expert alone). At most
// ceil(pairs / 64) + experts tiles. `kernels::emulate::moe_grouped_gemm` is these kernels and
// the GEMM in Rust, with the arrival order as a parameter.
#include <stdint.h>

#define TILE_ROWS 64

extern "C" __global__ void moe_zero(int* __restrict__ counts, int experts) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < experts) {
        counts[e] = 0;
    }
}

extern "C" __global__ void moe_count(const int* __restrict__ pair_expert, int pairs, int experts,
                                     int* __restrict__ counts) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < pairs) {
        const int e = pair_expert[p];
        if (e >= 0 && e < experts) {
            atomicAdd(&counts[e], 1);
        }
    }
}

// One block: thread 0 lays out the tiles, then every thread clears their slots.
extern "C" __global__ void moe_align(const int* __restrict__ counts, int experts,
                                     int* __restrict__ tile_starts,   // [experts + 1]
                                     int* __restrict__ tile_expert,   // [max tiles]
                                     int* __restrict__ tile_count, int* __restrict__ cursor,
                                     int* __restrict__ sorted_pair) {  // [max tiles * 64]
    __shared__ int total;
    if (threadIdx.x == 0) {
        int t = 0;
        for (int e = 0; e < experts; ++e) {
            tile_starts[e] = t;
            const int tiles = (counts[e] + TILE_ROWS - 1) / TILE_ROWS;
            for (int i = 0; i < tiles; ++i) {
                tile_expert[t + i] = e;
            }
            t += tiles;
        }
        tile_starts[experts] = t;
        *tile_count = t;
        total = t;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        cursor[e] = 0;
    }
    const long long slots = static_cast<long long>(total) * TILE_ROWS;
    for (long long i = threadIdx.x; i < slots; i += blockDim.x) {
        sorted_pair[i] = -1;
    }
}

extern "C" __global__ void moe_scatter(const int* __restrict__ pair_expert, int pairs, int experts,
                                       const int* __restrict__ tile_starts,
                                       int* __restrict__ cursor, int* __restrict__ sorted_pair) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < pairs) {
        const int e = pair_expert[p];
        if (e >= 0 && e < experts) {
            const int slot = atomicAdd(&cursor[e], 1);
            sorted_pair[static_cast<long long>(tile_starts[e]) * TILE_ROWS + slot] = p;
        }
    }
}

// out[i] = NaN for i < len: the grouped GEMM's output before a step, so a pair it does not
// write (an expert index outside the model) shows as NaN, not as a stale row.
extern "C" __global__ void fill_nan(float* __restrict__ out, long long len) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < len) {
        out[i] = __int_as_float(0x7fc00000);
    }
}
