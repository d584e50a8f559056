// DeepSeek-V4 lightning indexer for decode: score every visible compressed key of a request,
// score_s = sum_h w_h * relu(q_h . k_s) * scale, then keep the top `k` by radix select (in
// f32 total order, -0 below +0; ties: lower index first; linear in the keys), where only the
// first `visible[b]` keys of request b exist for its query (causal rule: a compressed row is
// visible once its window has closed). NaN in, NaN out: the ReLU keeps
// a NaN, and a request with a NaN among its visible scores gets TOPK_POISONED (-2) in every
// slot instead of a selection. Index arithmetic is 64-bit. The CPU reference is
// `kernels::cpu::indexer_topk` (same rule as the engine's CPU model); `kernels::emulate::
// topk_radix` is `indexer_topk` step by step in Rust, tested in CI.
#include <stdint.h>
#include <math.h>

#include "exact.cuh"

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
