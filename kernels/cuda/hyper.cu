// The manifold-constrained hyper-connections of DeepSeek-V4 on the device, bit for bit as the
// engine computes them (`engine::model::hyper`), given the mixing projections' outputs (the
// linears run as GEMVs elsewhere): sigmoid and softmax through `exact::exp`, the same sums in
// the same order, IEEE divisions, no contracted multiply-adds.
//
// `hyper_pre`  per token: pre / post / comb from its mixes (`hyper::pre_from_mixes`: sigmoid
//              gates, row softmax + eps, Sinkhorn normalisation), and the collapsed sublayer
//              input sum_i pre[i] * x[i].
// `hyper_post` per token: out[k] = post[k] * y + sum_j comb[j][k] * x[j].
// `hyper_head` per token: the final collapse with sigmoid(m_i * scale + base_i) + eps weights.
#include <math.h>
#include <stdint.h>

#include "exact.cuh"

#define MAX_HC 8

// One block per token; thread 0 derives the token's mixing weights (a few dozen values), then
// every thread collapses its dims. mixes: [tokens, (2 + hc) * hc]; x: [tokens, hc * dim].
extern "C" __global__ void hyper_pre(const float* __restrict__ x, const float* __restrict__ mixes,
                                     const float* __restrict__ scale,  // [3]
                                     const float* __restrict__ base,   // [(2 + hc) * hc]
                                     int hc, long long dim, float eps, int iters,
                                     float* __restrict__ collapsed,    // [tokens, dim]
                                     float* __restrict__ post_out,     // [tokens, hc]
                                     float* __restrict__ comb_out) {   // [tokens, hc * hc]
    __shared__ float pre[MAX_HC];
    __shared__ float c[MAX_HC * MAX_HC];
    const long long t = blockIdx.x;
    const int width = (2 + hc) * hc;
    const float* m = mixes + t * width;
    if (threadIdx.x == 0) {
        for (int i = 0; i < hc; ++i) {
            pre[i] = __fadd_rn(exact::sigmoid(__fadd_rn(__fmul_rn(m[i], scale[0]), base[i])), eps);
            post_out[t * hc + i] = __fmul_rn(
                2.0f, exact::sigmoid(__fadd_rn(__fmul_rn(m[hc + i], scale[1]), base[hc + i])));
        }
        for (int i = 0; i < hc * hc; ++i) {
            c[i] = __fadd_rn(__fmul_rn(m[2 * hc + i], scale[2]), base[2 * hc + i]);
        }
        // Row softmax (max-subtracted, `tensor::softmax`), then + eps.
        for (int r = 0; r < hc; ++r) {
            float* row = c + r * hc;
            float big = -INFINITY;
            for (int i = 0; i < hc; ++i) {
                big = fmaxf(big, row[i]);
            }
            float sum = 0.0f;
            for (int i = 0; i < hc; ++i) {
                row[i] = exact::exp(__fsub_rn(row[i], big));
                sum = __fadd_rn(sum, row[i]);
            }
            for (int i = 0; i < hc; ++i) {
                row[i] = __fadd_rn(__fdiv_rn(row[i], sum), eps);
            }
        }
        // Sinkhorn: columns, then (iters - 1) times rows and columns; each sum in index order
        // plus eps (the engine's `sum::<f32>()` starts from -0, which adds nothing).
        const int rounds = iters < 1 ? 1 : iters;
        for (int it = 0; it < rounds; ++it) {
            if (it > 0) {
                for (int r = 0; r < hc; ++r) {
                    float sum = c[r * hc];
                    for (int i = 1; i < hc; ++i) {
                        sum = __fadd_rn(sum, c[r * hc + i]);
                    }
                    sum = __fadd_rn(sum, eps);
                    for (int i = 0; i < hc; ++i) {
                        c[r * hc + i] = __fdiv_rn(c[r * hc + i], sum);
                    }
                }
            }
            for (int col = 0; col < hc; ++col) {
                float sum = c[col];
                for (int r = 1; r < hc; ++r) {
                    sum = __fadd_rn(sum, c[r * hc + col]);
                }
                sum = __fadd_rn(sum, eps);
                for (int r = 0; r < hc; ++r) {
                    c[r * hc + col] = __fdiv_rn(c[r * hc + col], sum);
                }
            }
        }
        for (int i = 0; i < hc * hc; ++i) {
            comb_out[t * hc * hc + i] = c[i];
        }
    }
    __syncthreads();
    const float* xs = x + t * hc * dim;
    for (long long d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < hc; ++i) {
            acc = __fadd_rn(acc, __fmul_rn(pre[i], xs[i * dim + d]));
        }
        collapsed[t * dim + d] = acc;
    }
}

// One block per token.
extern "C" __global__ void hyper_post(const float* __restrict__ x, const float* __restrict__ y,
                                      const float* __restrict__ post, const float* __restrict__ comb,
                                      int hc, long long dim, float* __restrict__ out) {
    const long long t = blockIdx.x;
    const float* xs = x + t * hc * dim;
    const float* p = post + t * hc;
    const float* c = comb + t * hc * hc;
    for (long long d = threadIdx.x; d < dim; d += blockDim.x) {
        const float yd = y[t * dim + d];
        for (int k = 0; k < hc; ++k) {
            float o = __fmul_rn(p[k], yd);
            for (int j = 0; j < hc; ++j) {
                o = __fadd_rn(o, __fmul_rn(c[j * hc + k], xs[j * dim + d]));
            }
            out[t * hc * dim + k * dim + d] = o;
        }
    }
}

// One block per token; mix: [tokens, hc] (the head's mixing projection of the normed streams).
extern "C" __global__ void hyper_head(const float* __restrict__ x, const float* __restrict__ mix,
                                      float scale, const float* __restrict__ base, int hc,
                                      long long dim, float eps, float* __restrict__ out) {
    __shared__ float p[MAX_HC];
    const long long t = blockIdx.x;
    const float* xs = x + t * hc * dim;
    if (threadIdx.x < hc) {
        const int i = threadIdx.x;
        p[i] = __fadd_rn(exact::sigmoid(__fadd_rn(__fmul_rn(mix[t * hc + i], scale), base[i])), eps);
    }
    __syncthreads();
    for (long long d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < hc; ++i) {
            acc = __fadd_rn(acc, __fmul_rn(p[i], xs[i * dim + d]));
        }
        out[t * dim + d] = acc;
    }
}

// `engine::tensor::exp` over a buffer, for the exhaustive check of `exact::exp` on a device.
extern "C" __global__ void exact_exp(const float* __restrict__ x, long long n, float* __restrict__ y) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = exact::exp(x[i]);
    }
}
