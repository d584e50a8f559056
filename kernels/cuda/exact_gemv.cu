// Weight rows times vectors with the engine's one definition of a dot product
// (`engine::tensor::dots_source`), so a linear on the device gives the CPU reference's bits:
// eight lanes, lane k accumulating w[8i+k] * x[8i+k] with a fused multiply-add over the whole
// chunks of eight, the leftover elements into a separate scalar with fused multiply-adds, then
// the lanes halved pairwise (k + 4, then k + 2, then k + 1) and the scalar added last. Each
// element of a stored row is decoded as the engine decodes it (`engine::tensor::rows`): f32;
// bf16; e4m3 times the f32 scale of its 128 x 128 tile; NVFP4 e2m1 times (e4m3 scale times
// the tensor's scale_2); MXFP4 e2m1 times its ue8m0 scale.
//
// Thread mapping: a group of 8 threads is one output row, thread k of the group is lane k; the
// lanes' halving is three shuffles inside the group; thread 0 of the group runs the tail and
// stores. A group computes up to VB vectors per pass (one accumulator each), so a weight row is
// read once per VB vectors; outputs never share an accumulator, so neither the pass nor the
// block changes a bit. `y` is vector-major, `y[v * rows + r]`, for rows `row0..row0 + rows` of
// the weight. `kernels::emulate::exact_dots` is this mapping in Rust, tested in CI against the
// engine.
#include <stdint.h>

#include "exact.cuh"
#include "fp4.cuh"

#define GROUPS 32  // rows per block of 256 threads
#define VB 4       // vectors per pass

enum Format { F32 = 0, BF16 = 1, FP8_BLOCK = 2, NVFP4 = 3, MXFP4 = 4 };

struct Rows {
    const void* data;    // f32 / bf16 / e4m3 codes / packed e2m1
    const void* scales;  // FP8: f32 per 128 x 128 tile; NVFP4: e4m3 per 16; MXFP4: ue8m0 per 32
    float scale_2;       // NVFP4
    long long cols;
};

template <int FMT>
__device__ __forceinline__ float element(const Rows& s, long long r, long long c) {
    if (FMT == F32) {
        return static_cast<const float*>(s.data)[r * s.cols + c];
    } else if (FMT == BF16) {
        const uint16_t bits = static_cast<const uint16_t*>(s.data)[r * s.cols + c];
        return __uint_as_float(static_cast<unsigned int>(bits) << 16);
    } else if (FMT == FP8_BLOCK) {
        const uint8_t code = static_cast<const uint8_t*>(s.data)[r * s.cols + c];
        const long long tiles = (s.cols + 127) / 128;
        const float scale = static_cast<const float*>(s.scales)[(r / 128) * tiles + c / 128];
        return __fmul_rn(fp4::e4m3_value(code), scale);
    } else {
        const uint8_t byte = static_cast<const uint8_t*>(s.data)[(r * s.cols + c) / 2];
        const float v = fp4::e2m1_value((c % 2) ? (byte >> 4) : (byte & 0xFu));
        const uint8_t* sc = static_cast<const uint8_t*>(s.scales);
        if (FMT == NVFP4) {
            const float scale = __fmul_rn(fp4::e4m3_value(sc[r * (s.cols / 16) + c / 16]), s.scale_2);
            return __fmul_rn(v, scale);
        }
        return __fmul_rn(v, fp4::e8m0_value(sc[r * (s.cols / 32) + c / 32]));
    }
}

