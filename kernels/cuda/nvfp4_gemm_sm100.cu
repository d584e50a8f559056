// NVFP4 x NVFP4 GEMM on sm_100 (B200) 5th-generation tensor cores (tcgen05, Tensor Memory):
//
//   C[i][j] = a_scale_2 * w_scale_2 * sum_k e2m1(A[i][k]) * e4m3(SA[i][k/16])
//                                          * e2m1(W[j][k]) * e4m3(SW[j][k/16])
//
// Same operands, semantics and parameter list as `nvfp4_gemm_w4a4_sm120`: A is the
// NVFP4-quantized activation [m, k], W the NVFP4 weight [n, k], both ModelOpt layout (codes
// row-major, two per byte, the even element in the low nibble; e4m3 scales per 16 values,
// row-major [rows, k/16]); C is [m, n] f32 row-major. k is a multiple of 64 (k = 0 gives
// C = 0); m and n are any size. The CPU reference is `kernels::cpu::nvfp4_gemm_w4a4`.
//
// STATUS: this kernel has only been COMPILED (sm_100a SASS inspected for UTCMMA / UTCCP /
// LDTM), never run. Until `kernels/tests/nvfp4_gemm_sm100.rs` passes on an sm_100 device,
// every layout fact below is an unverified reading of the public sources named here. CI checks
// that the kernel's index math is consistent with these facts: `kernels::emulate::
// nvfp4_gemm_w4a4_sm100` runs its stores, descriptors, columns and epilogue against a model of
// the tensor core that reads them as documented here (emulate/tcgen05_sm100.rs).
//
// Tiling: one CTA of 128 threads (4 warps) computes a 128 x 128 tile of C (M = 128 rows of A,
// N_TILE = 128 rows of W) with `cta_group::1` MMAs of shape M128 N128 K64. K advances in stages
// of up to 256 (4 MMAs); per stage the threads copy the A and W code tiles and their scales
// from global to shared memory with plain 16- and 4-byte loads, zero-filling rows past m / n
// (and skipping MMA steps past k), then thread 0 issues the scale copies, the MMAs and a
// commit, and every thread waits on the commit's mbarrier before shared memory is reused.
// No pipelining (load and MMA do not overlap): correctness first. Grid (ceil(n/128),
// ceil(m/128)). Static shared memory 36876 bytes (ptxas), 203 registers, no spills.
//
// Shared memory, operands (per stage: 4 blocks of 4096 bytes for A, the same for W; block s
// holds K columns [k0 + 64 s, k0 + 64 s + 64) = 32 bytes of every one of the 128 rows).
// Canonical K-major, no-swizzle layout of 8 x 16-byte "core matrices": byte b of row r is at
//   (r / 8) * 256 + (b / 16) * 128 + (r % 8) * 16 + b % 16
// i.e. the two core matrices of an 8-row group (K bytes 0-15 and 16-31) are adjacent
// (LBO = 128 bytes, the step between core matrices along K) and 8-row groups follow each other
// (SBO = 256 bytes, the step along M/N). Packed e2m1 is consumed as stored (element k at byte
// k/2, even element in the low nibble) - kind::mxf4nvf4 reads packed 4-bit data from shared
// memory (CUTLASS: float_e2m1_t, not the "unpacksmem" types of kind::mxf8f6f4).
//
// Shared-memory descriptor (64 bits, PTX ISA "Shared Memory Descriptor", tcgen05 section):
//   [0,14) start address >> 4, [16,30) LBO >> 4, [32,46) SBO >> 4, [46,48) = 1 (fixed 0b001 /
//   "version" of sm_100), [49,52) base offset = 0, [52] LBO mode = 0 (relative), [61,64) layout
//   = 0 (no swizzle). K-major no-swizzle meaning of LBO / SBO: PTX ISA "Major-ness supported by
//   Strides" (LBO: "the stride from the first column to the second column of the 8x2 tile in the
//   128-bit element type normalized matrix") and CUTLASS cute/arch/mma_sm100_desc.hpp
//   (canonical K-major INTERLEAVE layout ((8,m),2):((1,SBO),LBO) in 16-byte units).
//
// Instruction descriptor (32 bits, kind::mxf4nvf4; CUTLASS UMMA::InstrDescriptorBlockScaled):
//   [0,3) sparsity = 0, [4,6) B scale-factor id = 0, [7,10) A type = 1 (E2M1 for mxf4nvf4),
//   [10,13) B type = 1, [13],[14] negate = 0, [15],[16] A/B major = 0 (K), [17,23) N >> 3 = 16,
//   [23] scale type = 0 (UE4M3), [24,29) M >> 4 = 8, [29,31) A scale-factor id = 0,
//   [31] K = 0 (K64 dense)  ->  0x08200480.
//
// Scale factors. Each MMA consumes 4 scales per row of A and per row of W (K64 / 16). They go
// through shared memory in CUTLASS's Sm1xxBlockScaledBasicChunk layout (one 512-byte chunk per
// MMA and operand: the 4 scale bytes of row r, K blocks in byte order, are the 32-bit word at
//   (r % 32) * 16 + (r / 32) * 4
// i.e. 32 "rows" of 16 bytes, row i holding rows i, 32+i, 64+i, 96+i) and are copied to Tensor
// Memory with `tcgen05.cp.cta_group::1.32x128b.warpx4` (source: a no-swizzle K-major descriptor
// over the chunk, SBO = 128 = 8 rows x 16 bytes, LBO unused = 0; the 32 x 128-bit matrix is
// written to lanes [0,32) and broadcast to the other three 32-lane sub-partitions, 4 columns).
// Resulting TMEM layout: the scales of row r sit in column base + r / 32 (byte j = K block j)
// of lanes (r % 32) + 32 q for every q = 0..3; the MMA gets the base column address and scale
// factor id 0 (all 4 bytes of the word are used by scale_vec::4X / block16). Sources: CUTLASS
// include/cutlass/detail/sm100_blockscaled_layout.hpp (SfKMajorAtom), cute/atom/
// copy_traits_sm100.hpp (SM100_UTCCP_4x32dp128bit ValID), cute/atom/mma_traits_sm100_frag.hpp
// (tmem_sf_frg: 32-lane sub-partitions, replication 4, K blocks at byte stride within a
// column), and DeepGEMM sm100_fp8_fp4_gemm_1d1d.cuh (the same transposed 128-row chunk fed to
// the same UTCCP shape; make_sf_desc SBO 128 / LBO 0). The PTX ISA figure of the scale-factor
// TMEM layout was not available to read; this is the point most likely to be wrong.
//
// Tensor Memory: 256 columns allocated by warp 0 (`tcgen05.alloc.cta_group::1.sync.aligned.
// shared::cta.b32`, then `tcgen05.relinquish_alloc_permit`, freed with `tcgen05.dealloc` by
// warp 0 at the end). Columns [0,128): the f32 accumulator, lane = row of the tile, column =
// column of the tile (M = 128 data-path layout). [128,144): A scales of the 4 MMAs of a stage
// (4 columns each), [144,160): W scales.
//
// Instructions (PTX ISA 9.x tcgen05 section; spellings as nvcc 13 accepts them, cross-checked
// with CUTLASS cute/arch/mma_sm100_umma.hpp SM100_MMA_MXF4_SS, cute/arch/copy_sm100.hpp and
// cutlass/arch/barrier.h):
//   tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16 [d], a_desc, b_desc, idesc,
//       [sfa], [sfb], enable_input_d        (older spelling: .scale_vec::4X)
//   tcgen05.cp.cta_group::1.32x128b.warpx4 [taddr], s_desc
//   tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [mbar]
//   tcgen05.ld.sync.aligned.32x32b.x16.b32 + tcgen05.wait::ld.sync.aligned (warp w reads lanes
//       32 w .. 32 w + 31 = its 32 output rows, 16 columns per load)
//   tcgen05.fence::before_thread_sync / ::after_thread_sync around the thread synchronizations
//   fence.proxy.async.shared::cta after the threads' shared-memory stores: the tensor core
//       reads shared memory through the async proxy (as DeepGEMM does after its SF transpose).
// The MMAs and scale copies of a stage are issued by one thread in program order; tcgen05.cp
// followed by tcgen05.mma from the same thread is a pipelined pair that executes in issue order
// (PTX ISA "Memory Consistency Model for 5th generation of TensorCore operations", "Pipelined
// tcgen05 Instructions"), which CUTLASS's block-scaled mainloop also relies on. The PTX ISA
// text was read in its public 9.2 mirror (tcgen05 sections 9.7.16.3, 9.7.16.4.1/2, 9.7.16.6).
//
// Other architectures get a stub that traps: the wrapper launches this only on sm_100 (10.0).
// The real body is built for sm_100a (and would be for sm_103a, which build.rs does not target).
#include <stdint.h>

