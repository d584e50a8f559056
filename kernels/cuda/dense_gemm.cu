// Dense-weight GEMM on tensor cores for the attention, shared-expert and output-head linears:
// every weight byte is read once per 64 activation rows (a decode step of up to 64 sequences
// reads each weight once, where a GEMV per vector reads it once per vector).
//
//   C[i][j] = sum_k bf16(A[i][k]) * bf16(W(row0 + j, k))
//
// A is f32 [m, k] row-major (the step's activations), rounded to bf16 (round-to-nearest-even)
// on its way into shared memory. W is rows `row0..row0 + n` of a weight with `k` columns, in
// the engine's stored forms: bf16 (used as is), or e4m3 codes with an f32 scale per 128 x 128
// tile, dequantized as `bf16(f32(e4m3 * scale))` (exact for the checkpoints' ue8m0 scales,
// which are powers of two). The tensor cores multiply exactly and accumulate in f32. The CPU
// reference is `kernels::cpu::dense_gemm` (f64 over the same bf16 operands).
//
// Tiling: a 128-thread block computes a 64 x 64 tile of C; each of its 4 warps a 32 x 32
// quarter with 2 x 2 WMMA 16x16x16 bf16 fragments; the K loop stages a 64 x 32 slice of A and
// of the dequantized W in shared memory. A fragment row band with no row of A below m computes
// nothing (a decode step of a few sequences multiplies no padding). Any m, n, k and row0 work
// (edges are zero-padded in shared memory and masked on store).
//
// Split K: grid z is the split; split s covers k in [s * k_split, (s + 1) * k_split) and
// writes its partial tile to `c + s * m * n` (k_split is a multiple of the 32-wide slice).
// `sum_splits` adds the partials in split order, so the result does not depend on which block
// finishes first. The host picks the split count from the shape alone (`dense_gemm_splits`),
// so a step replayed as a graph sums in the same order. `kernels::emulate::dense_gemm` is this
// file's index math in Rust, checked in CI against the CPU reference.
#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

#include "fp4.cuh"
#include "wgmma.cuh"

using namespace nvcuda;

