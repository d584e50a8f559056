// FP4 decoding shared by the kernels: e2m1 element codes (ModelOpt NVFP4 and OCP MXFP4, the
// even element in the low nibble), e4m3 block scales (NVFP4, per 16) and ue8m0 block scales
// (MXFP4, per 32). Computed, not looked up: a local table would live on the stack.
#pragma once
#include <cuda_fp8.h>
#include <stdint.h>

namespace fp4 {

// bit 3 sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6]
__device__ __forceinline__ float e2m1_value(uint32_t code) {
    const uint32_t idx = code & 7u;
    const float m = idx < 4u ? 0.5f * static_cast<float>(idx)
                             : (idx == 7u ? 6.0f : static_cast<float>(idx) - 2.0f);
    return (code & 8u) ? -m : m;
}

__device__ __forceinline__ float e4m3_value(uint8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
    return __half2float(__half(h));
}

// 2^(code - 127); code 255 is NaN (OCP MX).
__device__ __forceinline__ float e8m0_value(uint8_t code) {
    if (code == 255u) {
        return __int_as_float(0x7fc00000);
    }
    if (code == 0u) {
        return __int_as_float(0x00400000);  // 2^-127, a subnormal
    }
    return __int_as_float(static_cast<int>(code) << 23);
}

// sum_i e2m1(codes[i]) * x[i] over one block of 2 * BYTES elements (unscaled).
template <int BYTES>
__device__ __forceinline__ float block_dot(const uint8_t* __restrict__ codes,
                                           const float* __restrict__ x) {
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < BYTES; ++i) {
        const uint32_t byte = codes[i];
        part += e2m1_value(byte & 0xFu) * x[2 * i];
        part += e2m1_value(byte >> 4) * x[2 * i + 1];
    }
    return part;
}

// One warp's dot product of an FP4 weight row with x (all lanes get the sum).
// NVFP4: blocks of 16 with e4m3 scales; MXFP4: blocks of 32 with ue8m0 scales.
template <bool MX>
__device__ __forceinline__ float warp_row_dot(const uint8_t* __restrict__ row_codes,
                                              const uint8_t* __restrict__ row_scales,
                                              const float* __restrict__ x, long long cols,
                                              int lane) {
    constexpr int BLOCK = MX ? 32 : 16;
    const long long blocks = cols / BLOCK;
    float acc = 0.0f;
    for (long long b = lane; b < blocks; b += 32) {
        const float s = MX ? e8m0_value(row_scales[b]) : e4m3_value(row_scales[b]);
        acc += block_dot<BLOCK / 2>(row_codes + b * (BLOCK / 2), x + b * BLOCK) * s;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    }
    return acc;
}

}  // namespace fp4
