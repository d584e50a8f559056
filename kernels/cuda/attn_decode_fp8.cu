// DeepSeek-V4 decode attention with all heads of a request against each tile of its rows at
// once, on tensor cores, over the engine's FP8 K=V rows (`engine::paged::layout::RowFormat::
// Fp8Kv`: `nope` e4m3 values, `rope` bf16 values, one ue8m0 scale per 64 nope values, padded
// to 8 bytes). Each row is read from memory once per request, not once per head: the heads are
// the M side of `mma.sync.m16n8k16` (bf16 in, f32 accumulate), as FlashMLA does for V4.
//
// Arithmetic, which the CPU reference `kernels::cpu::attn_decode_fp8` states too:
// - the query is rounded to bf16 (round to nearest even); rows are dequantized exactly
//   (e4m3 * 2^k and bf16 both fit bf16);
// - s = scale * (q . row), accumulated in f32 by the MMA;
// - per tile of 16 rows, each head's running max m and the tile's weights p = exp(s - m),
//   rounded to bf16; the denominator sums the rounded weights, so the output is a convex
//   combination of the rows (error <= 2^-8 of the largest value a row holds);
// - out = sum p * row / (l + exp(sink - m)) over the splits of a request, merged by `_combine`.
// NaN in, NaN out: a NaN score, or a row offset below -1 (an undefined indexer choice), makes
// the head NaN; offset -1 is an empty slot that adds nothing (fixed-size index lists).
//
// Three launches, all shapes fixed by (batch, parts), so a CUDA graph can capture them:
// `_plan` (one thread) cuts every request's tiles into at most `batch + parts` work items of
// about equal length from the lengths in device memory; `_partial` runs one item per block;
// `_combine` merges each (request, head). `kernels::emulate::attn_fp8` is these three kernels
// step by step in Rust, with a model of the MMA fragments, tested in CI.
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "fp4.cuh"
#include "mma_bf16.cuh"

#define TILE 16       // rows per tile: the N of the scores MMA, the K of the output MMA
#define WARPS 16
#define THREADS (WARPS * 32)

// Value `d` of the FP8 row at `row` (dims past nope + rope are padding: 0).
__device__ __forceinline__ float row_value(const uint8_t* __restrict__ row, int d, int nope,
                                           int rope) {
    if (d < nope) {
        return fp4::e4m3_value(row[d]) * fp4::e8m0_value(row[nope + 2 * rope + d / 64]);
    }
    const int at = nope + 2 * (d - nope);
    const unsigned short bits =
        static_cast<unsigned short>(row[at] | (static_cast<unsigned>(row[at + 1]) << 8));
    return __bfloat162float(__ushort_as_bfloat16(bits));
}

// Head h's score of tile row j: the two halves of the dot product, scaled; -inf for an empty
// slot, NaN for an undefined one.
__device__ __forceinline__ float tile_score(const float* s_s, const int* flag_s, int hp, int h,
                                            int j, float scale) {
    const int flag = flag_s[j];
    if (flag == 1) {
        return -INFINITY;
    }
    if (flag == 2) {
        return NAN;
    }
    return (s_s[h * TILE + j] + s_s[(hp + h) * TILE + j]) * scale;
}

// Work items: request b's rows are cut into tiles of TILE (an empty request has one empty
// tile), and its tiles into runs of `per_part = ceil(total / parts)`; item i covers tiles
// [lo, hi) of request b, stored as (b, lo, hi). At most batch + parts items: sum over b of
// ceil(t_b / per_part) <= total / per_part + batch <= parts + batch.
extern "C" __global__ void attn_fp8_plan(const long long* __restrict__ row_starts, int batch,
                                         int parts,
                                         long long* __restrict__ items,        // [batch+parts, 3]
                                         int* __restrict__ split_starts,       // [batch + 1]
                                         int* __restrict__ item_count) {
    if (threadIdx.x != 0 || blockIdx.x != 0) {
        return;
    }
    long long total = 0;
    for (int b = 0; b < batch; ++b) {
        const long long count = row_starts[b + 1] - row_starts[b];
        total += max((count + TILE - 1) / TILE, 1LL);
    }
    const long long per_part = max((total + parts - 1) / parts, 1LL);
    int item = 0;
    for (int b = 0; b < batch; ++b) {
        const long long count = row_starts[b + 1] - row_starts[b];
        const long long tiles = max((count + TILE - 1) / TILE, 1LL);
        split_starts[b] = item;
        for (long long lo = 0; lo < tiles; lo += per_part) {
            items[3LL * item] = b;
            items[3LL * item + 1] = lo;
            items[3LL * item + 2] = min(tiles, lo + per_part);
            ++item;
        }
    }
    split_starts[batch] = item;
    *item_count = item;
}