namespace {
constexpr int BM = 64;
constexpr int BN = 64;
constexpr int BK = 32;
constexpr int LDS = BK + 8;  // padded row (bf16 elements): a multiple of 8, as WMMA requires
constexpr int THREADS = 128;

enum Format { BF16 = 1, FP8_BLOCK = 2 };

// W(gn, c) as an f32 (exactly the bf16 the tile takes, before rounding), for a weight with
// `k` columns.
template <int FMT>
__device__ __forceinline__ float w_value(const float* __restrict__ scales, long long gn,
                                         long long c, long long k, uint32_t bits) {
    if (FMT == BF16) {
        return __uint_as_float(bits << 16);
    }
    const long long tiles = (k + 127) / 128;
    return __fmul_rn(fp4::e4m3_value(bits), scales[(gn / 128) * tiles + c / 128]);
}

// Stages W's 16 values at (row `gn`, columns gk..gk + 16) of a weight with `k` columns into
// `dst`, zeros at and past column `k_end`. Whole aligned runs are read as 16-byte vectors.
template <int FMT>
__device__ __forceinline__ void stage_w(const uint8_t* __restrict__ w,
                                        const float* __restrict__ scales, long long gn,
                                        long long gk, long long k, long long k_end,
                                        __nv_bfloat16* dst) {
    constexpr int BYTES = FMT == BF16 ? 2 : 1;
    const long long at = gn * k + gk;  // element index
    if (gk + 16 <= k_end && (at * BYTES) % 16 == 0) {
        uint4 raw[BYTES];
#pragma unroll
        for (int v = 0; v < BYTES; ++v) {
            raw[v] = reinterpret_cast<const uint4*>(w + at * BYTES)[v];
        }
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(raw);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint32_t bits = FMT == BF16
                                      ? static_cast<uint32_t>(bytes[2 * i]) |
                                            (static_cast<uint32_t>(bytes[2 * i + 1]) << 8)
                                      : bytes[i];
            dst[i] = __float2bfloat16_rn(w_value<FMT>(scales, gn, gk + i, k, bits));
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const long long c = gk + i;
        float v = 0.0f;
        if (c < k_end) {
            const uint32_t bits =
                FMT == BF16 ? reinterpret_cast<const uint16_t*>(w)[gn * k + c] : w[gn * k + c];
            v = w_value<FMT>(scales, gn, c, k, bits);
        }
        dst[i] = __float2bfloat16_rn(v);
    }
}

// The block's 64 x 64 tile of C (rows m0.., columns col0..) over k in [k_begin, k_end).
template <int FMT>
__device__ __forceinline__ void dense_tile(const float* __restrict__ a, long long m,
                                           const uint8_t* __restrict__ w,
                                           const float* __restrict__ scales, long long row0,
                                           long long n, long long k, long long k_begin,
                                           long long k_end, long long m0, long long col0,
                                           float* __restrict__ c) {
    __shared__ __align__(32) __nv_bfloat16 tile_a[BM][LDS];
    __shared__ __align__(32) __nv_bfloat16 tile_w[BN][LDS];
    __shared__ __align__(32) float stage[THREADS / 32][32][32];

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int warp_m = warp / 2;
    const int warp_n = warp % 2;
    // Which of the warp's two 16-row bands hold a row of A (warp-uniform).
    bool live[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        live[i] = m0 + warp_m * 32 + i * 16 < m;
    }

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            wmma::fill_fragment(acc[i][j], 0.0f);
        }
    }

    for (long long k0 = k_begin; k0 < k_end; k0 += BK) {
        // A slice: 64 x 32 values, 16 per thread, coalesced along k.
        for (int e = tid; e < BM * BK; e += THREADS) {
            const int r = e / BK;
            const int kk = e % BK;
            const long long gr = m0 + r;
            const long long gk = k0 + kk;
            const float v = (gr < m && gk < k_end) ? a[gr * k + gk] : 0.0f;
            tile_a[r][kk] = __float2bfloat16_rn(v);
        }
        // W slice: 64 rows x 32 columns; 16 values of one row per thread.
        {
            const int r = tid / 2;
            const int half = tid % 2;
            const long long gn = col0 + r;
            __nv_bfloat16* dst = &tile_w[r][half * 16];
            if (gn < n) {
                stage_w<FMT>(w, scales, row0 + gn, k0 + half * 16, k, k_end, dst);
            } else {
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    dst[i] = __float2bfloat16_rn(0.0f);
                }
            }
        }
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
                if (live[i]) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
                    }
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
        const long long gr = m0 + warp_m * 32 + r;
        const long long gc = col0 + warp_n * 32 + col;
        if (gr < m && gc < n) {
            c[gr * n + gc] = stage[warp][r][col];
        }
    }
}

// The same tile on Hopper's warpgroup MMA (`wgmma.cuh`, sm_90a): the same bf16 values staged
// in the tensor core's core-matrix layout, in two buffers, so that the next slice is staged
// while the MMAs of this one run. The whole 64 x 64 tile is one m64n64k16 MMA per 16 k (no
// live-band skip: a warpgroup MMA has M = 64). Elsewhere it traps (the host launches it on
// sm_90 only).
template <int FMT>
__device__ __forceinline__ void dense_tile_wgmma(const float* __restrict__ a, long long m,
                                                 const uint8_t* __restrict__ w,
                                                 const float* __restrict__ scales,
                                                 long long row0, long long n, long long k,
                                                 long long k_begin, long long k_end,
                                                 long long m0, long long col0,
                                                 float* __restrict__ c) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(BM == wgmma::TILE && BN == wgmma::TILE && BK == wgmma::SLICE,
                  "the tile is one warpgroup MMA tile");
    const int tid = threadIdx.x;
    const auto stage = [&](long long k0, uint8_t* tile_a, uint8_t* tile_w) {
        wgmma::stage_rows(tile_a, a, k, k0, k_end,
                          [&](int r) { return m0 + r < m ? m0 + r : -1LL; });
        // W: 16 values of one row per thread, as two chunks.
        const int r = tid / 2;
        const int half = tid % 2;
        const long long gn = col0 + r;
        __align__(16) __nv_bfloat16 v[16];
        if (gn < n) {
            stage_w<FMT>(w, scales, row0 + gn, k0 + half * 16, k, k_end, v);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                v[i] = __float2bfloat16_rn(0.0f);
            }
        }
        wgmma::put_chunk(tile_w, r, 2 * half, v);
        wgmma::put_chunk(tile_w, r, 2 * half + 1, v + wgmma::CHUNK);
    };
    wgmma::tile(k_begin, k_end, stage, [&](int r, int col, float value) {
        const long long gr = m0 + r;
        const long long gc = col0 + col;
        if (gr < m && gc < n) {
            c[gr * n + gc] = value;
        }
    });
