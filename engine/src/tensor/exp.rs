//! `exp` on f32, one definition for every machine and every vector width.
//!
//! The algorithm is the one glibc's `expf` uses (the ARM optimized-routines design): in double
//! precision, `x·32/ln2 = k + r`, `2^(k/32)` from a 32-entry table with `k / 32` added to its
//! exponent, and a cubic in `r`; the double result rounded to f32 once. The four products and
//! sums that glibc's FMA build fuses are fused here too, so on an x86-64 glibc with FMA this
//! function returns exactly what `f32::exp` returns, for every one of the 2^32 inputs
//! (`exhaustive_match_with_the_platform_exp`, run by hand: it takes minutes). Owning the
//! definition does two things: a 512-bit build computes eight values at a time with the same
//! operations (so the same bits), and a prompt's state computed on one machine continues on
//! another with a different libm and the same results.
//!
//! Inputs with `|x| >= 88`, infinities and NaN take glibc's special cases: overflow to `inf`
//! above `0x1.62e42ep6`, `0` below `-0x1.9fe368p6`, the smallest subnormal (glibc's
//! "may underflow" value) below `-0x1.9d1d9ep6`, `x + x` for NaN and `+inf`, `0` for `-inf`.

/// `32 / ln 2`.
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// `1.5 · 2^52`: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// The cubic's coefficients, highest degree first (already scaled for `r` in units of 1/32).
const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);
/// `bits(2^(i/32)) - (i << 47)`: adding `k << 47` puts `k / 32` into the exponent.
const TABLE: [u64; 32] = [
    0x3ff0_0000_0000_0000,
    0x3fef_d9b0_d315_8574,
    0x3fef_b558_6cf9_890f,
    0x3fef_9301_d012_5b51,
    0x3fef_72b8_3c7d_517b,
    0x3fef_5487_3168_b9aa,
    0x3fef_387a_6e75_6238,
    0x3fef_1e9d_f51f_dee1,
    0x3fef_06fe_0a31_b715,
    0x3fee_f1a7_373a_a9cb,
    0x3fee_dea6_4c12_3422,
    0x3fee_ce08_6061_892d,
    0x3fee_bfda_d536_2a27,
    0x3fee_b42b_569d_4f82,
    0x3fee_ab07_dd48_5429,
    0x3fee_a47e_b03a_5585,
    0x3fee_a09e_667f_3bcd,
    0x3fee_9f75_e8ec_5f74,
    0x3fee_a114_73eb_0187,
    0x3fee_a589_994c_ce13,
    0x3fee_ace5_422a_a0db,
    0x3fee_b737_b0cd_c5e5,
    0x3fee_c491_82a3_f090,
    0x3fee_d503_b23e_255d,
    0x3fee_e89f_995a_d3ad,
    0x3fee_ff76_f2fb_5e47,
    0x3fef_199b_dd85_529c,
    0x3fef_3720_dcef_9069,
    0x3fef_5818_dcfb_a487,
    0x3fef_7c97_337b_9b5f,
    0x3fef_a4af_a2a4_90da,
    0x3fef_d076_5b6e_4540,
];
/// The top 12 bits (sign cleared) of `88.0f32`: from here on the special cases are checked.
const SPECIAL_TOP: u32 = 0x42b;

/// `e^x`, as defined above.
pub fn exp(x: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports FMA (checked just above).
            return unsafe { exp_fma(x) };
        }
    }
    exp_any(x)
}

/// [`exp_any`] compiled with FMA, so each `mul_add` is one instruction instead of a call.
///
/// # Safety
/// The CPU supports FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn exp_fma(x: f32) -> f32 {
    exp_any(x)
}

/// The definition; `mul_add` is a fused multiply-add on every target.
#[allow(
    clippy::inline_always,
    reason = "must inline into exp_fma to use its features"
)]
#[inline(always)]
fn exp_any(x: f32) -> f32 {
    if (x.to_bits() >> 20) & 0x7ff >= SPECIAL_TOP
        && let Some(special) = special(x)
    {
        return special;
    }
    let xd = f64::from(x);
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let p = C0.mul_add(r, C1);
    let q = r.mul_add(C2, 1.0);
    let y = p.mul_add(r * r, q);
    (y * s) as f32
}

/// glibc's result for `|x| >= 88`, NaN and infinities; `None` where the common path holds.
fn special(x: f32) -> Option<f32> {
    if x == f32::NEG_INFINITY {
        Some(0.0)
    } else if (x.to_bits() >> 20) & 0x7ff > 0x7f7 {
        Some(x + x)
    } else if x > f32::from_bits(0x42b1_7217) {
        Some(f32::INFINITY)
    } else if x < f32::from_bits(0xc2cf_f1b4) {
        Some(0.0)
    } else if x < f32::from_bits(0xc2ce_8ecf) {
        Some(f32::from_bits(1))
    } else {
        None
    }
}

/// `x = exp(x)` for every element; eight at a time on AVX-512, with the same bits.
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx2")
        {
            // SAFETY: the CPU has AVX-512F and AVX2 (checked just above).
            unsafe { exp_in_place_avx512(xs) };
            return;
        }
    }
    for x in xs {
        *x = exp(*x);
    }
}

/// [`exp_in_place`] on eight lanes of doubles; a group of eight with any special input is done
/// one at a time.
///
/// # Safety
/// The CPU supports AVX-512F and AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn exp_in_place_avx512(xs: &mut [f32]) {
    use std::arch::x86_64::{
        _mm256_and_si256, _mm256_castps_si256, _mm256_cmpgt_epi32, _mm256_loadu_ps,
        _mm256_movemask_epi8, _mm256_set1_epi32, _mm256_srli_epi32, _mm256_storeu_ps,
        _mm512_add_epi64, _mm512_and_si512, _mm512_castpd_si512, _mm512_castsi512_pd,
        _mm512_cvtpd_ps, _mm512_cvtps_pd, _mm512_fmadd_pd, _mm512_fmsub_pd, _mm512_loadu_epi64,
        _mm512_mask_blend_epi64, _mm512_mul_pd, _mm512_permutex2var_epi64, _mm512_set1_epi64,
        _mm512_set1_pd, _mm512_slli_epi64, _mm512_sub_pd, _mm512_test_epi64_mask,
    };
    // SAFETY: TABLE has 32 u64, read as four unaligned loads of eight.
    let table = unsafe {
        let t = TABLE.as_ptr().cast::<i64>();
        [
            _mm512_loadu_epi64(t),
            _mm512_loadu_epi64(t.add(8)),
            _mm512_loadu_epi64(t.add(16)),
            _mm512_loadu_epi64(t.add(24)),
        ]
    };
    let (inv, shift) = (_mm512_set1_pd(INV_LN2_N), _mm512_set1_pd(SHIFT));
    let (c0, c1, c2, one) = (
        _mm512_set1_pd(C0),
        _mm512_set1_pd(C1),
        _mm512_set1_pd(C2),
        _mm512_set1_pd(1.0),
    );
    let mut chunks = xs.chunks_exact_mut(8);
    for chunk in &mut chunks {
        // SAFETY: the chunk has 8 elements; unaligned load.
        let x = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        let top = _mm256_and_si256(
            _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
            _mm256_set1_epi32(0x7ff),
        );
        let special = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(SPECIAL_TOP as i32 - 1));
        if _mm256_movemask_epi8(special) != 0 {
            for v in chunk.iter_mut() {
                *v = exp(*v);
            }
            continue;
        }
        let xd = _mm512_cvtps_pd(x);
        let kd = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        let index = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        let low = _mm512_permutex2var_epi64(table[0], index, table[1]);
        let high = _mm512_permutex2var_epi64(table[2], index, table[3]);
        let upper = _mm512_test_epi64_mask(index, _mm512_set1_epi64(16));
        let t = _mm512_add_epi64(
            _mm512_mask_blend_epi64(upper, low, high),
            _mm512_slli_epi64::<47>(ki),
        );
        let p = _mm512_fmadd_pd(c0, r, c1);
        let q = _mm512_fmadd_pd(r, c2, one);
        let y = _mm512_fmadd_pd(p, _mm512_mul_pd(r, r), q);
        let y = _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(t)));
        // SAFETY: as for the load.
        unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), y) };
    }
    for v in chunks.into_remainder() {
        *v = exp(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::same_value as same;

    /// Every input class, both paths: the vector build equals the scalar definition bit for
    /// bit, and both stay within one ulp of the platform's `exp` (on x86-64 glibc with FMA they
    /// are equal; that is the exhaustive test below).
    #[test]
    fn vector_and_scalar_agree_and_track_the_platform() {
        let mut inputs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            88.0,
            88.72283,
            88.722_84,
            89.0,
            -87.9,
            -88.0,
            -103.0,
            -103.5,
            -104.0,
            -150.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::MAX,
            f32::MIN,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            inputs.push(f32::from_bits(state as u32));
            inputs.push((state >> 40) as f32 / (1u64 << 24) as f32 * 200.0 - 110.0);
        }
        let mut vector = inputs.clone();
        exp_in_place(&mut vector);
        for (x, v) in inputs.iter().zip(&vector) {
            let scalar = exp(*x);
            assert!(
                same(*v, scalar),
                "exp({x:e}): vector {v:e}, scalar {scalar:e}"
            );
            let platform = x.exp();
            let ulps = (i64::from(scalar.to_bits()) - i64::from(platform.to_bits())).abs();
            assert!(
                same(scalar, platform) || ulps <= 1,
                "exp({x:e}) = {scalar:e}, platform {platform:e}"
            );
        }
    }

    /// All 2^32 inputs against the platform's `exp`: equal on x86-64 glibc with FMA. Minutes
    /// in release; run with `cargo test --release -p engine exhaustive -- --ignored`.
    #[test]
    #[ignore = "minutes; run by hand when the definition changes"]
    fn exhaustive_match_with_the_platform_exp() {
        use rayon::prelude::*;
        let mismatches: u64 = (0u32..=u16::MAX.into())
            .into_par_iter()
            .map(|high| {
                let mut xs: Vec<f32> = (0..=u16::MAX)
                    .map(|low| f32::from_bits(high << 16 | u32::from(low)))
                    .collect();
                let inputs = xs.clone();
                exp_in_place(&mut xs);
                inputs
                    .iter()
                    .zip(&xs)
                    .filter(|(x, v)| !same(**v, x.exp()) || !same(**v, exp(**x)))
                    .count() as u64
            })
            .sum();
        assert_eq!(mismatches, 0);
    }
}
