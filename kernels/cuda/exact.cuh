// Device ports of the engine's own numeric definitions, bit for bit, so that element-wise ops
// (sigmoid, softmax, the hyper-connections' mixing) give the CPU reference's bits on the GPU:
// `exact::exp` is `engine::tensor::exp` (glibc's expf algorithm in double with the same fused
// multiply-adds, constants, table and special cases). Every product and sum outside it is
// written with the `_rn` intrinsics, so nvcc cannot contract a multiply and an add into an FMA
// that the CPU does not do.
#pragma once
#include <math.h>
#include <stdint.h>

namespace exact {

__constant__ unsigned long long EXP_TABLE[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

__device__ __forceinline__ float exp(float x) {
    const unsigned int top = (__float_as_uint(x) >> 20) & 0x7ffu;
    if (top >= 0x42bu) {
        if (x == -INFINITY) {
            return 0.0f;
        }
        if (top > 0x7f7u) {
            return x + x;
        }
        if (x > __uint_as_float(0x42b17217u)) {
            return INFINITY;
        }
        if (x < __uint_as_float(0xc2cff1b4u)) {
            return 0.0f;
        }
        if (x < __uint_as_float(0xc2ce8ecfu)) {
            return __uint_as_float(1u);
        }
    }
    const double inv_ln2_n = __longlong_as_double(0x40471547652b82feLL);
    const double shift = __longlong_as_double(0x4338000000000000LL);
    const double c0 = __longlong_as_double(0x3ebc6af84b912394LL);
    const double c1 = __longlong_as_double(0x3f2ebfce50fac4f3LL);
    const double c2 = __longlong_as_double(0x3f962e42ff0c52d6LL);
    const double xd = static_cast<double>(x);
    double kd = __fma_rn(inv_ln2_n, xd, shift);
    const unsigned long long ki = static_cast<unsigned long long>(__double_as_longlong(kd));
    kd = __dsub_rn(kd, shift);
    const double r = __fma_rn(inv_ln2_n, xd, -kd);
    const double s = __longlong_as_double(static_cast<long long>(EXP_TABLE[ki % 32u] + (ki << 47)));
    const double p = __fma_rn(c0, r, c1);
    const double q = __fma_rn(r, c2, 1.0);
    const double y = __fma_rn(p, __dmul_rn(r, r), q);
    return __double2float_rn(__dmul_rn(y, s));
}

// `engine::tensor::ln_1p`: ln(1 + x) in double, u = 1 + x = 2^k m with m in [sqrt(1/2),
// sqrt(2)), the atanh series of s = (m - 1) / (m + 1) to twelve terms, k ln2 in two parts, the
// double rounded to float once; every operation as the CPU does it, in its order.
__device__ __forceinline__ float ln_1p(float x) {
    if (isnan(x)) {
        return x;
    }
    if (fabsf(x) < __uint_as_float(0x31000000u)) {
        return x;
    }
    if (x == -1.0f) {
        return -INFINITY;
    }
    if (x < -1.0f) {
        return __uint_as_float(0x7fc00000u);
    }
    if (x == INFINITY) {
        return x;
    }
    const double u = __dadd_rn(1.0, static_cast<double>(x));
    const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(u));
    long long k = static_cast<long long>((bits >> 52) & 0x7ffull) - 1023;
    const unsigned long long mantissa = bits & 0x000fffffffffffffull;
    double m;
    if (mantissa > 0x0006a09e667f3bcdull) {
        k += 1;
        m = __longlong_as_double(static_cast<long long>(mantissa | 0x3fe0000000000000ull));
    } else {
        m = __longlong_as_double(static_cast<long long>(mantissa | 0x3ff0000000000000ull));
    }
    const double f = __dsub_rn(m, 1.0);
    const double s = __ddiv_rn(f, __dadd_rn(2.0, f));
    const double z = __dmul_rn(s, s);
    double r = 0.0;
    for (int i = 12; i >= 1; --i) {
        r = __dmul_rn(__dadd_rn(r, __ddiv_rn(2.0, static_cast<double>(2 * i + 1))), z);
    }
    const double ln_m = __dadd_rn(__dmul_rn(2.0, s), __dmul_rn(s, r));
    const double kd = static_cast<double>(k);
    const double ln2_hi = __longlong_as_double(0x3fe62e42fee00000LL);
    const double ln2_lo = __longlong_as_double(0x3dea39ef35793c76LL);
    return __double2float_rn(
        __dadd_rn(__dmul_rn(kd, ln2_hi), __dadd_rn(ln_m, __dmul_rn(kd, ln2_lo))));
}

// `engine::tensor::softplus`: x above 20, else ln_1p(exp(x)).
__device__ __forceinline__ float softplus(float x) {
    return x > 20.0f ? x : exact::ln_1p(exact::exp(x));
}

// `f32::total_cmp`'s order as an unsigned key: -NaN < -inf < ... < -0 < +0 < ... < +inf < NaN.
__device__ __forceinline__ unsigned int total_key(float v) {
    const unsigned int b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// `engine::tensor::sigmoid`: 1 / (1 + exp(-x)).
__device__ __forceinline__ float sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exact::exp(-x)));
}

// The engine's `dot(a, b)` (`engine::tensor::dots_source`'s definition) over `n` values,
// computed by the eight threads of a group (`lane` 0..7, all eight calling with the same
// arguments and the mask of the group's threads): lane k's fused multiply-add chain over
// elements 8i + k, the halving k + 4, k + 2, k + 1, then the FMA tail. Valid in lane 0.
// `a` is anything indexed like a row of f32 values: a pointer, or a reader that decodes a
// stored row (the FP8 K=V rows of `attn_exact.cu`), so every caller sums in the same order.
template <typename Row>
__device__ __forceinline__ float dot_lanes(const Row& a, const float* __restrict__ b, long long n,
                                           int lane, unsigned int mask) {
    const long long chunks = n / 8;
    float acc = 0.0f;
    for (long long i = 0; i < chunks; ++i) {
        acc = __fmaf_rn(a[i * 8 + lane], b[i * 8 + lane], acc);
    }
    acc = __fadd_rn(acc, __shfl_down_sync(mask, acc, 4, 8));
    acc = __fadd_rn(acc, __shfl_down_sync(mask, acc, 2, 8));
    acc = __fadd_rn(acc, __shfl_down_sync(mask, acc, 1, 8));
    float tail = 0.0f;
    for (long long c = chunks * 8; c < n; ++c) {
        tail = __fmaf_rn(a[c], b[c], tail);
    }
    return __fadd_rn(acc, tail);
}

// `engine::formats::e8m0_to_f32`: 2^(code - 127), code 255 NaN.
__device__ __forceinline__ float e8m0_to_f32(uint8_t code) {
    if (code == 0xFFu) {
        return __int_as_float(0x7fc00000);
    }
    if (code == 0u) {
        return __int_as_float(0x00400000);
    }
    return __int_as_float(static_cast<int>(code) << 23);
}

// `engine::formats::e4m3_to_f32`, by its bits: both NaN codes give the engine's NaN.
__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
    if ((code & 0x7Fu) == 0x7Fu) {
        return __int_as_float(0x7fc00000);
    }
    const unsigned int exp = (code >> 3) & 0x0Fu;
    const unsigned int mant = code & 0x07u;
    // Subnormal: mant * 2^-9, exact.
    const float magnitude = exp == 0u ? static_cast<float>(mant) * __int_as_float(0x3B000000)
                                      : __uint_as_float(((exp + 120u) << 23) | (mant << 20));
    return (code & 0x80u) ? -magnitude : magnitude;
}

}  // namespace exact
