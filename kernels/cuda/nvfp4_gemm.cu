// NVFP4 weight GEMM on tensor cores, the dequantize-to-bf16 path (sm_90 has no FP4 tensor
// cores; it also runs on sm_100 and sm_120):
//
//   C[i][j] = scale_2 * sum_k bf16(A[i][k]) * e2m1(W[j][k]) * e4m3(S[j][k/16])
//
// A is f32 [m, k] row-major (prefill activations), W the NVFP4 weight [n, k] (ModelOpt layout,
// as `nvfp4_gemv` reads it), C f32 [m, n]. A is rounded to bf16 (round-to-nearest-even) on its
// way into shared memory; each weight is dequantized exactly (an e2m1 value times an e4m3 scale
// has at most 6 significant bits, so it is a bf16 without rounding); products are exact and
// the tensor cores accumulate in f32; scale_2 multiplies the f32 sums. The CPU reference is
// `kernels::cpu::nvfp4_gemm` (f64 over the same bf16 activations).
//
// Tiling: a 128-thread block computes a 64 x 64 tile of C; each of its 4 warps a 32 x 32
// quarter with 2 x 2 WMMA 16x16x16 bf16 fragments. The K loop stages a 64 x 32 slice of A and
// of the dequantized W in shared memory. Any m and n work (edges are zero-padded in shared
// memory and masked on store); k must be a multiple of 16 (one NVFP4 block). On sm_90a the
// `*_wgmma` kernels compute the same tiles on Hopper's warpgroup MMA (`wgmma.cuh`).
#include <cuda_bf16.h>
#include <mma.h>

#include "fp4.cuh"
#include "wgmma.cuh"

using namespace nvcuda;

namespace {
constexpr int BM = 64;
constexpr int BN = 64;
constexpr int BK = 32;
constexpr int LDS = BK + 8;  // padded row (bf16 elements): a multiple of 8, as WMMA requires
constexpr int THREADS = 128;
}  // namespace

// The 16 values of W's block at (row gn, columns gk..gk + 16), dequantized to bf16 into
// `dst`; zeros past n or k.
template <bool MX>
__device__ __forceinline__ void w_block(const uint8_t* __restrict__ packed,
                                        const uint8_t* __restrict__ scales, long long n,
                                        long long k, long long gn, long long gk,
                                        __nv_bfloat16* dst) {
    if (gn < n && gk < k) {
        const float s = MX ? fp4::e8m0_value(scales[gn * (k / 32) + gk / 32])
                           : fp4::e4m3_value(scales[gn * (k / 16) + gk / 16]);
        const uint8_t* codes = packed + gn * (k / 2) + gk / 2;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t byte = codes[i];
            dst[2 * i] = __float2bfloat16_rn(fp4::e2m1_value(byte & 0xFu) * s);
            dst[2 * i + 1] = __float2bfloat16_rn(fp4::e2m1_value(byte >> 4) * s);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            dst[i] = __float2bfloat16_rn(0.0f);
        }
    }
}

// The block's 64 x 64 tile of C: rows `a_row[r]` of A (-1: a zero row) times weight rows
// col0.. of W, stored to rows `c_row[r]` of C (-1: not stored). Both row maps are in shared
// memory, written by the caller before a barrier. A row's results depend only on its own A row
// and W (each output is its own dot product), not on the tile's other rows. `MX`: W is MXFP4
// (a ue8m0 scale per 32 values, `scale_2` 1), else NVFP4 (an e4m3 scale per 16); either
// product of an e2m1 value and its scale is a bf16 without rounding.
template <bool MX>
__device__ __forceinline__ void gemm_tile(const float* __restrict__ a, const long long* a_row,
                                          const uint8_t* __restrict__ packed,
                                          const uint8_t* __restrict__ scales, float scale_2,
                                          long long n, long long k, long long col0,
                                          float* __restrict__ c, const long long* c_row) {
    __shared__ __align__(32) __nv_bfloat16 tile_a[BM][LDS];
    __shared__ __align__(32) __nv_bfloat16 tile_w[BN][LDS];
    __shared__ __align__(32) float stage[THREADS / 32][32][32];

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int warp_m = warp / 2;
    const int warp_n = warp % 2;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            wmma::fill_fragment(acc[i][j], 0.0f);
        }
    }

    for (long long k0 = 0; k0 < k; k0 += BK) {
        // A slice: 64 x 32 values, 16 per thread, coalesced along k.
        for (int e = tid; e < BM * BK; e += THREADS) {
            const int r = e / BK;
            const int kk = e % BK;
            const long long gr = a_row[r];
            const long long gk = k0 + kk;
            const float v = (gr >= 0 && gk < k) ? a[gr * k + gk] : 0.0f;
            tile_a[r][kk] = __float2bfloat16_rn(v);
        }
        // W slice: 64 rows x 2 NVFP4 blocks; one block (8 bytes, 16 values) per thread.
        w_block<MX>(packed, scales, n, k, col0 + tid / 2, k0 + (tid % 2) * 16,
                    &tile_w[tid / 2][(tid % 2) * 16]);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            // W is [n, k] row-major, i.e. the k x n operand B in column-major order.
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                wmma::load_matrix_sync(fa[i], &tile_a[warp_m * 32 + i * 16][kk], LDS);
                wmma::load_matrix_sync(fb[i], &tile_w[warp_n * 32 + i * 16][kk], LDS);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
                }
            }
        }
        __syncthreads();
    }

    // Through shared memory, so edge tiles store only their valid part.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            wmma::store_matrix_sync(&stage[warp][i * 16][j * 16], acc[i][j], 32,
                                    wmma::mem_row_major);
        }
    }
    __syncwarp();
    for (int e = lane; e < 32 * 32; e += 32) {
        const int r = e / 32;
        const int col = e % 32;
        const long long gr = c_row[warp_m * 32 + r];
        const long long gc = col0 + warp_n * 32 + col;
        if (gr >= 0 && gc < n) {
            c[gr * n + gc] = stage[warp][r][col] * scale_2;
        }
    }
}

