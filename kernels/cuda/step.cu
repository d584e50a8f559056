// The device decode step's data movement (`kernels::step`, `cuda::CudaStepOps`): embedding
// rows, row copies between activations and the state arenas, the compressor windows' position
// bias, a scale, and the attention key offsets of the indexer's choice. The only arithmetic is
// the engine's own (one add, one multiply, `_rn`), so the step keeps the CPU's bits. Offsets
// are 64-bit element (or byte, where said) offsets.
#include <stdint.h>

// out[t, s * dim + c] = row tokens[t] of the table for each of the hc streams (the engine's
// `embed.row_f32(t).repeat(hc)`); the table is f32 (bf16 == 0) or bf16 bits. A token outside
// the table gives a NaN row. One block per token.
extern "C" __global__ void embed_rows(const void* __restrict__ table, int bf16, long long rows,
                                      long long dim, const int* __restrict__ tokens, int hc,
                                      float* __restrict__ out) {
    const long long t = blockIdx.x;
    const long long token = tokens[t];
    const bool ok = token >= 0 && token < rows;
    for (long long c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = __uint_as_float(0x7fc00000u);
        if (ok) {
            if (bf16) {
                const uint16_t bits = static_cast<const uint16_t*>(table)[token * dim + c];
                v = __uint_as_float(static_cast<unsigned int>(bits) << 16);
            } else {
                v = static_cast<const float*>(table)[token * dim + c];
            }
        }
        for (int s = 0; s < hc; ++s) {
            out[(t * hc + s) * dim + c] = v;
        }
    }
}

// Row i: `width` floats from src + src_offsets[i] to dst + dst_offsets[i]; a negative
// destination skips the row. One block per row.
extern "C" __global__ void copy_rows(const float* __restrict__ src,
                                     const long long* __restrict__ src_offsets,
                                     float* __restrict__ dst,
                                     const long long* __restrict__ dst_offsets, long long width) {
    const long long i = blockIdx.x;
    const long long to = dst_offsets[i];
    if (to < 0) {
        return;
    }
    const float* from = src + src_offsets[i];
    for (long long c = threadIdx.x; c < width; c += blockDim.x) {
        dst[to + c] = from[c];
    }
}

// Piece i: plan[3i + 1] floats from the device address plan[3i] to dst + plan[3i + 2]. One
// block per piece: a state's many small pieces (rows of several arenas) gathered into one
// buffer by one launch, to cross to the host in one copy.
extern "C" __global__ void gather_pieces(const long long* __restrict__ plan,
                                         float* __restrict__ dst) {
    const long long i = blockIdx.x;
    const float* from = reinterpret_cast<const float*>(plan[3 * i]);
    const long long n = plan[3 * i + 1];
    float* to = dst + plan[3 * i + 2];
    for (long long c = threadIdx.x; c < n; c += blockDim.x) {
        to[c] = from[c];
    }
}

// x[i] += bias[i % period] for the first n values (each closed window's gate scores plus the
// position bias, `period` = ratio * width).
extern "C" __global__ void add_periodic(float* __restrict__ x, const float* __restrict__ bias,
                                        long long period, long long n) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] = __fadd_rn(x[i], bias[i % period]);
    }
}

// out[i] = x[i] + x[part + i] + ... + x[(blocks - 1) * part + i] for i < part, added in block
// order (an expert-slice group's partial outputs, gathered by rank, summed in rank order as
// the host sums them). One thread per value.
extern "C" __global__ void sum_blocks(const float* __restrict__ x, long long blocks,
                                      long long part, float* __restrict__ out) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= part) {
        return;
    }
    float s = x[i];
    for (long long b = 1; b < blocks; ++b) {
        s = __fadd_rn(s, x[b * part + i]);
    }
    out[i] = s;
}

// ids[p] = experts[p] - first for an expert this rank holds (first <= e < first + held), -1 for
// another rank's (below total), -2 for none of the model's: a tensor-parallel rank's pairs (every
// rank has them all) through the experts it holds. One thread per pair.
extern "C" __global__ void held_ids(const int* __restrict__ experts, long long first,
                                    long long held, long long total, long long pairs,
                                    int* __restrict__ ids) {
    const long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (p >= pairs) {
        return;
    }
    const long long e = experts[p];
    ids[p] = (e >= first && e - first < held) ? static_cast<int>(e - first)
                                               : ((e >= 0 && e < total) ? -1 : -2);
}

// Row p of `width` values of ys set to -0.0 where ids[p] is -1 (another rank's expert): -0 is the
// identity of the all-reduce that merges the ranks' rows, so each row comes out as the rank that
// holds its expert computed it. One thread per value.
extern "C" __global__ void clear_unheld_rows(float* __restrict__ ys, const int* __restrict__ ids,
                                             long long width, long long pairs) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= pairs * width) {
        return;
    }
    if (ids[i / width] == -1) {
        ys[i] = -0.0f;
    }
}

// x[i] *= s for the first n values (the indexer's head weights times heads^-0.5).
extern "C" __global__ void scale_values(float* __restrict__ x, float s, long long n) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] = __fmul_rn(x[i], s);
    }
}

// The key offsets of the indexer's choice: for entry t, token tokens[t]'s `counts[t]` chosen
// rows (chosen[tokens[t] * k ..], ascending; -2 in every slot when the choice is undefined) as
// byte offsets from bases[t] (`row_bytes` each) into offsets[starts[t] ..]; -2 when poisoned
// (below -1, the empty slot of `attn_decode_fp8`: both attention kernels make the token NaN).
extern "C" __global__ void chosen_offsets(const int* __restrict__ chosen, int k,
                                          const int* __restrict__ tokens,
                                          const long long* __restrict__ starts,
                                          const int* __restrict__ counts,
                                          const long long* __restrict__ bases,
                                          long long row_bytes, int n,
                                          long long* __restrict__ offsets) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) {
        return;
    }
    const int* mine = chosen + static_cast<long long>(tokens[t]) * k;
    const bool poisoned = k > 0 && mine[0] == -2;
    for (int j = 0; j < counts[t]; ++j) {
        const int row = mine[j];
        offsets[starts[t] + j] = (poisoned || row < 0) ? -2 : bases[t] + row * row_bytes;
    }
}

// Per row of `width` logits: out[2r] the index of the largest value (ties to the lowest index,
// only a strictly larger value replaces the best, as greedy sampling picks), out[2r + 1] the
// index of the first value that is not finite, or -1. One block of 256 threads per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, long long width,
                                       int* __restrict__ out) {
    const long long row = blockIdx.x;
    const float* v = x + row * width;
    float best = -INFINITY;
    long long best_at = width;  // none yet
    long long bad_at = width;   // none yet
    for (long long i = threadIdx.x; i < width; i += blockDim.x) {
        const float value = v[i];
        if (!isfinite(value)) {
            bad_at = bad_at < i ? bad_at : i;
        } else if (best_at == width || value > best) {
            // A thread's indices rise, so a tie keeps its earlier (lower) index.
            best = value;
            best_at = i;
        }
    }
    __shared__ float best_of[256];
    __shared__ long long best_at_of[256];
    __shared__ long long bad_at_of[256];
    best_of[threadIdx.x] = best;
    best_at_of[threadIdx.x] = best_at;
    bad_at_of[threadIdx.x] = bad_at;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            const int other = threadIdx.x + half;
            const long long a = best_at_of[threadIdx.x], b = best_at_of[other];
            // The other's best wins if it is larger, or equal at a lower index; an empty
            // side never wins.
            if (b != width &&
                (a == width || best_of[other] > best_of[threadIdx.x] ||
                 (best_of[other] == best_of[threadIdx.x] && b < a))) {
                best_of[threadIdx.x] = best_of[other];
                best_at_of[threadIdx.x] = b;
            }
            const long long c = bad_at_of[other];
            bad_at_of[threadIdx.x] = bad_at_of[threadIdx.x] < c ? bad_at_of[threadIdx.x] : c;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const long long at = best_at_of[0] == width ? 0 : best_at_of[0];
        out[2 * row] = static_cast<int>(at);
        out[2 * row + 1] = bad_at_of[0] == width ? -1 : static_cast<int>(bad_at_of[0]);
    }
}

