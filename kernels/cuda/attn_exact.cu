// Decode attention with the engine's bits (the `attend` of `engine::model::attention`): per
// token and head, logits = dot(key, q_head) (the engine's dot, `exact::dot_lanes`) times
// scale; m = max of the sink and the logits (NaN ignored, as `f32::max` does); the sink's
// exp(sink - m) first in the denominator, then every key's exp(logit - m) (`exact::exp`) added
// in key order; p = e / denominator; out = sum over keys in order of p * key (a multiply then
// an add, per dim). A token with no keys gets zeros; a token whose key list holds a negative
// offset (an undefined indexer choice) gets NaN in every head, as the engine writes.
//
// This is the reference-exact path (rows read twice per head, CUDA cores): a device forward in
// exact mode gives the CPU's bits with it, and the fast kernels (`attn_decode_fp8.cu`) are
// checked against it within their bounds. Rows are at byte offsets of the pool, CSR by token:
// f32 values (`fp8_nope` < 0), or the engine's FP8 K=V rows (`engine::paged::codec`: the first
// `fp8_nope` values e4m3 with a ue8m0 scale per 64, the rest bf16), read as the exact f32
// values they stand for (e4m3 * 2^k and bf16 are f32 values), so the sums are the f32 path's
// over the decoded rows, bit for bit.
#include <math.h>
#include <stdint.h>

#include "exact.cuh"

#define THREADS 128

// A row of f32 values.
struct F32Row {
    const float* v;
    __device__ __forceinline__ float operator[](long long d) const { return v[d]; }
};

// An FP8 K=V row: `nope` e4m3 codes, the bf16 rope values, then one ue8m0 scale per 64 codes.
struct Fp8Row {
    const uint8_t* b;
    int nope;
    int rope;
    __device__ __forceinline__ float operator[](long long d) const {
        if (d < nope) {
            const uint8_t code = b[d];
            if ((code & 0x7Fu) == 0x7Fu) {
                return __int_as_float(0x7fc00000);
            }
            const float s = exact::e8m0_to_f32(b[nope + 2 * rope + d / 64]);
            return __fmul_rn(exact::e4m3_to_f32(code), s);
        }
        const long long i = nope + 2 * (d - nope);
        return __uint_as_float((static_cast<unsigned int>(b[i + 1]) << 24) |
                               (static_cast<unsigned int>(b[i]) << 16));
    }
};

__device__ __forceinline__ F32Row row_at(const uint8_t* p, int, int, F32Row) {
    return F32Row{reinterpret_cast<const float*>(p)};
}

__device__ __forceinline__ Fp8Row row_at(const uint8_t* p, int nope, int rope, Fp8Row) {
    return Fp8Row{p, nope, rope};
}

template <typename Row>
__device__ void attend_exact(const float* __restrict__ q, const uint8_t* __restrict__ pool,
                             const long long* __restrict__ row_offsets,
                             const long long* __restrict__ row_starts,
                             const float* __restrict__ sinks, int heads, int dim, float scale,
                             int nope, float* __restrict__ out) {
    extern __shared__ float logits[];
    __shared__ float s_denom;
    __shared__ int s_poisoned;
    const long long th = blockIdx.x;
    const long long t = th / heads;
    const int h = static_cast<int>(th % heads);
    const long long first = row_starts[t];
    const int n = static_cast<int>(row_starts[t + 1] - first);
    const float* qh = q + th * dim;
    float* o = out + th * dim;
    if (threadIdx.x == 0) {
        s_poisoned = 0;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < n; k += THREADS) {
        if (row_offsets[first + k] < 0) {
            s_poisoned = 1;
        }
    }
    __syncthreads();
    if (s_poisoned) {
        for (int d = threadIdx.x; d < dim; d += THREADS) {
            o[d] = __int_as_float(0x7fc00000);
        }
        return;
    }
    if (n == 0) {
        for (int d = threadIdx.x; d < dim; d += THREADS) {
            o[d] = 0.0f;
        }
        return;
    }
    // Logits: a group of eight threads per key.
    const int lane = threadIdx.x % 8;
    for (int k0 = 0; k0 < n; k0 += THREADS / 8) {
        const int k = k0 + threadIdx.x / 8;
        // Every group of a warp takes part in the shuffles; groups past the last key compute a
        // throwaway dot of the first key.
        const Row key =
            row_at(pool + row_offsets[first + (k < n ? k : 0)], nope, dim - nope, Row{});
        const float d = exact::dot_lanes(key, qh, dim, lane, 0xffffffffu);
        if (lane == 0 && k < n) {
            logits[k] = __fmul_rn(d, scale);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float sink = sinks[h];
        float m = sink;
        for (int k = 0; k < n; ++k) {
            m = fmaxf(m, logits[k]);
        }
        float denom = exact::exp(__fsub_rn(sink, m));
        for (int k = 0; k < n; ++k) {
            logits[k] = exact::exp(__fsub_rn(logits[k], m));
            denom = __fadd_rn(denom, logits[k]);
        }
        s_denom = denom;
    }
    __syncthreads();
    const float denom = s_denom;
    for (int k = threadIdx.x; k < n; k += THREADS) {
        logits[k] = __fdiv_rn(logits[k], denom);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += THREADS) {
        float acc = 0.0f;
        for (int k = 0; k < n; ++k) {
            const Row key = row_at(pool + row_offsets[first + k], nope, dim - nope, Row{});
            acc = __fadd_rn(acc, __fmul_rn(logits[k], key[d]));
        }
        o[d] = acc;
    }
}

// One block per (token, head); dynamic shared memory: one float per key of the token.
// `fp8_nope` < 0: f32 rows; else FP8 K=V rows with that many e4m3 values.
extern "C" __global__ void attn_exact(const float* __restrict__ q,      // [tokens, heads, dim]
                                      const uint8_t* __restrict__ pool,
                                      const long long* __restrict__ row_offsets,
                                      const long long* __restrict__ row_starts,  // [tokens + 1]
                                      const float* __restrict__ sinks, int heads, int dim,
                                      float scale, int fp8_nope, float* __restrict__ out) {
    if (fp8_nope < 0) {
        attend_exact<F32Row>(q, pool, row_offsets, row_starts, sinks, heads, dim, scale, 0, out);
    } else {
        attend_exact<Fp8Row>(q, pool, row_offsets, row_starts, sinks, heads, dim, scale,
                             fp8_nope, out);
    }
}
