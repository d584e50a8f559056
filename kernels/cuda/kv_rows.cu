// The per-token row ops around decode attention, for a forward pass that keeps its state on
// the device:
//
// `norm_rope_rows`: each row holds `heads` heads of `head_dim` values; per head an RMS norm
//   (none, unweighted, or weighted by `w`), then RoPE on its trailing `rope` dims (pairs
//   interleaved) with the row's (sin, cos) pairs, forward or inverse. The query heads
//   (unweighted norm, rope), the K=V row (weighted norm, rope) and the attention output
//   (inverse rope only). Bit for bit `engine::tensor::rms_norm{,_unweighted}` then
//   `engine::rope::RopeAt::apply`: the sum of squares is the engine's dot, the angles' sin and
//   cos come from the host.
//
// `fp8_kv_encode`: each row into the engine's FP8 K=V format at a byte offset of the page pool
//   (`engine::paged::codec::encode`, bit for bit: the same block maxima, the same ue8m0 scale
//   choice, the same round-to-nearest-even e4m3 and bf16 conversions, NaN and saturation
//   rules, zeroed scale padding). A negative offset skips the row.
#include <math.h>
#include <stdint.h>

#include "exact.cuh"

#define ROW_THREADS 128

// One block per (row, head). norm: 0 none, 1 unweighted, 2 weighted by w[head_dim]. The sum
// of squares is the engine's dot (`exact::dot_lanes` on the first eight threads); the rotation
// takes the row's (sin, cos) pairs from `sin_cos` ([rows, rope / 2, 2], the engine's
// `RopeAt` values computed on the host with the positions), so the result is the CPU's bits.
extern "C" __global__ void norm_rope_rows(float* __restrict__ x, int heads, int head_dim,
                                          const float* __restrict__ w, int norm, float eps,
                                          const float* __restrict__ sin_cos, int rope,
                                          int inverse) {
    __shared__ float sum_sq;
    const long long row = blockIdx.x / heads;
    const int head = blockIdx.x % heads;
    float* v = x + (row * heads + head) * head_dim;
    if (norm != 0) {
        if (threadIdx.x < 8) {
            const float d = exact::dot_lanes(v, v, head_dim, threadIdx.x, 0xffu);
            if (threadIdx.x == 0) {
                sum_sq = d;
            }
        }
        __syncthreads();
        const float mean = __fdiv_rn(sum_sq, static_cast<float>(head_dim));
        const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
        for (int d = threadIdx.x; d < head_dim; d += ROW_THREADS) {
            const float scaled = __fmul_rn(v[d], scale);
            v[d] = norm == 2 ? __fmul_rn(w[d], scaled) : scaled;
        }
        __syncthreads();
    }
    const int start = head_dim - rope;
    const float* sc = sin_cos + row * rope;
    for (int i = threadIdx.x; i < rope / 2; i += ROW_THREADS) {
        const float s = inverse ? -sc[2 * i] : sc[2 * i];
        const float c = sc[2 * i + 1];
        const float a = v[start + 2 * i];
        const float b = v[start + 2 * i + 1];
        v[start + 2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        v[start + 2 * i + 1] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

// `engine::formats::f32_to_e4m3`: round to nearest even, saturating at 448, NaN to 0x7F.
__device__ __forceinline__ uint8_t to_e4m3(float x) {
    if (isnan(x)) {
        return 0x7Fu;
    }
    const uint8_t sign = signbit(x) ? 0x80u : 0x00u;
    const float a = fabsf(x);
    if (a >= 448.0f) {
        return sign | 0x7Eu;
    }
    if (a < __int_as_float(0x3C800000)) {  // 2^-6: the subnormal grid of 2^-9
        return sign | static_cast<uint8_t>(rintf(a * 512.0f));
    }
    int exp = static_cast<int>((__float_as_uint(a) >> 23) & 0xFFu) - 127;
    const float scaled = a * __int_as_float((127 - exp) << 23) * 8.0f;  // in [8, 16)
    unsigned int steps = static_cast<unsigned int>(rintf(scaled));
    if (steps == 16u) {
        steps = 8u;
        exp += 1;
    }
    const unsigned int code = (static_cast<unsigned int>(exp + 7) << 3) | (steps - 8u);
    return sign | static_cast<uint8_t>(min(code, 0x7Eu));
}

// `engine::formats::e8m0_for_at_least`: the smallest power of two >= x as a ue8m0 code.
__device__ __forceinline__ uint8_t e8m0_at_least(float x) {
    if (isnan(x)) {
        return 0xFFu;
    }
    if (x <= 0.0f) {
        return 0u;
    }
    if (isinf(x)) {
        return 0xFEu;
    }
    const unsigned int bits = __float_as_uint(x);
    const unsigned int exp = bits >> 23;
    const unsigned int mant = bits & 0x007FFFFFu;
    if (exp == 0u) {
        return bits > 0x00400000u ? 1u : 0u;
    }
    const unsigned int code = mant == 0u ? exp : exp + 1u;
    return static_cast<uint8_t>(min(code, 0xFEu));
}

// `engine::formats::f32_to_bf16`: round to nearest even; NaN made quiet.
__device__ __forceinline__ uint16_t to_bf16(float x) {
    const unsigned int bits = __float_as_uint(x);
    if (isnan(x)) {
        return static_cast<uint16_t>((bits >> 16) | 0x0040u);
    }
    const unsigned int lsb = (bits >> 16) & 1u;
    return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

// The ue8m0 scale code of a 64-value block whose thread t holds `x` (0 past the row), as the
// engine chooses it (`codec::encode`): the smallest power of two at least amax / 448, amax over
// the block with `fmaxf` ignoring a NaN as `f32::max` does. Every thread of the 64 calls it;
// `amax` is the block's shared scratch, free again on return.
__device__ __forceinline__ uint8_t fp8_block_scale(float x, float* amax, int t) {
    amax[t] = fabsf(x);
    __syncthreads();
    for (int stride = 32; stride > 0; stride /= 2) {
        if (t < stride) {
            amax[t] = fmaxf(amax[t], amax[t + stride]);
        }
        __syncthreads();
    }
    const uint8_t code = e8m0_at_least(fmaxf(amax[0] / 448.0f, __int_as_float(0x00800000)));
    __syncthreads();
    return code;
}

// One block (64 threads) per row: thread t owns value t of every 64-value block.
extern "C" __global__ void fp8_kv_encode(const float* __restrict__ rows, int nope, int rope,
                                         uint8_t* __restrict__ pool,
                                         const long long* __restrict__ offsets) {
    __shared__ float amax[64];
    const long long r = blockIdx.x;
    const long long off = offsets[r];
    if (off < 0) {
        return;
    }
    const int t = threadIdx.x;
    const float* v = rows + r * (nope + rope);
    uint8_t* out = pool + off;
    const int blocks = (nope + 63) / 64;
    uint8_t* scales = out + nope + 2 * rope;
    for (int b = 0; b < blocks; ++b) {
        const int d = b * 64 + t;
        const float x = d < nope ? v[d] : 0.0f;
        const uint8_t code = fp8_block_scale(x, amax, t);
        if (d < nope) {
            out[d] = to_e4m3(x / exact::e8m0_to_f32(code));
        }
        if (t == 0) {
            scales[b] = code;
        }
    }
    // Scale padding to a multiple of 8 bytes: zero.
    const int padded = ((blocks + 7) / 8) * 8;
    for (int i = blocks + t; i < padded; i += 64) {
        scales[i] = 0u;
    }
    for (int i = t; i < rope; i += 64) {
        const uint16_t bits = to_bf16(v[nope + i]);
        out[nope + 2 * i] = static_cast<uint8_t>(bits & 0xFFu);
        out[nope + 2 * i + 1] = static_cast<uint8_t>(bits >> 8);
    }
}

// `fp8_kv_round`: `engine::paged::codec::round` of `count` contiguous rows of nope + rope
// values in place (a K=V row as storing it in the FP8 format and reading it back gives it: the
// engine rounds every K=V row so as it is computed). The same block maxima, scale choice and
// conversions as `fp8_kv_encode`; a NaN value stays the engine's NaN (0x7fc00000), not the
// device's canonical one, and NaN payloads of the bf16 dims are kept by bit operations only.
// One block (64 threads) per row.
extern "C" __global__ void fp8_kv_round(float* __restrict__ rows, int nope, int rope) {
    __shared__ float amax[64];
    float* v = rows + static_cast<long long>(blockIdx.x) * (nope + rope);
    const int t = threadIdx.x;
    const int blocks = (nope + 63) / 64;
    for (int b = 0; b < blocks; ++b) {
        const int d = b * 64 + t;
        const float x = d < nope ? v[d] : 0.0f;
        const uint8_t code = fp8_block_scale(x, amax, t);
        if (d < nope) {
            const float scale = exact::e8m0_to_f32(code);
            const uint8_t q = to_e4m3(x / scale);
            v[d] = (q & 0x7Fu) == 0x7Fu ? __int_as_float(0x7fc00000) : exact::e4m3_to_f32(q) * scale;
        }
    }
    for (int i = t; i < rope; i += 64) {
        v[nope + i] = __uint_as_float(static_cast<unsigned int>(to_bf16(v[nope + i])) << 16);
    }
}
