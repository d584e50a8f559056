// The per-token row ops around decode attention, for a forward pass that keeps its state on
// the device:
//
// `norm_rope_rows`: each row holds `heads` heads of `head_dim` values; per head an RMS norm
//   (none, unweighted, or weighted by `w`), then RoPE on its trailing `rope` dims (pairs
//   interleaved, angle = position * inv_freq[i] in f32, the engine's `Rope` tables), forward or
//   inverse. The query heads (unweighted norm, rope), the K=V row (weighted norm, rope) and the
//   attention output (inverse rope only). References: `engine::tensor::rms_norm{,_unweighted}`
//   and `engine::rope::RopeAt::apply`; the sum of squares and sin/cos differ from the CPU's in
//   the last bits, so the tests bound the difference.
//
// `fp8_kv_encode`: each row into the engine's FP8 K=V format at a byte offset of the page pool
//   (`engine::paged::codec::encode`, bit for bit: the same block maxima, the same ue8m0 scale
//   choice, the same round-to-nearest-even e4m3 and bf16 conversions, NaN and saturation
//   rules, zeroed scale padding). A negative offset skips the row.
#include <math.h>
#include <stdint.h>

#define ROW_THREADS 128

// Sum over the block (ROW_THREADS threads) into every thread; `red` is ROW_THREADS floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int stride = ROW_THREADS / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            red[threadIdx.x] += red[threadIdx.x + stride];
        }
        __syncthreads();
    }
    const float total = red[0];
    __syncthreads();
    return total;
}

// One block per (row, head). norm: 0 none, 1 unweighted, 2 weighted by w[head_dim].
extern "C" __global__ void norm_rope_rows(float* __restrict__ x, int heads, int head_dim,
                                          const float* __restrict__ w, int norm, float eps,
                                          const long long* __restrict__ positions,
                                          const float* __restrict__ inv_freq, int rope,
                                          int inverse) {
    __shared__ float red[ROW_THREADS];
    const long long row = blockIdx.x / heads;
    const int head = blockIdx.x % heads;
    float* v = x + (row * heads + head) * head_dim;
    if (norm != 0) {
        float part = 0.0f;
        for (int d = threadIdx.x; d < head_dim; d += ROW_THREADS) {
            part += v[d] * v[d];
        }
        const float mean = block_sum(part, red) / static_cast<float>(head_dim);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int d = threadIdx.x; d < head_dim; d += ROW_THREADS) {
            const float scaled = v[d] * scale;
            v[d] = norm == 2 ? w[d] * scaled : scaled;
        }
        __syncthreads();
    }
    const float pos = static_cast<float>(positions[row]);
    const int start = head_dim - rope;
    for (int i = threadIdx.x; i < rope / 2; i += ROW_THREADS) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        if (inverse) {
            s = -s;
        }
        const float a = v[start + 2 * i];
        const float b = v[start + 2 * i + 1];
        v[start + 2 * i] = a * c - b * s;
        v[start + 2 * i + 1] = b * c + a * s;
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

// `engine::formats::e8m0_to_f32`.
__device__ __forceinline__ float e8m0_to_f32(uint8_t code) {
    if (code == 0xFFu) {
        return __int_as_float(0x7fc00000);
    }
    if (code == 0u) {
        return __int_as_float(0x00400000);
    }
    return __int_as_float(static_cast<int>(code) << 23);
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
        // fmaxf ignores a NaN, as the engine's `f32::max` does.
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
        if (d < nope) {
            out[d] = to_e4m3(x / e8m0_to_f32(code));
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