// Expert-parallel dispatch (`kernels::step::device_group`): a rank's messages to the ranks
// holding its pairs' experts, the host framing of `engine::parallel::expert::dispatch_messages`
// (per destination d: its count c_d, the pairs' global expert ids, then their rows). Pair p's
// expert e is valid in [0, ranks * per_rank) and goes to d = e / per_rank; counts[d] = c_d,
// counts[ranks] the invalid pairs (pack_to and back_from -1). Message d starts at
// S_d = sum_{d' < d} (1 + c_d' (1 + width)); the j-th pair to d (in pair order) has its id at
// S_d + 1 + j, its row put at pack_to[p] = S_d + 1 + c_d + j width (by `copy_rows`), and its
// output read back from back_from[p] = (c_0 + .. + c_{d-1} + j) width. One block of
// EP_SLOTS_THREADS threads, each over a contiguous run of pairs, so order is kept.
#define EP_SLOTS_THREADS 256
extern "C" __global__ void ep_slots(const int* __restrict__ experts, long long pairs,
                                    long long ranks, long long per_rank, long long width,
                                    float* __restrict__ send, long long* __restrict__ pack_to,
                                    long long* __restrict__ back_from,
                                    int* __restrict__ counts) {
    __shared__ long long before[EP_SLOTS_THREADS + 1];
    const long long run = (pairs + EP_SLOTS_THREADS - 1) / EP_SLOTS_THREADS;
    const long long lo = min(pairs, static_cast<long long>(threadIdx.x) * run);
    const long long hi = min(pairs, lo + run);
    const long long experts_total = ranks * per_rank;
    long long start = 0;
    long long row = 0;
    // d == ranks: the invalid pairs.
    for (long long d = 0; d <= ranks; ++d) {
        long long mine = 0;
        for (long long p = lo; p < hi; ++p) {
            const long long e = experts[p];
            const long long to = (e >= 0 && e < experts_total) ? e / per_rank : ranks;
            mine += to == d;
        }
        before[threadIdx.x] = mine;
        __syncthreads();
        if (threadIdx.x == 0) {
            long long acc = 0;
            for (int t = 0; t < EP_SLOTS_THREADS; ++t) {
                const long long c = before[t];
                before[t] = acc;
                acc += c;
            }
            before[EP_SLOTS_THREADS] = acc;
        }
        __syncthreads();
        const long long count = before[EP_SLOTS_THREADS];
        long long j = before[threadIdx.x];
        for (long long p = lo; p < hi; ++p) {
            const long long e = experts[p];
            const long long to = (e >= 0 && e < experts_total) ? e / per_rank : ranks;
            if (to != d) {
                continue;
            }
            if (d < ranks) {
                send[start + 1 + j] = static_cast<float>(e);
                pack_to[p] = start + 1 + count + j * width;
                back_from[p] = (row + j) * width;
            } else {
                pack_to[p] = -1;
                back_from[p] = -1;
            }
            ++j;
        }
        if (threadIdx.x == 0) {
            if (d < ranks) {
                send[start] = static_cast<float>(count);
            }
            counts[d] = static_cast<int>(count);
        }
        start += 1 + count * (1 + width);
        row += count;
        // `before` is read again for the next destination.
        __syncthreads();
    }
}

// ids[i] = recv[at[i]] - first where that is a whole number in [0, held) (an expert this rank
// holds, as its index among them), else -1 (NaN and infinities included): the expert kernels
// answer -1 with a NaN row. One thread per row.
extern "C" __global__ void ep_take_ids(const float* __restrict__ recv,
                                       const long long* __restrict__ at, long long first,
                                       long long held, long long m, int* __restrict__ ids) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= m) {
        return;
    }
    const float v = recv[at[i]];
    const float local = v - static_cast<float>(first);
    const bool ok = v == floorf(v) && local >= 0.0f && local < static_cast<float>(held);
    ids[i] = ok ? static_cast<int>(local) : -1;
}