#else
    __trap();
#endif
}

template <int FMT, bool HOPPER>
__device__ __forceinline__ void dense_gemm(const float* a, long long m, const uint8_t* w,
                                           const float* scales, long long row0, long long n,
                                           long long k, long long k_split, float* c) {
    const long long split = blockIdx.z;
    const long long k_begin = split * k_split;
    const long long k_end = k_begin + k_split < k ? k_begin + k_split : k;
    const long long m0 = static_cast<long long>(blockIdx.y) * BM;
    const long long col0 = static_cast<long long>(blockIdx.x) * BN;
    if (HOPPER) {
        dense_tile_wgmma<FMT>(a, m, w, scales, row0, n, k, k_begin, k_end, m0, col0,
                              c + split * m * n);
    } else {
        dense_tile<FMT>(a, m, w, scales, row0, n, k, k_begin, k_end, m0, col0,
                        c + split * m * n);
    }
}
}  // namespace

// bf16 weight bits (`w` holds `(row0 + n) * k` of them).
extern "C" __global__ void __launch_bounds__(THREADS)
    dense_gemm_bf16(const float* __restrict__ a, long long m, const uint8_t* __restrict__ w,
                    long long row0, long long n, long long k, long long k_split,
                    float* __restrict__ c) {
    dense_gemm<BF16, false>(a, m, w, nullptr, row0, n, k, k_split, c);
}

// e4m3 codes with an f32 scale per 128 x 128 tile (`[ceil(rows / 128), ceil(k / 128)]`).
extern "C" __global__ void __launch_bounds__(THREADS)
    dense_gemm_fp8_block(const float* __restrict__ a, long long m,
                         const uint8_t* __restrict__ w, const float* __restrict__ scales,
                         long long row0, long long n, long long k, long long k_split,
                         float* __restrict__ c) {
    dense_gemm<FP8_BLOCK, false>(a, m, w, scales, row0, n, k, k_split, c);
}

// The same two kernels on Hopper's warpgroup MMA (sm_90a; they trap elsewhere).
extern "C" __global__ void __launch_bounds__(THREADS)
    dense_gemm_bf16_wgmma(const float* __restrict__ a, long long m,
                          const uint8_t* __restrict__ w, long long row0, long long n,
                          long long k, long long k_split, float* __restrict__ c) {
    dense_gemm<BF16, true>(a, m, w, nullptr, row0, n, k, k_split, c);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    dense_gemm_fp8_block_wgmma(const float* __restrict__ a, long long m,
                               const uint8_t* __restrict__ w, const float* __restrict__ scales,
                               long long row0, long long n, long long k, long long k_split,
                               float* __restrict__ c) {
    dense_gemm<FP8_BLOCK, true>(a, m, w, scales, row0, n, k, k_split, c);
}

// out[i] = ((parts[0][i] + parts[1][i]) + parts[2][i]) + ..., `splits` partials of `count`
// values each, in split order.
extern "C" __global__ void sum_splits(const float* __restrict__ parts, long long splits,
                                      long long count, float* __restrict__ out) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
         i += stride) {
        float sum = parts[i];
        for (long long s = 1; s < splits; ++s) {
            sum = __fadd_rn(sum, parts[s * count + i]);
        }
        out[i] = sum;
    }
}
