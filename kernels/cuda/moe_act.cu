// The clamped SwiGLU between an expert's gate/up and down projections (DeepSeek-V4):
//
//   out[i] = silu(min(gate[i], limit)) * clamp(up[i], -limit, limit)
//   silu(x) = x * 1 / (1 + exp(-x))
//
// Elementwise over n values (64-bit count); gate, up and out are [pairs, inter] from the
// grouped GEMVs. CPU reference: `kernels::cpu::swiglu_clamp` (the engine's f32 formula); the
// results agree to a few ulp (expf vs the host's exp), see the test's bound.
#include <stdint.h>

extern "C" __global__ void swiglu_clamp(const float* __restrict__ gate,
                                        const float* __restrict__ up, long long n, float limit,
                                        float* __restrict__ out) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float g = fminf(gate[i], limit);
        const float u = fminf(fmaxf(up[i], -limit), limit);
        out[i] = g * (1.0f / (1.0f + expf(-g))) * u;
    }
}
