// DeepSeek-V4 lightning indexer for decode: score every visible compressed key of a request,
// score_s = sum_h w_h * relu(q_h . k_s) * scale, then keep the top `k` (ties: lower index
// first), where only the first `visible[b]` keys of request b exist for its query (causal
// rule: a compressed row is visible once its window has closed). NaN in, NaN out: the ReLU keeps
// a NaN, and a request with a NaN among its visible scores gets TOPK_POISONED (-2) in every
// slot instead of a selection. Index arithmetic is 64-bit. The CPU reference is
// `kernels::cpu::indexer_topk` (same rule as the engine's CPU model); `kernels::emulate::
// topk_rounds` is `indexer_topk` step by step in Rust, tested in CI.
#include <stdint.h>
#include <math.h>

#define THREADS 256

// One warp per (request, key). keys: f32 rows of `dim`, CSR by request (key_starts);
// q: [B, heads, dim]; w: [B, heads] (already scaled by heads^-0.5).
extern "C" __global__ void indexer_scores(const float* __restrict__ q, const float* __restrict__ w,
                                          const float* __restrict__ keys,
                                          const long long* __restrict__ key_starts,
                                          const int* __restrict__ visible, int batch, int heads,
                                          int dim, float scale, long long max_keys,
                                          float* __restrict__ scores) {  // [B, max_keys]
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const long long b = warp / max_keys;
    const long long s = warp % max_keys;
    if (b >= batch || s >= visible[b]) {
        return;
    }
    const float* key = keys + (key_starts[b] + s) * dim;
    float total = 0.0f;
    for (int h = 0; h < heads; ++h) {
        const float* qh = q + (b * heads + h) * dim;
        float dotp = 0.0f;
        for (int d = lane; d < dim; d += 32) {
            dotp += qh[d] * key[d];
        }
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) {
            dotp += __shfl_down_sync(0xffffffffu, dotp, off);
        }
        const float relu = isnan(dotp) ? dotp : fmaxf(dotp, 0.0f);
        total += relu * scale * w[b * heads + h];
    }
    if (lane == 0) {
        scores[b * max_keys + s] = total;
    }
}

// One block per request: k rounds of (max score, lowest index) over the visible keys not yet
// taken. Writes `min(k, visible)` indices (in selection order) and -1 for the rest; -2 in
// every slot when a visible score is NaN (taken keys are then marked NaN).
extern "C" __global__ void indexer_topk(float* __restrict__ scores, const int* __restrict__ visible,
                                        long long max_keys, int k, int* __restrict__ out) {
    const int b = blockIdx.x;
    const int n = visible[b];
    float* row = scores + static_cast<long long>(b) * max_keys;
    int* slots = out + static_cast<long long>(b) * k;
    __shared__ float best_score[THREADS];
    __shared__ int best_index[THREADS];
    int nan_seen = 0;
    for (int s = threadIdx.x; s < n; s += THREADS) {
        nan_seen |= isnan(row[s]) ? 1 : 0;
    }
    if (__syncthreads_or(nan_seen)) {
        for (int round = threadIdx.x; round < k; round += THREADS) {
            slots[round] = -2;
        }
        return;
    }
    const int take = min(k, n);
    for (int round = 0; round < k; ++round) {
        if (round >= take) {
            if (threadIdx.x == 0) {
                slots[round] = -1;
            }
            continue;
        }
        float bs = -INFINITY;
        int bi = 0x7fffffff;
        for (int s = threadIdx.x; s < n; s += THREADS) {
            const float v = row[s];
            if (!isnan(v) && (v > bs || (v == bs && s < bi))) {
                bs = v;
                bi = s;
            }
        }
        best_score[threadIdx.x] = bs;
        best_index[threadIdx.x] = bi;
        __syncthreads();
        for (int stride = THREADS / 2; stride > 0; stride /= 2) {
            if (threadIdx.x < stride) {
                const float os = best_score[threadIdx.x + stride];
                const int oi = best_index[threadIdx.x + stride];
                if (os > best_score[threadIdx.x] ||
                    (os == best_score[threadIdx.x] && oi < best_index[threadIdx.x])) {
                    best_score[threadIdx.x] = os;
                    best_index[threadIdx.x] = oi;
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            // Always a visible index: no score is NaN and round < n keys remain untaken.
            const int chosen = best_index[0];
            const bool valid = chosen >= 0 && chosen < n;
            slots[round] = valid ? chosen : -2;
            if (valid) {
                row[chosen] = NAN;  // taken
            }
        }
        __syncthreads();
    }
}
