// Dense-weight x f32 activation GEMVs for several vectors: the output head (bf16) and the
// linears of the checkpoint's linear format (bf16, or FP8 e4m3 with 128x128 ue8m0 scales).
//
//   bf16_gemv_many:      y[v][r] = sum_c bf16(W[row0+r][c]) * x[v][c]
//   fp8_block_gemv_many: y[v][r] = sum_c e4m3(W[row0+r][c]) * 2^(S[(row0+r)/128][c/128] - 127)
//                                        * x[v][c]
//   W [total rows, cols], S [ceil(total rows/128), ceil(cols/128)] row-major, x [vectors, cols]
//   f32, y [vectors, rows]: rows row0..row0+rows of W (a block of a grouped projection).
//
// One warp per (row, vector); grid x covers rows (WARPS_PER_BLOCK per block), grid y is the
// vector (the wrapper launches at most 65535 vectors at once). When cols % 8 == 0 each lane
// reads 8 bf16 (16 bytes) at a time, otherwise one at a time; the warp reduces with shuffles.
// 64-bit offsets (a vocabulary-sized head is 129280 x 4096). CPU reference:
// `kernels::cpu::bf16_gemv` / `fp8_block_gemv` (f64 over the exactly dequantized weights;
// results agree to f32 rounding of the sum).
#include <stdint.h>

#include "fp4.cuh"

#define WARPS_PER_BLOCK 4

__device__ __forceinline__ float bf16_value(uint32_t bits) {
    return __uint_as_float(bits << 16);
}

extern "C" __global__ void bf16_gemv_many(const uint16_t* __restrict__ w,
                                          const float* __restrict__ x, long long row0,
                                          long long rows, long long cols,
                                          float* __restrict__ y) {
    const long long row =
        static_cast<long long>(blockIdx.x) * WARPS_PER_BLOCK + threadIdx.x / 32;
    const long long vector = blockIdx.y;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const uint16_t* wr = w + (row0 + row) * cols;
    const float* xv = x + vector * cols;
    float acc = 0.0f;
    if (cols % 8 == 0) {
        for (long long c = 8LL * lane; c < cols; c += 8 * 32) {
            const uint4 packed = *reinterpret_cast<const uint4*>(wr + c);
            const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc += bf16_value(words[i] & 0xFFFFu) * xv[c + 2 * i];
                acc += bf16_value(words[i] >> 16) * xv[c + 2 * i + 1];
            }
        }
    } else {
        for (long long c = lane; c < cols; c += 32) {
            acc += bf16_value(wr[c]) * xv[c];
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_down_sync(0xFFFFFFFFu, acc, offset);
    }
    if (lane == 0) {
        y[vector * rows + row] = acc;
    }
}

// The FP8 weight is read one byte per element (any cols); each weight is exact in f32
// (e4m3 times a power of two), so only the sum's rounding differs from the reference.
extern "C" __global__ void fp8_block_gemv_many(const uint8_t* __restrict__ w,
                                               const uint8_t* __restrict__ scales,
                                               const float* __restrict__ x, long long row0,
                                               long long rows, long long cols,
                                               float* __restrict__ y) {
    const long long row =
        static_cast<long long>(blockIdx.x) * WARPS_PER_BLOCK + threadIdx.x / 32;
    const long long vector = blockIdx.y;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const long long tile_cols = (cols + 127) / 128;
    const uint8_t* wr = w + (row0 + row) * cols;
    const uint8_t* sr = scales + ((row0 + row) / 128) * tile_cols;
    const float* xv = x + vector * cols;
    float acc = 0.0f;
    for (long long c = lane; c < cols; c += 32) {
        acc += fp4::e4m3_value(wr[c]) * fp4::e8m0_value(sr[c / 128]) * xv[c];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_down_sync(0xFFFFFFFFu, acc, offset);
    }
    if (lane == 0) {
        y[vector * rows + row] = acc;
    }
}
