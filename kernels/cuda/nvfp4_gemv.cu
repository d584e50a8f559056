// NVFP4 weight x f32 activation GEMV: y[r] = sum_c W[r][c] * x[c], with
// W[r][c] = e2m1(code[r][c]) * e4m3(block_scale[r][c/16]) * scale_2 (ModelOpt NVFP4, the even
// element in the low nibble). This is the dequantize path every architecture can run (sm_90
// has no FP4 tensor cores); it reads 0.5625 bytes per weight and is bandwidth-bound.
//
// One warp per output row. Lane l handles 16-element blocks l, l+32, ... of the row; partial
// sums are reduced over the warp with shuffles. The CPU reference is
// `kernels::cpu::nvfp4_gemv` (same products, different summation order: results agree to
// f32 rounding, see the test's bound).
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float e2m1_value(uint32_t code) {
    // bit 3 sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    // Computed, not looked up: a local table would live on the stack.
    const uint32_t idx = code & 7u;
    const float m = idx < 4u ? 0.5f * static_cast<float>(idx)
                             : (idx == 7u ? 6.0f : static_cast<float>(idx) - 2.0f);
    return (code & 8u) ? -m : m;
}

__device__ __forceinline__ float e4m3_value(uint8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
    return __half2float(__half(h));
}

}  // namespace

// packed: rows * cols / 2 bytes; scales: rows * cols / 16 bytes; cols % 16 == 0.
extern "C" __global__ void nvfp4_gemv(const uint8_t* __restrict__ packed,
                                      const uint8_t* __restrict__ scales, float scale_2,
                                      const float* __restrict__ x, long long rows, long long cols,
                                      float* __restrict__ y) {
    const long long warps_per_block = blockDim.x / 32;
    const long long row = static_cast<long long>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const long long blocks = cols / 16;
    const uint8_t* row_codes = packed + row * (cols / 2);
    const uint8_t* row_scales = scales + row * blocks;
    float acc = 0.0f;
    for (long long b = lane; b < blocks; b += 32) {
        const float s = e4m3_value(row_scales[b]);
        const float* xb = x + b * 16;
        float part = 0.0f;
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t byte = row_codes[b * 8 + i];
            part += e2m1_value(byte & 0xFu) * xb[2 * i];
            part += e2m1_value(byte >> 4) * xb[2 * i + 1];
        }
        acc += part * s;
    }
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    if (lane == 0) {
        y[row] = acc * scale_2;
    }
}
