// FP4 weight x f32 activation GEMV, the dequantize path every architecture can run (sm_90 has
// no FP4 tensor cores; decode is bandwidth-bound anyway: 0.5625 bytes per NVFP4 weight,
// 0.53125 per MXFP4 weight).
//
//   nvfp4_gemv:   y[r] = scale_2 * sum_c e2m1(W[r][c]) * e4m3(S[r][c/16]) * x[c]
//   mxfp4_gemv:   y[r] =           sum_c e2m1(W[r][c]) * 2^(S[r][c/32]-127) * x[c]
//   *_grouped_gemv: the routed experts of a decode step in one launch. Pair p applies expert
//   pair_expert[p] (experts stacked [E, rows, cols], 64-bit offsets) to token pair_token[p]
//   (x is [tokens, cols]) and writes y[p] ([pairs, rows]); NVFP4 experts have one scale_2 each.
//
// One warp per output row; lane l takes blocks l, l+32, ... and the warp reduces with
// shuffles. CPU references: `kernels::cpu::{nvfp4_gemv, mxfp4_gemv, grouped_gemv}` (f64;
// results agree to f32 rounding of the sum, see the tests' bounds).
#include "fp4.cuh"

#define WARPS_PER_BLOCK 4

// packed: rows * cols / 2 bytes; scales: rows * cols / 16 bytes; cols % 16 == 0.
extern "C" __global__ void nvfp4_gemv(const uint8_t* __restrict__ packed,
                                      const uint8_t* __restrict__ scales, float scale_2,
                                      const float* __restrict__ x, long long rows, long long cols,
                                      float* __restrict__ y) {
    const long long row =
        static_cast<long long>(blockIdx.x) * WARPS_PER_BLOCK + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const float acc = fp4::warp_row_dot<false>(packed + row * (cols / 2),
                                               scales + row * (cols / 16), x, cols, lane);
    if (lane == 0) {
        y[row] = acc * scale_2;
    }
}

// packed: rows * cols / 2 bytes; scales: rows * cols / 32 bytes; cols % 32 == 0.
extern "C" __global__ void mxfp4_gemv(const uint8_t* __restrict__ packed,
                                      const uint8_t* __restrict__ scales,
                                      const float* __restrict__ x, long long rows, long long cols,
                                      float* __restrict__ y) {
    const long long row =
        static_cast<long long>(blockIdx.x) * WARPS_PER_BLOCK + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const float acc = fp4::warp_row_dot<true>(packed + row * (cols / 2),
                                              scales + row * (cols / 32), x, cols, lane);
    if (lane == 0) {
        y[row] = acc;
    }
}

// Grid: x covers rows (WARPS_PER_BLOCK per block), y is the pair. A pair whose expert or token
// index lies outside [0, experts) or [0, tokens) is never read through: its output rows are
// NaN (the indices come from the host and are not trusted to address memory).
template <bool MX>
__device__ __forceinline__ void grouped_gemv(const uint8_t* __restrict__ packed,
                                             const uint8_t* __restrict__ scales,
                                             const float* __restrict__ scale_2,
                                             const float* __restrict__ x,
                                             const int* __restrict__ pair_token,
                                             const int* __restrict__ pair_expert,
                                             long long rows, long long cols,
                                             long long experts, long long tokens,
                                             float* __restrict__ y) {
    constexpr long long BLOCK = MX ? 32 : 16;
    const long long pair = blockIdx.y;
    const long long row =
        static_cast<long long>(blockIdx.x) * WARPS_PER_BLOCK + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const long long expert = pair_expert[pair];
    const long long token = pair_token[pair];
    if (expert < 0 || expert >= experts || token < 0 || token >= tokens) {
        if (lane == 0) {
            y[pair * rows + row] = NAN;
        }
        return;
    }
    const long long first_row = expert * rows + row;  // rows of all experts, stacked
    const float acc = fp4::warp_row_dot<MX>(packed + first_row * (cols / 2),
                                            scales + first_row * (cols / BLOCK),
                                            x + token * cols, cols, lane);
    if (lane == 0) {
        y[pair * rows + row] = MX ? acc : acc * scale_2[expert];
    }
}

extern "C" __global__ void nvfp4_grouped_gemv(const uint8_t* __restrict__ packed,
                                              const uint8_t* __restrict__ scales,
                                              const float* __restrict__ scale_2,
                                              const float* __restrict__ x,
                                              const int* __restrict__ pair_token,
                                              const int* __restrict__ pair_expert,
                                              long long rows, long long cols,
                                              long long experts, long long tokens,
                                              float* __restrict__ y) {
    grouped_gemv<false>(packed, scales, scale_2, x, pair_token, pair_expert, rows, cols, experts,
                        tokens, y);
}

extern "C" __global__ void mxfp4_grouped_gemv(const uint8_t* __restrict__ packed,
                                              const uint8_t* __restrict__ scales,
                                              const float* __restrict__ x,
                                              const int* __restrict__ pair_token,
                                              const int* __restrict__ pair_expert,
                                              long long rows, long long cols,
                                              long long experts, long long tokens,
                                              float* __restrict__ y) {
    grouped_gemv<true>(packed, scales, nullptr, x, pair_token, pair_expert, rows, cols, experts,
                       tokens, y);
}