#define THREADS 128
#define TILE_M 128
#define TILE_N 128
#define MMA_K 64                     // K per tcgen05.mma (kind::mxf4nvf4, dense)
#define STAGE_MMAS 4                 // MMAs per stage
#define STAGE_K (MMA_K * STAGE_MMAS) // 256 K values per stage
#define OP_BLOCK_BYTES 4096          // one MMA's operand: 128 rows x 32 bytes
#define SF_BLOCK_BYTES 512           // one MMA's scales: 128 rows x 4 bytes
#define TMEM_COLS 256
#define TMEM_ACC_COL 0
#define TMEM_SFA_COL 128
#define TMEM_SFW_COL (TMEM_SFA_COL + 4 * STAGE_MMAS)

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL)
#define NVFP4_SM100_BODY 1

namespace {

// Instruction descriptor of the M128 N128 K64 NVFP4 MMA (see the header).
constexpr uint32_t kInstrDesc = (1u << 7)                      // A type E2M1
                                | (1u << 10)                   // B type E2M1
                                | ((TILE_N >> 3) << 17)        // N >> 3
                                | (0u << 23)                   // scales UE4M3
                                | ((TILE_M >> 4) << 24);       // M >> 4
static_assert(kInstrDesc == 0x08200480u, "instruction descriptor");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// No-swizzle shared-memory matrix descriptor (sm_100 format, see the header).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
           (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
           (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 46);
}

__device__ __forceinline__ void fence_before_sync() {
    asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}

__device__ __forceinline__ void fence_after_sync() {
    asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t mbar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(mbar), "r"(parity)
            : "memory");
    }
}

