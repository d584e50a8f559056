// NVFP4 activation quantization (the ModelOpt recipe), one row-major matrix at a time.
//
// For every 16-element block of a row: block scale = e4m3(amax / 6 / global_scale), rounded to
// nearest even and saturated; an all-zero block stores scale 1.0 (0x38), as ModelOpt does. Each
// element becomes e2m1(x / (block_scale * global_scale)), round-to-nearest-even, saturating at
// +-6; a zero block scale gives code 0. Two codes per byte, the even element in the low nibble.
// The CPU reference with identical semantics is `engine::quant::quant_nvfp4_activation`.
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint8_t e2m1_code(float v) {
    // Hardware cvt on sm_100/sm_120; the header emulates it elsewhere (same rounding).
    __nv_fp4_storage_t code = __nv_cvt_float_to_fp4(v, __NV_E2M1, cudaRoundNearest);
    return static_cast<uint8_t>(code) & 0x0F;
}

}  // namespace

// One thread per 16-element block. `cols` must be a multiple of 16.
// packed: rows * cols / 2 bytes; scales: rows * cols / 16 bytes (e4m3). 64-bit offsets.
extern "C" __global__ void nvfp4_quantize_rows(const float* __restrict__ x, long long rows,
                                               long long cols, float global_scale,
                                               uint8_t* __restrict__ packed,
                                               uint8_t* __restrict__ scales) {
    const long long blocks_per_row = cols / 16;
    const long long block = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (block >= rows * blocks_per_row) {
        return;
    }
    const float* src = x + block * 16;
    float amax = 0.0f;
    #pragma unroll
    for (int i = 0; i < 16; ++i) {
        float a = fabsf(src[i]);
        // NaN never wins the max (fmaxf returns the other operand).
        amax = fmaxf(amax, a);
    }
    uint8_t scale_code;
    if (amax == 0.0f) {
        scale_code = 0x38;  // 1.0
    } else {
        scale_code = static_cast<uint8_t>(
            __nv_cvt_float_to_fp8(amax / 6.0f / global_scale, __NV_SATFINITE, __NV_E4M3));
    }
    scales[block] = scale_code;
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(scale_code), __NV_E4M3);
    const float block_scale = __half2float(__half(h));
    const float denom = block_scale * global_scale;
    uint8_t* dst = packed + block * 8;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint8_t lo = 0, hi = 0;
        if (block_scale != 0.0f) {
            lo = e2m1_code(src[2 * i] / denom);
            hi = e2m1_code(src[2 * i + 1] / denom);
        }
        dst[i] = static_cast<uint8_t>(lo | (hi << 4));
    }
}