// The same tile on Hopper's warpgroup MMA (`wgmma.cuh`, sm_90a; it traps elsewhere): the same
// bf16 values staged in the tensor core's core-matrix layout, double-buffered, one m64n64k16
// MMA per 16 k.
template <bool MX>
__device__ __forceinline__ void gemm_tile_wgmma(const float* __restrict__ a,
                                                const long long* a_row,
                                                const uint8_t* __restrict__ packed,
                                                const uint8_t* __restrict__ scales,
                                                float scale_2, long long n, long long k,
                                                long long col0, float* __restrict__ c,
                                                const long long* c_row) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(BM == wgmma::TILE && BN == wgmma::TILE && BK == wgmma::SLICE,
                  "the tile is one warpgroup MMA tile");
    const int tid = threadIdx.x;
    const auto stage = [&](long long k0, uint8_t* tile_a, uint8_t* tile_w) {
        wgmma::stage_rows(tile_a, a, k, k0, k, [&](int r) { return a_row[r]; });
        // W: one NVFP4 block (16 values) per thread, as two chunks.
        const int r = tid / 2;
        const int blk = tid % 2;
        __align__(16) __nv_bfloat16 v[16];
        w_block<MX>(packed, scales, n, k, col0 + r, k0 + blk * 16, v);
        wgmma::put_chunk(tile_w, r, 2 * blk, v);
        wgmma::put_chunk(tile_w, r, 2 * blk + 1, v + wgmma::CHUNK);
    };
    wgmma::tile(0, k, stage, [&](int r, int col, float value) {
        const long long gr = c_row[r];
        const long long gc = col0 + col;
        if (gr >= 0 && gc < n) {
            c[gr * n + gc] = value * scale_2;
        }
    });
#else
    __trap();
#endif
}

template <bool MX, bool HOPPER>
__device__ __forceinline__ void any_tile(const float* __restrict__ a, const long long* a_row,
                                         const uint8_t* __restrict__ packed,
                                         const uint8_t* __restrict__ scales, float scale_2,
                                         long long n, long long k, long long col0,
                                         float* __restrict__ c, const long long* c_row) {
    if (HOPPER) {
        gemm_tile_wgmma<MX>(a, a_row, packed, scales, scale_2, n, k, col0, c, c_row);
    } else {
        gemm_tile<MX>(a, a_row, packed, scales, scale_2, n, k, col0, c, c_row);
    }
}

template <bool HOPPER>
__device__ __forceinline__ void plain_gemm(const float* __restrict__ a,
                                           const uint8_t* __restrict__ packed,
                                           const uint8_t* __restrict__ scales, float scale_2,
                                           long long m, long long n, long long k,
                                           float* __restrict__ c) {
    __shared__ long long rows[BM];
    const long long row0 = static_cast<long long>(blockIdx.y) * BM;
    if (threadIdx.x < BM) {
        const long long r = row0 + threadIdx.x;
        rows[threadIdx.x] = r < m ? r : -1;
    }
    __syncthreads();
    any_tile<false, HOPPER>(a, rows, packed, scales, scale_2, n, k,
                            static_cast<long long>(blockIdx.x) * BN, c, rows);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    nvfp4_gemm_bf16(const float* __restrict__ a, const uint8_t* __restrict__ packed,
                    const uint8_t* __restrict__ scales, float scale_2, long long m, long long n,
                    long long k, float* __restrict__ c) {
    plain_gemm<false>(a, packed, scales, scale_2, m, n, k, c);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    nvfp4_gemm_bf16_wgmma(const float* __restrict__ a, const uint8_t* __restrict__ packed,
                          const uint8_t* __restrict__ scales, float scale_2, long long m,
                          long long n, long long k, float* __restrict__ c) {
    plain_gemm<true>(a, packed, scales, scale_2, m, n, k, c);
}

// The routed experts of a prefill chunk as one grouped GEMM: block (tile, column block) takes
// the up to 64 pairs `sorted_pair[tile * 64 ..]` of expert `tile_expert[tile]` (see
// `moe_align.cu`; -1 pads a tile), gathers their tokens' rows of A, and writes each pair's
// output row `c[pair]`: out[p][j] = scale_2[e] * sum_k bf16(A[token(p)][k]) * W_e[j][k].
// Experts are stacked `[experts, n, k]` (codes `k / 2` bytes per row; NVFP4 e4m3 scales
// `k / 16` and a `scale_2` per expert, MXFP4 ue8m0 scales `k / 32` and no `scale_2`). Blocks
// past `*tile_count` return at once, so the grid can be sized for the most tiles.
template <bool MX, bool HOPPER>
__device__ __forceinline__ void grouped_tile(const float* __restrict__ a,
                                             const int* __restrict__ pair_token,
                                             const int* __restrict__ sorted_pair,
                                             const int* __restrict__ tile_expert,
                                             const int* __restrict__ tile_count,
                                             const uint8_t* __restrict__ packed,
                                             const uint8_t* __restrict__ scales,
                                             const float* __restrict__ scale_2, long long n,
                                             long long k, float* __restrict__ c) {
    __shared__ long long a_rows[BM];
    __shared__ long long c_rows[BM];
    const int tile = blockIdx.x;
    if (tile >= *tile_count) {
        return;
    }
    const long long e = tile_expert[tile];
    if (threadIdx.x < BM) {
        const int p = sorted_pair[static_cast<long long>(tile) * BM + threadIdx.x];
        a_rows[threadIdx.x] = p >= 0 ? pair_token[p] : -1;
        c_rows[threadIdx.x] = p;
    }
    __syncthreads();
    const long long block = MX ? 32 : 16;
    any_tile<MX, HOPPER>(a, a_rows, packed + e * n * (k / 2), scales + e * n * (k / block),
                         MX ? 1.0f : scale_2[e], n, k, static_cast<long long>(blockIdx.y) * BN,
                         c, c_rows);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    nvfp4_grouped_gemm_bf16(const float* __restrict__ a, const int* __restrict__ pair_token,
                            const int* __restrict__ sorted_pair,
                            const int* __restrict__ tile_expert,
                            const int* __restrict__ tile_count,
                            const uint8_t* __restrict__ packed,
                            const uint8_t* __restrict__ scales,
                            const float* __restrict__ scale_2, long long n, long long k,
                            float* __restrict__ c) {
    grouped_tile<false, false>(a, pair_token, sorted_pair, tile_expert, tile_count, packed,
                               scales, scale_2, n, k, c);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    nvfp4_grouped_gemm_bf16_wgmma(const float* __restrict__ a, const int* __restrict__ pair_token,
                                  const int* __restrict__ sorted_pair,
                                  const int* __restrict__ tile_expert,
                                  const int* __restrict__ tile_count,
                                  const uint8_t* __restrict__ packed,
                                  const uint8_t* __restrict__ scales,
                                  const float* __restrict__ scale_2, long long n, long long k,
                                  float* __restrict__ c) {
    grouped_tile<false, true>(a, pair_token, sorted_pair, tile_expert, tile_count, packed,
                              scales, scale_2, n, k, c);
}

// The same for MXFP4 experts (`k` a multiple of 32).
extern "C" __global__ void __launch_bounds__(THREADS)
    mxfp4_grouped_gemm_bf16(const float* __restrict__ a, const int* __restrict__ pair_token,
                            const int* __restrict__ sorted_pair,
                            const int* __restrict__ tile_expert,
                            const int* __restrict__ tile_count,
                            const uint8_t* __restrict__ packed,
                            const uint8_t* __restrict__ scales, long long n, long long k,
                            float* __restrict__ c) {
    grouped_tile<true, false>(a, pair_token, sorted_pair, tile_expert, tile_count, packed,
                              scales, nullptr, n, k, c);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    mxfp4_grouped_gemm_bf16_wgmma(const float* __restrict__ a, const int* __restrict__ pair_token,
                                  const int* __restrict__ sorted_pair,
                                  const int* __restrict__ tile_expert,
                                  const int* __restrict__ tile_count,
                                  const uint8_t* __restrict__ packed,
                                  const uint8_t* __restrict__ scales, long long n, long long k,
                                  float* __restrict__ c) {
    grouped_tile<true, true>(a, pair_token, sorted_pair, tile_expert, tile_count, packed,
                             scales, nullptr, n, k, c);
}
