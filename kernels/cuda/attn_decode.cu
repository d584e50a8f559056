// DeepSeek-V4 decode attention over rows gathered from the paged state pool.
//
// For each request b and head h: scores s_j = scale * (q[b,h] . row_j) over the request's rows
// (its sliding-window K=V rows and the compressed rows chosen for it: the indexer's top-k for
// CSA layers, all visible ones for HCA), a per-head sink logit in the softmax denominator only,
// and out = sum_j p_j * row_j (K = V). Rows are addressed by 64-bit byte offsets into the pool
// (`row_offsets`, CSR by request via `row_starts`), so any page table and page size work.
//
// Split-KV: kernel 1 computes, per (request, head, split), the running max m, the sum l of
// exp(s - m) and the unnormalised accumulator; kernel 2 merges the splits with a log-sum-exp
// that treats empty splits (m = -inf, l = 0) as contributing nothing, and adds the sink.
// NaN in, NaN out: a NaN score makes its split's m NaN for good (fmaxf alone would drop it, and
// a split whose scores are all NaN would look empty), and the merge makes the head NaN when a
// split's m or l or the sink is NaN. A -inf score adds nothing, even to an empty split.
// The CPU reference is `kernels::cpu::attn_decode` (f64); `kernels::emulate::attn_decode` is
// these two kernels step by step in Rust, tested in CI against it.
#include <stdint.h>
#include <math.h>

#define THREADS 128

extern "C" __global__ void attn_decode_partial(
    const float* __restrict__ q,            // [B, H, D]
    const uint8_t* __restrict__ pool,       // pool bytes; rows are f32[D]
    const long long* __restrict__ row_offsets,  // byte offsets of rows, CSR by request
    const long long* __restrict__ row_starts,   // [B + 1]
    int heads, int dim, int splits, float scale,
    float* __restrict__ part_m,             // [B, H, S]
    float* __restrict__ part_l,             // [B, H, S]
    float* __restrict__ part_acc) {         // [B, H, S, D]
    const int bh = blockIdx.x;
    const int b = bh / heads;
    const int split = blockIdx.y;
    const long long first = row_starts[b];
    const long long count = row_starts[b + 1] - first;
    const long long per_split = (count + splits - 1) / splits;
    const long long lo = first + split * per_split;
    const long long hi = min(first + count, lo + per_split);
    const float* qv = q + static_cast<long long>(bh) * dim;

    __shared__ float red[THREADS];
    float m = -INFINITY, l = 0.0f;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // dims tid + k*THREADS, dim <= 512

    for (long long j = lo; j < hi; ++j) {
        const float* row = reinterpret_cast<const float*>(pool + row_offsets[j]);
        float partial = 0.0f;
        for (int d = threadIdx.x; d < dim; d += THREADS) {
            partial += qv[d] * row[d];
        }
        red[threadIdx.x] = partial;
        __syncthreads();
        for (int stride = THREADS / 2; stride > 0; stride /= 2) {
            if (threadIdx.x < stride) {
                red[threadIdx.x] += red[threadIdx.x + stride];
            }
            __syncthreads();
        }
        const float s = red[0] * scale;
        __syncthreads();
        const float m_new = (isnan(s) || isnan(m)) ? NAN : fmaxf(m, s);
        const float carry = (m == -INFINITY) ? 0.0f : expf(m - m_new);
        const float w = (s == -INFINITY) ? 0.0f : expf(s - m_new);
        l = l * carry + w;
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int d = threadIdx.x + k * THREADS;
            if (d < dim) {
                acc[k] = acc[k] * carry + w * row[d];
            }
        }
        m = m_new;
    }
    const long long slot = static_cast<long long>(bh) * splits + split;
    if (threadIdx.x == 0) {
        part_m[slot] = m;
        part_l[slot] = l;
    }
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int d = threadIdx.x + k * THREADS;
        if (d < dim) {
            part_acc[slot * dim + d] = acc[k];
        }
    }
}

extern "C" __global__ void attn_decode_merge(
    const float* __restrict__ part_m, const float* __restrict__ part_l,
    const float* __restrict__ part_acc, const float* __restrict__ sinks,  // [H]
    int heads, int dim, int splits,
    float* __restrict__ out) {  // [B, H, D]
    const int bh = blockIdx.x;
    const int h = bh % heads;
    const long long base = static_cast<long long>(bh) * splits;
    const float sink = sinks[h];
    bool poisoned = isnan(sink);
    for (int s = 0; s < splits; ++s) {
        poisoned = poisoned || isnan(part_m[base + s]) || isnan(part_l[base + s]);
    }
    if (poisoned) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            out[static_cast<long long>(bh) * dim + d] = NAN;
        }
        return;
    }
    float big = sink;
    for (int s = 0; s < splits; ++s) {
        big = fmaxf(big, part_m[base + s]);  // -inf splits never win
    }
    float denom = expf(sink - big);
    for (int s = 0; s < splits; ++s) {
        const float ms = part_m[base + s];
        if (ms != -INFINITY) {
            denom += part_l[base + s] * expf(ms - big);
        }
    }
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ms = part_m[base + s];
            if (ms != -INFINITY) {
                v += part_acc[(base + s) * dim + d] * expf(ms - big);
            }
        }
        out[static_cast<long long>(bh) * dim + d] = v / denom;
    }
}
