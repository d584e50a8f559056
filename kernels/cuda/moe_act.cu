// The clamped SwiGLU between an expert's gate/up and down projections (DeepSeek-V4):
//
//   out[i] = silu(min(gate[i], limit)) * clamp(up[i], -limit, limit)
//   silu(x) = x * (1 / (1 + exp(-x)))
//
// Elementwise over n values (64-bit count); gate, up and out are [pairs, inter] from the
// grouped GEMVs. Bit for bit the engine's `moe::swiglu` (CPU reference:
// `kernels::cpu::swiglu_clamp`): `exact::exp`, the same products in the same order, `min`
// taking the limit for a NaN gate (as `f32::min` does) and `clamp` keeping a NaN up value.
#include <math.h>
#include <stdint.h>

#include "exact.cuh"

extern "C" __global__ void swiglu_clamp(const float* __restrict__ gate,
                                        const float* __restrict__ up, long long n, float limit,
                                        float* __restrict__ out) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float g = fminf(gate[i], limit);
        const float raw = up[i];
        const float u = isnan(raw) ? raw : fminf(fmaxf(raw, -limit), limit);
        const float e = exact::exp(-g);
        out[i] = __fmul_rn(__fmul_rn(g, __fdiv_rn(1.0f, __fadd_rn(1.0f, e))), u);
    }
}
