//! `ln(1 + x)` on f32, one definition for every machine (the routing's sqrt-softplus scores
//! depend on it, so a device that routes tokens must compute the same bits).
//!
//! In double precision: `u = 1 + x` (exact for `2^-29 <= |x| < 2^53`; for larger `x` the
//! rounding of `u` is far below an f32 ulp of the result), `u = 2^k · m` with
//! `m` in `[sqrt(1/2), sqrt(2))` from the bits, `f = m - 1` (exact), `s = f / (2 + f)` and
//! `ln m = 2s + s · R(s^2)` with `R` the first twelve terms of `2 Σ s^2i / (2i + 1)` (the
//! atanh series; `|s| <= 0.1716`, so the next term is below `2^-62`), then
//! `k · ln2_hi + (ln m + k · ln2_lo)` with `ln2_hi` short enough that `k · ln2_hi` is exact.
//! The double result is rounded to f32 once. Every step is an IEEE operation a device has too
//! (add, multiply, divide, rounded to nearest, nothing fused), so a CUDA port that spells each
//! one with `__dadd_rn` / `__dmul_rn` / `__ddiv_rn` returns the same bits.
//!
//! The result is the correctly rounded `ln(1 + x)` except where the double result lies within
//! a few double ulps of an f32 rounding boundary; `close_to_the_platform_log1p` measures how
//! often that differs from the platform's `log1pf`.
//!
//! `|x| < 2^-29` returns `x` (`x - x²/2` rounds to it; keeps `-0`); NaN returns NaN; `-1`
//! returns `-inf`, below `-1` NaN; `+inf` returns `+inf`.

/// `ln 2` split: the high part has 32 trailing zero bits, so `k · LN2_HI` is exact for
/// `|k| < 2^20`.
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// `sqrt(2)`'s mantissa bits: a mantissa above it is halved (and `k` raised).
const SQRT2_MANTISSA: u64 = 0x0006_a09e_667f_3bcd;
/// Terms of the series after `2s`.
const TERMS: u32 = 12;

/// `ln(1 + x)` (see the module's text for the algorithm and special cases).
pub fn ln_1p(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x.abs() < f32::from_bits(0x3100_0000) {
        // |x| < 2^-29.
        return x;
    }
    if x.to_bits() == (-1.0f32).to_bits() {
        return f32::NEG_INFINITY;
    }
    if x < -1.0 {
        return f32::NAN;
    }
    if x == f32::INFINITY {
        return x;
    }
    ln_positive(1.0 + f64::from(x)) as f32
}

/// `ln u` for a finite normal `u > 0`.
fn ln_positive(u: f64) -> f64 {
    let bits = u.to_bits();
    let mut k = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mantissa = bits & 0x000f_ffff_ffff_ffff;
    // m in [1, 2), or [1/2, 1) when above sqrt(2).
    let m = if mantissa > SQRT2_MANTISSA {
        k += 1;
        f64::from_bits(mantissa | 0x3fe0_0000_0000_0000)
    } else {
        f64::from_bits(mantissa | 0x3ff0_0000_0000_0000)
    };
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    // Horner from the highest term: 2/(2i+1) for i = TERMS..1.
    let mut r = 0.0f64;
    for i in (1..=TERMS).rev() {
        r = (r + 2.0 / f64::from(2 * i + 1)) * z;
    }
    let ln_m = 2.0 * s + s * r;
    let k = k as f64;
    k * LN2_HI + (ln_m + k * LN2_LO)
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "exact values are the point")]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (i64::from(a.to_bits()) - i64::from(b.to_bits())).unsigned_abs() as u32
    }

    #[test]
    fn special_cases() {
        assert!(ln_1p(f32::NAN).is_nan());
        assert!(ln_1p(-1.5).is_nan());
        assert_eq!(ln_1p(-1.0), f32::NEG_INFINITY);
        assert_eq!(ln_1p(f32::INFINITY), f32::INFINITY);
        assert_eq!(ln_1p(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(ln_1p(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(ln_1p(1e-30), 1e-30);
        assert_eq!(ln_1p(f32::MAX), f32::MAX.ln_1p());
        assert_eq!(ln_1p(1.0), std::f32::consts::LN_2);
        let e1 = std::f32::consts::E - 1.0;
        assert_eq!(ln_1p(e1), f64::from(e1).ln_1p() as f32);
    }

    /// On every 61st f32 above -1 (about 52 million values): the platform's double `log1p`
    /// rounded to f32 on all but one in a million, and within one ulp of its `log1pf`
    /// (which is off by one ulp on about 0.4% of them).
    #[test]
    fn close_to_the_platform_log1p() {
        let (mut checked, mut differ, mut not_rounded) = (0u64, 0u64, 0u64);
        let mut bits = 0u32;
        while bits < 0xff80_0000 {
            let x = f32::from_bits(bits);
            if x.is_finite() && x > -1.0 {
                let (ours, platform) = (ln_1p(x), x.ln_1p());
                assert!(ulps(ours, platform) <= 1, "{x:e}: {ours:e} vs {platform:e}");
                checked += 1;
                differ += u64::from(ours != platform);
                not_rounded += u64::from(ours != f64::from(x).ln_1p() as f32);
            }
            bits = bits.wrapping_add(61);
            if bits < 61 {
                break;
            }
        }
        assert!(checked > 50_000_000, "{checked}");
        assert!(
            not_rounded * 1_000_000 < checked,
            "{not_rounded} of {checked} are not the double log1p rounded"
        );
        assert!(
            differ * 100 < checked,
            "{differ} of {checked} differ from log1pf"
        );
    }

    /// Every f32 in the softplus range (`exp(x)` for `x <= 20`: `(0, 4.9e8]`). Minutes in a
    /// debug build: run by hand (`--ignored`).
    #[test]
    #[ignore = "exhaustive over a billion values"]
    fn exhaustive_against_the_platform_log1p_in_the_softplus_range() {
        let mut differ = 0u64;
        for bits in 1..=0x4de7_0000u32 {
            let x = f32::from_bits(bits);
            let (ours, platform) = (ln_1p(x), x.ln_1p());
            assert!(ulps(ours, platform) <= 1, "{x:e}");
            differ += u64::from(ours != platform);
        }
        eprintln!("{differ} values differ by one ulp");
    }
}