// Shared memory of `attn_fp8_partial` for `heads` and a row of `dim` values, in bytes; the
// host computes the same (`cuda::attention_fp8::smem_bytes`).
//   q    bf16 [hp][dp + 8]    the request's queries, heads padded to 16, dims to 32
//   kv   bf16 [TILE][dp + 8]  the tile's rows, dequantized
//   s    f32  [2][hp][TILE]   scores, the two halves of the dims summed by the softmax
//   p    bf16 [hp][TILE + 8]  weights
//   m, l, carry  f32 [hp]
//   flag int  [TILE]          0 row, 1 empty slot (-1), 2 undefined (< -1)
extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_fp8_partial(
    const float* __restrict__ q,                  // [batch, heads, nope + rope]
    const uint8_t* __restrict__ pool,             // FP8 rows at byte offsets
    const long long* __restrict__ row_offsets,    // CSR by request
    const long long* __restrict__ row_starts,     // [batch + 1]
    const long long* __restrict__ items, const int* __restrict__ item_count, int heads,
    int nope, int rope, float scale,
    float* __restrict__ part_m,                   // [batch + parts, heads]
    float* __restrict__ part_l,                   // [batch + parts, heads]
    float* __restrict__ part_acc) {               // [batch + parts, heads, nope + rope]
    extern __shared__ __align__(16) unsigned char smem[];
    const int item = blockIdx.x;
    if (item >= *item_count) {
        return;
    }
    const int dim = nope + rope;
    const int dp = (dim + 31) & ~31;
    const int hp = (heads + 15) & ~15;
    const int ldq = dp + 8;
    const int ldp = TILE + 8;
    __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* kv_s = q_s + hp * ldq;
    float* s_s = reinterpret_cast<float*>(kv_s + TILE * ldq);
    __nv_bfloat16* p_s = reinterpret_cast<__nv_bfloat16*>(s_s + 2 * hp * TILE);
    float* m_s = reinterpret_cast<float*>(p_s + hp * ldp);
    float* l_s = m_s + hp;
    float* carry_s = l_s + hp;
    int* flag_s = reinterpret_cast<int*>(carry_s + hp);

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;   // fragment row (and B column)
    const int tq = lane % 4;  // fragment column pair
    const int hb = warp / 4;  // the warp's block of 16 heads
    const bool active = hb * 16 < hp;

    const long long b = items[3LL * item];
    const long long first = row_starts[b];
    const long long count = row_starts[b + 1] - first;
    const long long lo = first + items[3LL * item + 1] * TILE;
    const long long hi = first + min(count, items[3LL * item + 2] * TILE);

    for (int i = tid; i < hp * dp; i += THREADS) {
        const int h = i / dp;
        const int d = i % dp;
        const float v = (h < heads && d < dim) ? q[(b * heads + h) * dim + d] : 0.0f;
        q_s[h * ldq + d] = __float2bfloat16_rn(v);
    }
    if (tid < hp) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    // Output columns of this warp: a quarter of the padded dims, dp / 32 tiles of 8.
    const int quarter = dp / 4;
    const int col0 = (warp % 4) * quarter;
    const int n_tiles = dp / 32;
    float o[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    }
    __syncthreads();

    for (long long t0 = lo; t0 < hi; t0 += TILE) {
        const int rows_here = static_cast<int>(min(static_cast<long long>(TILE), hi - t0));
        if (tid < TILE) {
            int flag = 1;
            if (tid < rows_here) {
                const long long off = row_offsets[t0 + tid];
                flag = off >= 0 ? 0 : (off == -1 ? 1 : 2);
            }
            flag_s[tid] = flag;
        }
        for (int i = tid; i < TILE * dp; i += THREADS) {
            const int j = i / dp;
            const int d = i % dp;
            float v = 0.0f;
            if (j < rows_here && d < dim) {
                const long long off = row_offsets[t0 + j];
                if (off >= 0) {
                    v = row_value(pool + off, d, nope, rope);
                }
            }
            kv_s[j * ldq + d] = __float2bfloat16_rn(v);
        }
        __syncthreads();

        // Scores: warp (hb, nt, kh) computes heads hb*16.., rows nt*8.. over half the dims.
        if (active) {
            const int nt = (warp / 2) % 2;
            const int kh = warp % 2;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const __nv_bfloat16* qa = q_s + (hb * 16 + g) * ldq;
            const __nv_bfloat16* kb = kv_s + (nt * 8 + g) * ldq;
            const int steps = dp / 32;
            for (int ks = kh * steps; ks < (kh + 1) * steps; ++ks) {
                const int k0 = ks * 16 + 2 * tq;
                const uint32_t a[4] = {ld_pair(qa + k0), ld_pair(qa + 8 * ldq + k0),
                                       ld_pair(qa + k0 + 8), ld_pair(qa + 8 * ldq + k0 + 8)};
                const uint32_t bb[2] = {ld_pair(kb + k0), ld_pair(kb + k0 + 8)};
                mma_16816(acc, a, bb);
            }
            float* half = s_s + kh * hp * TILE;
            const int r = hb * 16 + g;
            const int c = nt * 8 + 2 * tq;
            half[r * TILE + c] = acc[0];
            half[r * TILE + c + 1] = acc[1];
            half[(r + 8) * TILE + c] = acc[2];
            half[(r + 8) * TILE + c + 1] = acc[3];
        }
        __syncthreads();

        // Online softmax, one thread per head, rows in order (the scores are read twice
        // rather than held: the accumulators need the registers).
        if (tid < hp) {
            const int h = tid;
            const float m_old = m_s[h];
            float m_new = m_old;
            for (int j = 0; j < TILE; ++j) {
                const float s = tile_score(s_s, flag_s, hp, h, j, scale);
                m_new = (isnan(s) || isnan(m_new)) ? NAN : fmaxf(m_new, s);
            }
            const float carry = (m_old == -INFINITY) ? 0.0f : expf(m_old - m_new);
            float sum = 0.0f;
            for (int j = 0; j < TILE; ++j) {
                const float s = tile_score(s_s, flag_s, hp, h, j, scale);
                const float p = (s == -INFINITY) ? 0.0f : expf(s - m_new);
                const __nv_bfloat16 pb = __float2bfloat16_rn(p);
                p_s[h * ldp + j] = pb;
                sum += __bfloat162float(pb);
            }
            l_s[h] = l_s[h] * carry + sum;
            carry_s[h] = carry;
            m_s[h] = m_new;
        }
        __syncthreads();

        // Output: warp (hb, quarter) rescales its accumulators and adds P (16 x TILE) times
        // the tile (TILE x its columns).
        if (active) {
            const float c_lo = carry_s[hb * 16 + g];
            const float c_hi = carry_s[hb * 16 + g + 8];
            const __nv_bfloat16* pa = p_s + (hb * 16 + g) * ldp + 2 * tq;
            const uint32_t a[4] = {ld_pair(pa), ld_pair(pa + 8 * ldp), ld_pair(pa + 8),
                                   ld_pair(pa + 8 * ldp + 8)};
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                if (i < n_tiles) {
                    const int col = col0 + i * 8 + g;
                    o[i][0] *= c_lo;
                    o[i][1] *= c_lo;
                    o[i][2] *= c_hi;
                    o[i][3] *= c_hi;
                    const uint32_t bb[2] = {
                        pack(kv_s[(2 * tq) * ldq + col], kv_s[(2 * tq + 1) * ldq + col]),
                        pack(kv_s[(2 * tq + 8) * ldq + col], kv_s[(2 * tq + 9) * ldq + col])};
                    mma_16816(o[i], a, bb);
                }
            }
        }
        __syncthreads();
    }

    if (tid < heads) {
        part_m[static_cast<long long>(item) * heads + tid] = m_s[tid];
        part_l[static_cast<long long>(item) * heads + tid] = l_s[tid];
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            if (i < n_tiles) {
                const int c = col0 + i * 8 + 2 * tq;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int r = hb * 16 + g + (k / 2) * 8;
                    const int cc = c + k % 2;
                    if (r < heads && cc < dim) {
                        part_acc[(static_cast<long long>(item) * heads + r) * dim + cc] = o[i][k];
                    }
                }
            }
        }
    }
}

