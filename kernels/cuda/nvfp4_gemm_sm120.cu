// NVFP4 x NVFP4 GEMM on sm_120 FP4 tensor cores (block-scaled warp MMA, W4A4):
//
//   C[i][j] = a_scale_2 * w_scale_2 * sum_k e2m1(A[i][k]) * e4m3(SA[i][k/16])
//                                          * e2m1(W[j][k]) * e4m3(SW[j][k/16])
//
// A is the NVFP4-quantized activation [m, k] (as `nvfp4_quantize_rows` writes it), W the
// NVFP4 weight [n, k]; both ModelOpt layout (codes row-major, even element in the low nibble;
// e4m3 scales per 16). Every product is exact in f32; the tensor cores accumulate in f32.
// The CPU reference is `kernels::cpu::nvfp4_gemm_w4a4` (f64 over the dequantized operands).
//
// The instruction is `mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64`
// (CUTLASS SM120_16x8x64_TN_VS). Fragments, with lane = 4 * t1 + t0:
//   a0 = row t1,   K bytes [4 t0, 4 t0 + 4)      a1 = row t1 + 8, same K
//   a2 = row t1,   K bytes [16 + 4 t0, +4)       a3 = row t1 + 8, same K
//   b0 = column t1, K bytes [4 t0, +4)           b1 = column t1, K bytes [16 + 4 t0, +4)
//   sfa = the 4 scale bytes (K blocks of 16) of row t1 + 8 (t0 & 1); sfb = those of column t1
//   d0, d1 = row t1, columns 2 t0, 2 t0 + 1;     d2, d3 = row t1 + 8, same columns
// (8 codes per 32-bit register, the lowest nibble first). This mapping comes from third-party
// code and the GPU test (random operands against the reference) is what establishes it; it
// runs only on sm_120 devices.
//
// Tiling: 4 warps per block; each warp computes 16 rows x 64 columns (8 MMA tiles along n),
// the block 64 x 64. Operands are read straight from global memory (L1/L2 serve the reuse);
// a shared-memory pipeline is the next step. k must be a multiple of 64; any m and n.
// Other architectures get a stub that traps: the wrapper launches this only on sm_120.
#include <stdint.h>

#define THREADS 128
#define WARP_N_TILES 8  // 8 x n8 = 64 columns per warp

extern "C" __global__ void __launch_bounds__(THREADS)
    nvfp4_gemm_w4a4_sm120(const uint8_t* __restrict__ a_codes,
                          const uint8_t* __restrict__ a_scales, float a_scale_2,
                          const uint8_t* __restrict__ w_codes,
                          const uint8_t* __restrict__ w_scales, float w_scale_2, long long m,
                          long long n, long long k, float* __restrict__ c) {
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int t1 = lane / 4;
    const int t0 = lane % 4;
    const long long row_base = static_cast<long long>(blockIdx.y) * 64 + warp * 16;
    const long long col_base = static_cast<long long>(blockIdx.x) * 64;
    const long long row_bytes = k / 2;    // codes per row
    const long long row_scales = k / 16;  // scale bytes per row

    const long long r_lo = row_base + t1;
    const long long r_hi = r_lo + 8;
    const long long r_scale = row_base + t1 + 8 * (t0 & 1);

    float acc[WARP_N_TILES][4];
#pragma unroll
    for (int j = 0; j < WARP_N_TILES; ++j) {
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    }
    auto load_u32 = [](const uint8_t* base, long long row, long long rows, long long offset,
                       long long stride) -> uint32_t {
        return row < rows ? *reinterpret_cast<const uint32_t*>(base + row * stride + offset) : 0u;
    };
    for (long long k0 = 0; k0 < k; k0 += 64) {
        const long long kb = k0 / 2;  // byte offset of this K step in a code row
        const uint32_t a0 = load_u32(a_codes, r_lo, m, kb + 4 * t0, row_bytes);
        const uint32_t a1 = load_u32(a_codes, r_hi, m, kb + 4 * t0, row_bytes);
        const uint32_t a2 = load_u32(a_codes, r_lo, m, kb + 16 + 4 * t0, row_bytes);
        const uint32_t a3 = load_u32(a_codes, r_hi, m, kb + 16 + 4 * t0, row_bytes);
        const uint32_t sfa = load_u32(a_scales, r_scale, m, k0 / 16, row_scales);
#pragma unroll
        for (int j = 0; j < WARP_N_TILES; ++j) {
            const long long col = col_base + j * 8 + t1;
            const uint32_t b0 = load_u32(w_codes, col, n, kb + 4 * t0, row_bytes);
            const uint32_t b1 = load_u32(w_codes, col, n, kb + 16 + 4 * t0, row_bytes);
            const uint32_t sfb = load_u32(w_scales, col, n, k0 / 16, row_scales);
            const uint16_t zero = 0;
            asm volatile(
                "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col."
                "f32.e2m1.e2m1.f32.ue4m3 "
                "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, "
                "{%10}, {%11, %12}, {%13}, {%14, %15};\n"
                : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(sfa), "h"(zero),
                  "h"(zero), "r"(sfb), "h"(zero), "h"(zero));
        }
    }
    const float scale = a_scale_2 * w_scale_2;
#pragma unroll
    for (int j = 0; j < WARP_N_TILES; ++j) {
        const long long col = col_base + j * 8 + 2 * t0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long row = half == 0 ? r_lo : r_hi;
            if (row >= m) {
                continue;
            }
            if (col < n) {
                c[row * n + col] = acc[j][2 * half] * scale;
            }
            if (col + 1 < n) {
                c[row * n + col + 1] = acc[j][2 * half + 1] * scale;
            }
        }
    }
#else
    __trap();
#endif
}
