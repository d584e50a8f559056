// A closed compressor window's row on the device, with the engine's bits
// (`engine::model::compressor::pool_window`): per channel the softmax over the window's gate
// scores (position bias already added; `exact::exp`, the max from -inf ignoring NaN, the sum
// from 0 in slot order, a division), then the slots' kv weighted in slot order, a multiply then
// an add. With overlap (CSA) the previous window's Ca slices come first (score -inf, weight 0,
// before the first window) and the window's Cb slices (channels d.. of each slot) after; without
// (HCA) the window's own slots. The softmax is recomputed pass by pass instead of held (a
// 128-slot window would not fit in registers); the recomputed values are the same bits. The
// row's norm and rotation follow in `norm_rope_rows`.
#include <math.h>
#include <stdint.h>

#include "exact.cuh"

// Score of slot s of 0..slots for channel c of window r.
__device__ __forceinline__ float slot_score(const float* gate, const float* prev_gate, bool overlap,
                                            bool has_prev, int ratio, int d, long long width, int s,
                                            int c) {
    if (!overlap) {
        return gate[s * width + c];
    }
    if (s < ratio) {
        return has_prev ? prev_gate[s * d + c] : -INFINITY;
    }
    return gate[(s - ratio) * width + d + c];
}

// One thread per (window, channel). kv, gate: [windows, ratio, width]; prev_kv, prev_gate:
// [windows, ratio, d] (read only with overlap and has_prev[r] != 0); out: [windows, d].
extern "C" __global__ void compress_pool(const float* __restrict__ kv, const float* __restrict__ gate,
                                         const float* __restrict__ prev_kv,
                                         const float* __restrict__ prev_gate,
                                         const int* __restrict__ has_prev, int windows, int ratio,
                                         int d, long long width, int overlap,
                                         float* __restrict__ out) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<long long>(windows) * d) {
        return;
    }
    const int r = static_cast<int>(i / d);
    const int c = static_cast<int>(i % d);
    const float* k = kv + static_cast<long long>(r) * ratio * width;
    const float* g = gate + static_cast<long long>(r) * ratio * width;
    const float* pk = prev_kv + static_cast<long long>(r) * ratio * d;
    const float* pg = prev_gate + static_cast<long long>(r) * ratio * d;
    const bool ov = overlap != 0;
    const bool hp = ov && has_prev[r] != 0;
    const int slots = ov ? 2 * ratio : ratio;
    float big = -INFINITY;
    for (int s = 0; s < slots; ++s) {
        big = fmaxf(big, slot_score(g, pg, ov, hp, ratio, d, width, s, c));
    }
    float sum = 0.0f;
    for (int s = 0; s < slots; ++s) {
        sum = __fadd_rn(sum, exact::exp(__fsub_rn(slot_score(g, pg, ov, hp, ratio, d, width, s, c), big)));
    }
    float o = 0.0f;
    for (int s = 0; s < slots; ++s) {
        const float p =
            __fdiv_rn(exact::exp(__fsub_rn(slot_score(g, pg, ov, hp, ratio, d, width, s, c), big)), sum);
        if (!ov) {
            o = __fadd_rn(o, __fmul_rn(k[s * width + c], p));
        } else if (s < ratio) {
            if (hp) {
                o = __fadd_rn(o, __fmul_rn(pk[s * d + c], p));
            }
        } else {
            o = __fadd_rn(o, __fmul_rn(k[(s - ratio) * width + d + c], p));
        }
    }
    out[i] = o;
}
