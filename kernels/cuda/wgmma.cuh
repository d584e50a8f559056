// Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a only) over bf16 operands that the block's
// threads stage in shared memory: the tensor-core core of the sm_90a GEMM kernels (SASS
// `HGMMA.64x64x16.F32.BF16`, where `mma.sync` / WMMA compile to `HMMA`).
//
// One warpgroup (128 threads, the whole block) computes a 64 x 64 f32 tile D += A · Bᵀ from a
// staged slice of 32 k: A is 64 rows x 32 k (the activations), B 64 rows x 32 k (the weight's
// rows), both K-major (a row's k values are contiguous, as the weight is stored).
//
// Shared-memory layout (PTX ISA "matrix descriptor", K-major, no swizzle): the operand is made
// of core matrices of 8 rows x 16 bytes (8 bf16), each 128 contiguous bytes, row i of a core
// matrix at byte 16 i. Core matrix (row group g, k chunk q) of a slice sits at
// `g * SBO + q * LBO` with LBO = 128 (the next core matrix along k, the "leading dimension
// byte offset") and SBO = 4 * 128 (the next 8 rows, the "stride dimension byte offset"). So
// element (r, kk) is at byte `(r / 8) * SBO + (kk / 8) * LBO + (r % 8) * 16 + (kk % 8) * 2`
// (`operand_offset`). A k16 MMA reads 2 chunks; the second k16 of a slice starts 2 LBO later.
//
// Descriptor (64 bits): start address >> 4 at [0, 14), LBO >> 4 at [16, 30), SBO >> 4 at
// [32, 46), base offset 0 at [49, 52), swizzle 0 (none) at [62, 64).
//
// Accumulator fragment of `m64nNk16` with f32 D (PTX ISA "register fragment for D"): register
// i of lane l of warp w holds row `16 w + l / 4 + 8 ((i / 2) % 2)`, column
// `2 (l % 4) + i % 2 + 8 (i / 4)`; 32 registers for N = 64 (`acc_row`, `acc_col`).
//
// Ordering: stores by threads to shared memory are made visible to the tensor core (the async
// proxy) by `fence.proxy.async.shared::cta` and a barrier; `wgmma.fence` orders the
// accumulator registers before the MMAs; the MMAs run asynchronously after
// `commit_group` until `wait_group 0`, so a slice staged meanwhile must go to another buffer.
// `kernels::emulate` reads this file's layout, descriptors and fragment map from a model of
// the instruction as the PTX ISA documents it.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace wgmma {

constexpr int TILE = 64;    // rows of A, rows of B, and the tile's edges
constexpr int SLICE = 32;   // k per staged slice
constexpr int CHUNK = 8;    // bf16 values in a 16-byte core-matrix row
constexpr int LBO = 128;    // bytes to the next core matrix along k
constexpr int SBO = (SLICE / CHUNK) * LBO;  // bytes to the next 8 rows
constexpr int OPERAND_BYTES = TILE * SLICE * 2;
constexpr int ACC = TILE / 2;  // f32 accumulator registers per thread (N = 64)
constexpr int THREADS = 128;   // one warpgroup: the whole block

// Byte offset of element (r, kk) of a staged 64 x 32 operand.
__host__ __device__ constexpr int operand_offset(int r, int kk) {
    return (r / 8) * SBO + (kk / CHUNK) * LBO + (r % 8) * 16 + (kk % CHUNK) * 2;
}

// The descriptor of an operand whose first core matrix is at shared address `addr`.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
           (static_cast<uint64_t>(LBO >> 4) << 16) | (static_cast<uint64_t>(SBO >> 4) << 32);
}

// Row and column of accumulator register `i` of lane `lane` of warp `warp`.
__device__ __forceinline__ int acc_row(int warp, int lane, int i) {
    return 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
}
__device__ __forceinline__ int acc_col(int lane, int i) { return 2 * (lane % 4) + i % 2 + 8 * (i / 4); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
__device__ __forceinline__ void pin(float (&d)[ACC]) {
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}

// Makes this thread's stores to shared memory visible to the tensor core.
__device__ __forceinline__ void shared_to_tensor_core() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// D += A · Bᵀ over 16 k: `a`, `b` the descriptors of the k chunk pair to read.
__device__ __forceinline__ void mma_k16(float (&d)[ACC], uint64_t a, uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31])
        : "l"(a), "l"(b)
        : "memory");
}

// Issues the MMAs of one staged slice (A at shared address `a`, B at `b`) and commits them;
// they complete by the next `wait_all`.
__device__ __forceinline__ void mma_slice(float (&d)[ACC], uint32_t a, uint32_t b) {
    pin(d);
    fence();
#pragma unroll
    for (int kk = 0; kk < SLICE; kk += 16) {
        const uint32_t at = operand_offset(0, kk);
        mma_k16(d, descriptor(a + at), descriptor(b + at));
    }
    commit();
    pin(d);
}

// Stores 8 bf16 values as chunk `q` (k from 8 q) of row `r` of the staged operand at `operand`.
__device__ __forceinline__ void put_chunk(uint8_t* operand, int r, int q, const __nv_bfloat16* v) {
    *reinterpret_cast<uint4*>(operand + operand_offset(r, q * CHUNK)) =
        *reinterpret_cast<const uint4*>(v);
}

// Stages A's slice from k0 (64 rows x 32 k, rounded to bf16) into `operand`, two chunks of 8
// per thread: row r is `a + row(r) * k`, a zero row where row(r) < 0; zeros at and past k_end.
template <class Row>
__device__ __forceinline__ void stage_rows(uint8_t* operand, const float* __restrict__ a,
                                           long long k, long long k0, long long k_end,
                                           Row&& row) {
    for (int e = threadIdx.x; e < TILE * (SLICE / CHUNK); e += THREADS) {
        const int r = e / (SLICE / CHUNK);
        const int q = e % (SLICE / CHUNK);
        const long long gr = row(r);
        __align__(16) __nv_bfloat16 v[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            const long long gk = k0 + q * CHUNK + i;
            v[i] = __float2bfloat16_rn(gr >= 0 && gk < k_end ? a[gr * k + gk] : 0.0f);
        }
        put_chunk(operand, r, q, v);
    }
}

// The block's 64 x 64 tile over k in [k_begin, k_end): `stage(k0, a, b)` writes the slice from
// k0 on into the operands at `a` and `b` (every thread its share, zeros past the edges);
// `store(row, col, value)` is called for every element of the tile, each by its register's
// thread. Two buffers: the next slice is staged while the MMAs of this one run.
template <class Stage, class Store>
__device__ __forceinline__ void tile(long long k_begin, long long k_end, Stage&& stage,
                                     Store&& store) {
    // [buffer][A, B]: each a staged 64 x 32 operand.
    __shared__ __align__(128) uint8_t operands[2][2][OPERAND_BYTES];
    float d[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
        d[i] = 0.0f;
    }
    int buf = 0;
    stage(k_begin, operands[0][0], operands[0][1]);
    shared_to_tensor_core();
    __syncthreads();
    for (long long k0 = k_begin; k0 < k_end; k0 += SLICE) {
        const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(operands[buf][0]));
        mma_slice(d, at, at + OPERAND_BYTES);
        // The other buffer was last read by the MMAs waited for before the last barrier.
        if (k0 + SLICE < k_end) {
            stage(k0 + SLICE, operands[buf ^ 1][0], operands[buf ^ 1][1]);
            shared_to_tensor_core();
        }
        wait_all();
        pin(d);
        __syncthreads();
        buf ^= 1;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
        store(acc_row(warp, lane, i), acc_col(lane, i), d[i]);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma
