// DeepSeek-V4 lightning indexer for decode: score every visible compressed key of a request,
// score_s = sum_h w_h * relu(q_h . k_s) * scale, then keep the top `k` by radix select (in
// f32 total order, -0 below +0; ties: lower index first; linear in the keys), where only the
// first `visible[b]` keys of request b exist for its query (causal rule: a compressed row is
// visible once its window has closed). NaN in, NaN out: the ReLU keeps
// a NaN, and a request with a NaN among its visible scores gets TOPK_POISONED (-2) in every
// slot instead of a selection. Index arithmetic is 64-bit. The CPU reference is
// `kernels::cpu::indexer_topk` (same rule as the engine's CPU model); `kernels::emulate::
// topk_radix` is `indexer_topk` step by step in Rust, tested in CI.
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "exact.cuh"
#include "mma_bf16.cuh"

#define THREADS 256

// One group of eight threads per (request, key), with the engine's bits (the `select` of
// `engine::model::attention`): per head the engine's dot of the key and the head's query
// (`exact::dot_lanes`), ReLU keeping a NaN, times scale, times the head's weight, summed over
// the heads in order from -0 (as `Iterator::sum` does). keys: f32 rows of `dim`, CSR by request
// (key_starts); q: [B, heads, dim] (rotated); w: [B, heads] (already scaled by heads^-0.5).
extern "C" __global__ void indexer_scores(const float* __restrict__ q, const float* __restrict__ w,
                                          const float* __restrict__ keys,
                                          const long long* __restrict__ key_starts,
                                          const int* __restrict__ visible, int batch, int heads,
                                          int dim, float scale, long long max_keys,
                                          float* __restrict__ scores) {  // [B, max_keys]
    const long long group = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 8;
    const int lane = threadIdx.x % 8;
    const long long b = group / max_keys;
    const long long s = group % max_keys;
    // Whole warps take part in the shuffles; groups without a key compute a throwaway score.
    const bool live = b < batch && s < visible[b < batch ? b : 0];
    const long long bb = live ? b : 0;
    const float* key = keys + (live ? (key_starts[b] + s) : 0) * dim;
    float total = -0.0f;
    for (int h = 0; h < heads; ++h) {
        const float* qh = q + (bb * heads + h) * dim;
        const float dotp = exact::dot_lanes(key, qh, dim, lane, 0xffffffffu);
        const float relu = isnan(dotp) ? dotp : fmaxf(dotp, 0.0f);
        total = __fadd_rn(total, __fmul_rn(__fmul_rn(relu, scale), w[bb * heads + h]));
    }
    if (live && lane == 0) {
        scores[b * max_keys + s] = total;
    }
}

// The same scores on tensor cores (the fast attention's indexer): queries and keys rounded to
// bf16 (round-to-nearest-even), products exact, f32 sums; all heads of a request against a
// tile of 64 keys at once on `mma.sync.m16n8k16` with the heads as M, instead of an
// eight-thread group re-reading every head's query per key. Heads are padded to a multiple of
// 16 (zero queries, zero weights), dims to a multiple of 16 (zeros). Per key:
// sum_h relu(q_h . k) * scale * w_h, where a 16-head tile's heads g and g + 8 are added first,
// then the eight g by shuffles (xor 4, 8, 16), then the tiles in order from -0. NaN in, NaN out
// (a NaN key or query poisons its score: a padded head adds NaN * 0). Grid (key groups of
// MMA_TILES tiles, tokens), MMA_THREADS threads, each warp 16 keys of a tile; dynamic shared
// memory `(heads_p + MMA_KEYS) * (dim_p + 8)` bf16 (`kernels::indexer_mma::shared_bytes`).
// Reference `kernels::indexer_mma::reference` (f64 over the bf16 operands) and its bound;
// `kernels::emulate::indexer_scores_mma` is this kernel's index math in Rust, tested in CI.
#define MMA_KEYS 64
#define MMA_TILES 4
#define MMA_THREADS 128