// Merges request b's items for head h (grid batch * heads): a log-sum-exp with the sink in
// the denominator. Items whose m is -inf (no row) contribute nothing; a NaN sink, m or l makes
// the head NaN.
extern "C" __global__ void attn_fp8_combine(const float* __restrict__ part_m,
                                            const float* __restrict__ part_l,
                                            const float* __restrict__ part_acc,
                                            const int* __restrict__ split_starts,
                                            const float* __restrict__ sinks, int heads, int dim,
                                            float* __restrict__ out) {  // [batch, heads, dim]
    const long long bh = blockIdx.x;
    const int b = static_cast<int>(bh / heads);
    const int h = static_cast<int>(bh % heads);
    const int s0 = split_starts[b];
    const int s1 = split_starts[b + 1];
    const float sink = sinks[h];
    bool poisoned = isnan(sink);
    for (int s = s0; s < s1; ++s) {
        const long long at = static_cast<long long>(s) * heads + h;
        poisoned = poisoned || isnan(part_m[at]) || isnan(part_l[at]);
    }
    if (poisoned) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            out[bh * dim + d] = NAN;
        }
        return;
    }
    float big = sink;
    for (int s = s0; s < s1; ++s) {
        big = fmaxf(big, part_m[static_cast<long long>(s) * heads + h]);
    }
    float denom = expf(sink - big);
    for (int s = s0; s < s1; ++s) {
        const long long at = static_cast<long long>(s) * heads + h;
        if (part_m[at] != -INFINITY) {
            denom += part_l[at] * expf(part_m[at] - big);
        }
    }
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = 0.0f;
        for (int s = s0; s < s1; ++s) {
            const long long at = static_cast<long long>(s) * heads + h;
            if (part_m[at] != -INFINITY) {
                v += part_acc[at * dim + d] * expf(part_m[at] - big);
            }
        }
        out[bh * dim + d] = v / denom;
    }
}