// Copies the code bytes of one stage of one operand (128 rows starting at `row0`; rows past
// `rows` zero-filled) into the core-matrix layout: 16-byte chunk c of a row's 128 bytes of
// this stage is core-matrix row (r % 8) of K half c % 2 of MMA block c / 2.
__device__ __forceinline__ void load_codes(uint8_t* smem, const uint8_t* __restrict__ codes,
                                           long long row0, long long rows, long long row_bytes,
                                           long long k_byte0, int mmas, int tid) {
#pragma unroll
    for (int i = 0; i < (TILE_M * 8) / THREADS; ++i) {
        const int idx = i * THREADS + tid;
        const int r = idx / 8;
        const int chunk = idx % 8;
        const int block = chunk / 2;
        if (block >= mmas) {
            continue;
        }
        const long long row = row0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (row < rows) {
            v = *reinterpret_cast<const uint4*>(codes + row * row_bytes + k_byte0 + chunk * 16);
        }
        const int offset =
            block * OP_BLOCK_BYTES + (r / 8) * 256 + (chunk % 2) * 128 + (r % 8) * 16;
        *reinterpret_cast<uint4*>(smem + offset) = v;
    }
}

// Copies the scales of one stage of one operand: the 4 bytes of row r for MMA block b (one
// 32-bit word: K blocks in byte order) go to word (r % 32) * 4 + r / 32 of chunk b.
__device__ __forceinline__ void load_scales(uint32_t* smem, const uint8_t* __restrict__ scales,
                                            long long row0, long long rows,
                                            long long row_scales, long long k_scale0, int mmas,
                                            int tid) {
#pragma unroll
    for (int i = 0; i < (TILE_M * STAGE_MMAS) / THREADS; ++i) {
        const int idx = i * THREADS + tid;
        const int r = idx / STAGE_MMAS;
        const int block = idx % STAGE_MMAS;
        if (block >= mmas) {
            continue;
        }
        const long long row = row0 + r;
        uint32_t v = 0u;
        if (row < rows) {
            v = *reinterpret_cast<const uint32_t*>(scales + row * row_scales + k_scale0 +
                                                   block * 4);
        }
        smem[block * (SF_BLOCK_BYTES / 4) + (r % 32) * 4 + r / 32] = v;
    }
}

}  // namespace
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    nvfp4_gemm_w4a4_sm100(const uint8_t* __restrict__ a_codes,
                          const uint8_t* __restrict__ a_scales, float a_scale_2,
                          const uint8_t* __restrict__ w_codes,
                          const uint8_t* __restrict__ w_scales, float w_scale_2, long long m,
                          long long n, long long k, float* __restrict__ c) {
#if defined(NVFP4_SM100_BODY)
    __shared__ __align__(1024) uint8_t s_a[STAGE_MMAS * OP_BLOCK_BYTES];
    __shared__ __align__(1024) uint8_t s_w[STAGE_MMAS * OP_BLOCK_BYTES];
    __shared__ __align__(128) uint32_t s_sfa[STAGE_MMAS * SF_BLOCK_BYTES / 4];
    __shared__ __align__(128) uint32_t s_sfw[STAGE_MMAS * SF_BLOCK_BYTES / 4];
    __shared__ __align__(8) uint64_t s_mbar;
    __shared__ uint32_t s_tmem;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const long long row_base = static_cast<long long>(blockIdx.y) * TILE_M;
    const long long col_base = static_cast<long long>(blockIdx.x) * TILE_N;
    const float scale = a_scale_2 * w_scale_2;

    if (k <= 0) {
        // No K step: the sum is empty (the accumulator would never be written).
        const long long row = row_base + tid;
        if (row < m) {
            for (int j = 0; j < TILE_N && col_base + j < n; ++j) {
                c[row * n + col_base + j] = 0.0f;
            }
        }
        return;
    }

    const uint32_t mbar = smem_addr(&s_mbar);
    if (warp == 0) {
        asm volatile(
            "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(
                smem_addr(&s_tmem)),
            "n"(TMEM_COLS)
            : "memory");
        asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;" ::: "memory");
    }
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mbar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    fence_before_sync();
    __syncthreads();
    fence_after_sync();
    const uint32_t tmem = s_tmem;

    const long long row_bytes = k / 2;    // code bytes per row
    const long long row_scales = k / 16;  // scale bytes per row
    uint32_t phase = 0;
    for (long long k0 = 0; k0 < k; k0 += STAGE_K) {
        const long long left = (k - k0) / MMA_K;
        const int mmas = left < STAGE_MMAS ? static_cast<int>(left) : STAGE_MMAS;
        load_codes(s_a, a_codes, row_base, m, row_bytes, k0 / 2, mmas, tid);
        load_codes(s_w, w_codes, col_base, n, row_bytes, k0 / 2, mmas, tid);
        load_scales(s_sfa, a_scales, row_base, m, row_scales, k0 / 16, mmas, tid);
        load_scales(s_sfw, w_scales, col_base, n, row_scales, k0 / 16, mmas, tid);
        // The tensor core reads shared memory through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (tid == 0) {
            fence_after_sync();
            for (int s = 0; s < mmas; ++s) {
                const uint64_t sfa_desc = smem_desc(smem_addr(s_sfa) + s * SF_BLOCK_BYTES, 0, 128);
                const uint64_t sfw_desc = smem_desc(smem_addr(s_sfw) + s * SF_BLOCK_BYTES, 0, 128);
                asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;" ::"r"(
                                 tmem + TMEM_SFA_COL + 4 * s),
                             "l"(sfa_desc)
                             : "memory");
                asm volatile("tcgen05.cp.cta_group::1.32x128b.warpx4 [%0], %1;" ::"r"(
                                 tmem + TMEM_SFW_COL + 4 * s),
                             "l"(sfw_desc)
                             : "memory");
            }
            for (int s = 0; s < mmas; ++s) {
                const uint64_t a_desc = smem_desc(smem_addr(s_a) + s * OP_BLOCK_BYTES, 128, 256);
                const uint64_t w_desc = smem_desc(smem_addr(s_w) + s * OP_BLOCK_BYTES, 128, 256);
                const uint32_t accumulate = (k0 > 0 || s > 0) ? 1u : 0u;
                asm volatile(
                    "{\n\t.reg .pred p;\n\t"
                    "setp.ne.b32 p, %4, 0;\n\t"
                    "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16 "
                    "[%0], %1, %2, %3, [%5], [%6], p;\n\t}" ::"r"(tmem + TMEM_ACC_COL),
                    "l"(a_desc), "l"(w_desc), "r"(kInstrDesc), "r"(accumulate),
                    "r"(tmem + TMEM_SFA_COL + 4 * s), "r"(tmem + TMEM_SFW_COL + 4 * s)
                    : "memory");
            }
            // Arrives on the mbarrier once every tcgen05 operation issued above has completed.
            asm volatile(
                "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" ::
                    "r"(mbar)
                : "memory");
        }
        // Shared memory (and the scale columns) may be reused only after the MMAs are done.
        mbar_wait(mbar, phase);
        phase ^= 1u;
    }
    fence_after_sync();

    // Epilogue: warp w owns TMEM lanes [32 w, 32 w + 32) = rows row_base + 32 w + lane.
    const long long row = row_base + warp * 32 + lane;
    const uint32_t lane_addr = tmem + (static_cast<uint32_t>(warp * 32) << 16);
#pragma unroll 1
    for (int c0 = 0; c0 < TILE_N && col_base + c0 < n; c0 += 16) {
        uint32_t v[16];
        // Load and wait in one statement so no use of v can be scheduled before the wait.
        asm volatile(
            "tcgen05.ld.sync.aligned.32x32b.x16.b32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, [%16];\n\t"
            "tcgen05.wait::ld.sync.aligned;"
            : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(v[4]), "=r"(v[5]),
              "=r"(v[6]), "=r"(v[7]), "=r"(v[8]), "=r"(v[9]), "=r"(v[10]), "=r"(v[11]),
              "=r"(v[12]), "=r"(v[13]), "=r"(v[14]), "=r"(v[15])
            : "r"(lane_addr + TMEM_ACC_COL + c0)
            : "memory");
        if (row < m) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const long long col = col_base + c0 + j;
                if (col < n) {
                    c[row * n + col] = __uint_as_float(v[j]) * scale;
                }
            }
        }
    }

    fence_before_sync();
    __syncthreads();
    if (warp == 0) {
        fence_after_sync();
        asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" ::"r"(tmem),
                     "n"(TMEM_COLS)
                     : "memory");
    }
#else
    __trap();
#endif
}