__device__ __forceinline__ float relu_keep_nan(float x) { return isnan(x) ? x : fmaxf(x, 0.0f); }

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
    indexer_scores_mma(const float* __restrict__ q, const float* __restrict__ w,
                       const float* __restrict__ keys, const long long* __restrict__ key_starts,
                       const int* __restrict__ visible, int batch, int heads, int dim,
                       float scale, long long max_keys, float* __restrict__ scores) {
    extern __shared__ __align__(16) __nv_bfloat16 smem[];
    const int heads_p = (heads + 15) / 16 * 16;
    const int dim_p = (dim + 15) / 16 * 16;
    const int lds = dim_p + 8;  // row stride: even (4-byte pairs), rows 8 apart on other banks
    __nv_bfloat16* sq = smem;                  // [heads_p][lds]
    __nv_bfloat16* sk = smem + heads_p * lds;  // [MMA_KEYS][lds]
    const long long b = blockIdx.y;
    const long long n = b < batch ? visible[b] : 0;
    const long long first = static_cast<long long>(blockIdx.x) * MMA_TILES * MMA_KEYS;
    if (first >= n) {
        return;  // the whole block: no key of this group is visible
    }
    const int tid = threadIdx.x;
    for (int e = tid; e < heads_p * dim_p; e += MMA_THREADS) {
        const int h = e / dim_p;
        const int d = e % dim_p;
        const float v = (h < heads && d < dim) ? q[(b * heads + h) * dim + d] : 0.0f;
        sq[h * lds + d] = __float2bfloat16_rn(v);
    }
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const long long start = key_starts[b];
    for (int tile = 0; tile < MMA_TILES; ++tile) {
        const long long s0 = first + static_cast<long long>(tile) * MMA_KEYS;
        if (s0 >= n) {
            break;  // uniform over the block
        }
        __syncthreads();  // the previous tile's keys are read
        for (int e = tid; e < MMA_KEYS * dim_p; e += MMA_THREADS) {
            const int r = e / dim_p;
            const int d = e % dim_p;
            const long long s = s0 + r;
            const float v = (s < n && d < dim) ? keys[(start + s) * dim + d] : 0.0f;
            sk[r * lds + d] = __float2bfloat16_rn(v);
        }
        __syncthreads();
        const int n0 = warp * 16;  // the warp's keys: two MMA columns of 8
        float total[2][2] = {{-0.0f, -0.0f}, {-0.0f, -0.0f}};
        for (int mt = 0; mt < heads_p / 16; ++mt) {
            float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            for (int ks = 0; ks < dim_p; ks += 16) {
                uint32_t a[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    a[i] = ld_pair(&sq[(mt * 16 + g + 8 * (i % 2)) * lds + ks + 2 * t + 8 * (i / 2)]);
                }
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const __nv_bfloat16* key = &sk[(n0 + 8 * j + g) * lds + ks + 2 * t];
                    const uint32_t bk[2] = {ld_pair(key), ld_pair(key + 8)};
                    mma_16816(acc[j], a, bk);
                }
            }
            const int h_lo = mt * 16 + g;
            const int h_hi = h_lo + 8;
            const float w_lo = h_lo < heads ? w[b * heads + h_lo] : 0.0f;
            const float w_hi = h_hi < heads ? w[b * heads + h_hi] : 0.0f;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float part =
                        __fadd_rn(__fmul_rn(__fmul_rn(relu_keep_nan(acc[j][c]), scale), w_lo),
                                  __fmul_rn(__fmul_rn(relu_keep_nan(acc[j][2 + c]), scale), w_hi));
#pragma unroll
                    for (int off = 4; off < 32; off <<= 1) {
                        part = __fadd_rn(part, __shfl_xor_sync(0xffffffffu, part, off));
                    }
                    total[j][c] = __fadd_rn(total[j][c], part);
                }
            }
        }
        if (g == 0) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const long long s = s0 + n0 + 8 * j + 2 * t + c;
                    if (s < n) {
                        scores[b * max_keys + s] = total[j][c];
                    }
                }
            }
        }
    }
}

// Order-preserving key: a larger score gives a larger unsigned key, in the total order the
// engine's top-k sorts by (`f32::total_cmp`: -0 below +0), so only identical scores tie.
__device__ __forceinline__ unsigned int order_key(float v) {
    const unsigned int bits = __float_as_uint(v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Exclusive prefix sum of `v` over the block's threads (Hillis-Steele in `buf`); `total` gets
// the sum over the block.
__device__ __forceinline__ int block_scan(int v, int* buf, int* total) {
    const int tid = threadIdx.x;
    buf[tid] = v;
    __syncthreads();
    for (int off = 1; off < THREADS; off <<= 1) {
        const int add = tid >= off ? buf[tid - off] : 0;
        __syncthreads();
        buf[tid] += add;
        __syncthreads();
    }
    const int inclusive = buf[tid];
    *total = buf[THREADS - 1];
    __syncthreads();
    return inclusive - v;
}

// One block per request: the top `k` of its `visible` scores by radix select, linear in the
// candidates. Four passes histogram one byte each of the order-preserving key among the keys
// that match the bytes chosen so far, which fixes the k-th largest key T and how many keys
// equal to T are taken; a last pass writes, in ascending index order, every key above T and
// the lowest-indexed keys equal to T. Writes `min(k, visible)` indices then -1; -2 in every
// slot when a visible score is NaN. The scores are not modified.
extern "C" __global__ void indexer_topk(const float* __restrict__ scores,
                                        const int* __restrict__ visible, long long max_keys, int k,
                                        int* __restrict__ out) {
    const int tid = threadIdx.x;
    const int b = blockIdx.x;
    const long long n = visible[b];
    const float* row = scores + static_cast<long long>(b) * max_keys;
    int* slots = out + static_cast<long long>(b) * k;
    __shared__ unsigned int hist[256];
    __shared__ int buf[THREADS];
    __shared__ unsigned int s_prefix;
    __shared__ unsigned int s_mask;
    __shared__ long long s_remaining;
    int nan_seen = 0;
    for (long long s = tid; s < n; s += THREADS) {
        nan_seen |= isnan(row[s]) ? 1 : 0;
    }
    if (__syncthreads_or(nan_seen)) {
        for (int i = tid; i < k; i += THREADS) {
            slots[i] = -2;
        }
        return;
    }
    const long long take = min(static_cast<long long>(k), n);
    for (long long i = take + tid; i < k; i += THREADS) {
        slots[i] = -1;
    }
    if (take == n) {
        for (long long s = tid; s < n; s += THREADS) {
            slots[s] = static_cast<int>(s);
        }
        return;
    }
    if (tid == 0) {
        s_prefix = 0u;
        s_mask = 0u;
        s_remaining = take;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += THREADS) {
            hist[i] = 0u;
        }
        __syncthreads();
        const unsigned int prefix = s_prefix;
        const unsigned int mask = s_mask;
        for (long long s = tid; s < n; s += THREADS) {
            const unsigned int key = order_key(row[s]);
            if ((key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 0xFFu], 1u);
            }
        }
        __syncthreads();
        if (tid == 0) {
            // The bin holding the remaining-th largest matching key, from the top.
            const long long remaining = s_remaining;
            long long above = 0;
            int d = 255;
            for (; d > 0; --d) {
                if (above + hist[d] >= remaining) {
                    break;
                }
                above += hist[d];
            }
            s_remaining = remaining - above;
            s_prefix = prefix | (static_cast<unsigned int>(d) << shift);
            s_mask = mask | (0xFFu << shift);
        }
        __syncthreads();
    }
    const unsigned int threshold = s_prefix;
    const long long ties = s_remaining;  // keys equal to the threshold to take, lowest first
    long long eq_before = 0;
    long long picked_before = 0;
    for (long long base = 0; base < n; base += THREADS) {
        const long long s = base + tid;
        const unsigned int key = s < n ? order_key(row[s]) : 0u;
        const int eq = (s < n && key == threshold) ? 1 : 0;
        int eq_total = 0;
        const int eq_rank = block_scan(eq, buf, &eq_total);
        const int pick = (s < n && (key > threshold || (eq && eq_before + eq_rank < ties))) ? 1 : 0;
        int pick_total = 0;
        const int at = block_scan(pick, buf, &pick_total);
        if (pick) {
            slots[picked_before + at] = static_cast<int>(s);
        }
        eq_before += eq_total;
        picked_before += pick_total;
    }
}
