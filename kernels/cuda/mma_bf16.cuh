// Warp-level bf16 `mma.sync.m16n8k16` (f32 accumulate) and its register helpers, shared by the
// kernels that put a request's heads on the M side of the MMA (`attn_decode_fp8.cu`,
// `indexer.cu`). Fragments (PTX ISA): A (16 x 16, row-major) register i of lane 4 g + t holds
// row g + 8 (i % 2), columns 2 t + 8 (i / 2) and the next; B (16 x 8) register i holds rows
// 2 t + 8 i and the next of column g; D (16 x 8 f32) d0, d1 row g, columns 2 t, 2 t + 1, d2, d3
// row g + 8. `kernels::emulate` models them the same way.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

// A pair of bf16 at `p` (4-byte aligned) as one MMA register, the lower index in the low half.
__device__ __forceinline__ uint32_t ld_pair(const __nv_bfloat16* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ uint32_t pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// d += a * b; a: 16x16 row-major fragment, b: 16x8 column fragment, d: 16x8 f32.
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