template <int FMT>
__device__ __forceinline__ void exact_gemv(const Rows& s, long long row0, long long rows,
                                           const float* __restrict__ x, int vectors,
                                           float* __restrict__ y) {
    const int lane = threadIdx.x % 8;
    const long long r = static_cast<long long>(blockIdx.x) * GROUPS + threadIdx.x / 8;
    // Every thread runs the shuffles (whole warps), only live rows read and store.
    const bool live = r < rows;
    const long long wr = row0 + (live ? r : 0);
    const long long n = s.cols;
    const long long chunks = n / 8;
    for (int v0 = 0; v0 < vectors; v0 += VB) {
        float acc[VB];
#pragma unroll
        for (int j = 0; j < VB; ++j) {
            acc[j] = 0.0f;
        }
        if (live) {
            for (long long i = 0; i < chunks; ++i) {
                const long long c = i * 8 + lane;
                const float w = element<FMT>(s, wr, c);
#pragma unroll
                for (int j = 0; j < VB; ++j) {
                    if (v0 + j < vectors) {
                        acc[j] = __fmaf_rn(w, x[static_cast<long long>(v0 + j) * n + c], acc[j]);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < VB; ++j) {
            float v = acc[j];
            v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 4, 8));
            v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 2, 8));
            v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, 1, 8));
            acc[j] = v;
        }
        if (live && lane == 0) {
#pragma unroll
            for (int j = 0; j < VB; ++j) {
                if (v0 + j < vectors) {
                    const float* xv = x + static_cast<long long>(v0 + j) * n;
                    float tail = 0.0f;
                    for (long long c = chunks * 8; c < n; ++c) {
                        tail = __fmaf_rn(element<FMT>(s, wr, c), xv[c], tail);
                    }
                    y[static_cast<long long>(v0 + j) * rows + r] = __fadd_rn(acc[j], tail);
                }
            }
        }
    }
}

#define EXACT_GEMV(NAME, FMT)                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const void* __restrict__ data, const void* __restrict__ scales, float scale_2,     \
             long long cols, long long row0, long long rows, const float* __restrict__ x,      \
             int vectors, float* __restrict__ y) {                                              \
        const Rows s{data, scales, scale_2, cols};                                              \
        exact_gemv<FMT>(s, row0, rows, x, vectors, y);                                          \
    }

EXACT_GEMV(exact_gemv_f32, F32)
EXACT_GEMV(exact_gemv_bf16, BF16)
EXACT_GEMV(exact_gemv_fp8_block, FP8_BLOCK)
EXACT_GEMV(exact_gemv_nvfp4, NVFP4)
EXACT_GEMV(exact_gemv_mxfp4, MXFP4)

// The routed experts of a step with the same definition: pair p's output row r is
// dot(expert e_p's row r, x[token_p]) for the stacked experts `[experts, rows, cols]` (FP4
// bytes per expert `rows * cols / 2`, scales `rows * cols / 16` (NVFP4, with a global scale per
// expert) or `/ 32` (MXFP4)). Grid: (row blocks, pairs); a pair whose expert is outside the
// stack is left as it is (NaN from the caller's fill).
template <int FMT>
__device__ __forceinline__ void exact_pairs(const uint8_t* __restrict__ packed,
                                            const uint8_t* __restrict__ scales,
                                            const float* __restrict__ scale_2, int experts,
                                            long long rows, long long cols,
                                            const int* __restrict__ pair_token,
                                            const int* __restrict__ pair_expert,
                                            const float* __restrict__ x, float* __restrict__ y) {
    const long long p = blockIdx.y;
    const int e = pair_expert[p];
    if (e < 0 || e >= experts) {
        return;
    }
    const long long per = rows * cols;
    const Rows s{packed + e * per / 2, scales + e * per / (FMT == NVFP4 ? 16 : 32),
                 FMT == NVFP4 ? scale_2[e] : 1.0f, cols};
    exact_gemv<FMT>(s, 0, rows, x + static_cast<long long>(pair_token[p]) * cols, 1,
                    y + p * rows);
}

#define EXACT_PAIRS(NAME, FMT)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales,            \
             const float* __restrict__ scale_2, int experts, long long rows, long long cols,    \
             const int* __restrict__ pair_token, const int* __restrict__ pair_expert,           \
             const float* __restrict__ x, float* __restrict__ y) {                              \
        exact_pairs<FMT>(packed, scales, scale_2, experts, rows, cols, pair_token, pair_expert, \
                         x, y);                                                                 \
    }

EXACT_PAIRS(exact_pairs_nvfp4, NVFP4)
EXACT_PAIRS(exact_pairs_mxfp4, MXFP4)

// The MoE output of every token with the engine's bits (`moe::forward_many`'s sum): from 0,
// each routed slot's output times its weight added in slot order (a multiply then an add), then
// the shared expert's output. ys: [tokens * k, hidden] (token-major slots); weights: [tokens, k].
extern "C" __global__ void moe_combine(const float* __restrict__ ys,
                                       const float* __restrict__ weights,
                                       const float* __restrict__ shared, int k, long long hidden,
                                       float* __restrict__ out) {
    const long long t = blockIdx.x;
    for (long long d = threadIdx.x; d < hidden; d += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < k; ++j) {
            o = __fadd_rn(o, __fmul_rn(ys[(t * k + j) * hidden + d], weights[t * k + j]));
        }
        out[t * hidden + d] = __fadd_rn(o, shared[t * hidden + d]);
    }
}

// `engine::model::moe::route_logits` for every token, one thread a token: scores
// sqrt(softplus(logit)); the chosen experts from the hash table's row of the token
// (`tid2eid`, [table_rows, k]) or the top k of score + bias (`bias` may be null) in
// `total_cmp` order, the lower expert first among equals; each chosen score over their sum
// (summed in slot order from -0, plus 1e-20) times `scaling`. `scores`: scratch
// [tokens, experts]. A token whose table row or entry is outside the table gets experts -1
// and NaN weights (the combine then turns the token NaN instead of routing it anywhere).
extern "C" __global__ void moe_route(const float* __restrict__ logits, int tokens, int experts,
                                     int k, const float* __restrict__ bias,
                                     const unsigned int* __restrict__ tid2eid, long long table_rows,
                                     const int* __restrict__ token_ids, float scaling,
                                     float* __restrict__ scores, int* __restrict__ chosen,
                                     float* __restrict__ weights) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= tokens) {
        return;
    }
    float* s = scores + t * experts;
    int* out = chosen + t * k;
    float* w = weights + t * k;
    for (int e = 0; e < experts; ++e) {
        s[e] = __fsqrt_rn(exact::softplus(logits[t * experts + e]));
    }
    bool bad = false;
    if (tid2eid != nullptr) {
        const long long row = token_ids[t];
        bad = row < 0 || row >= table_rows;
        for (int j = 0; j < k; ++j) {
            const unsigned int e = bad ? 0u : tid2eid[row * k + j];
            bad = bad || e >= static_cast<unsigned int>(experts);
            out[j] = static_cast<int>(e);
        }
    } else {
        for (int j = 0; j < k; ++j) {
            int best = -1;
            unsigned int best_key = 0;
            for (int e = 0; e < experts; ++e) {
                bool taken = false;
                for (int i = 0; i < j; ++i) {
                    taken = taken || out[i] == e;
                }
                if (taken) {
                    continue;
                }
                const float v = bias != nullptr ? __fadd_rn(s[e], bias[e]) : s[e];
                const unsigned int key = exact::total_key(v);
                if (best < 0 || key > best_key) {
                    best = e;
                    best_key = key;
                }
            }
            out[j] = best;
        }
    }
    if (bad) {
        for (int j = 0; j < k; ++j) {
            out[j] = -1;
            w[j] = __uint_as_float(0x7fc00000u);
        }
        return;
    }
    float sum = -0.0f;
    for (int j = 0; j < k; ++j) {
        sum = __fadd_rn(sum, s[out[j]]);
    }
    sum = __fadd_rn(sum, 1e-20f);
    for (int j = 0; j < k; ++j) {
        w[j] = __fmul_rn(__fdiv_rn(s[out[j]], sum), scaling);
    }
}
