//! Element formats found in DeepSeek-V4 checkpoints (and the NVFP4 variants NVIDIA ModelOpt
//! ships), as pure scalar conversions plus slice helpers.
//!
//! These are the CPU reference definitions: GPU kernels and checkpoint loaders are tested
//! against them, so every conversion is exact where the target can represent the value and
//! rounds to nearest, ties to even, everywhere else.

/// A failure of a slice helper; the scalar conversions themselves cannot fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Packing two 4-bit codes per byte needs an even number of codes.
    #[error("cannot pack {len} e2m1 codes: two codes go in each byte, so the count must be even")]
    OddLength { len: usize },
    /// An e2m1 code is a nibble; a larger value is a caller bug we refuse to mask silently.
    #[error("e2m1 code {code:#04x} at index {index} does not fit in 4 bits")]
    CodeOutOfRange { index: usize, code: u8 },
}

// ---------------------------------------------------------------------------------------------
// bf16 / f16
// ---------------------------------------------------------------------------------------------

/// bf16 is the top half of an f32, so widening is a shift and always exact.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Narrows to bf16 with round-to-nearest-even. NaN stays NaN and is made quiet (truncating a
/// signalling NaN's payload could otherwise leave an infinity bit pattern).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    // Adding 0x7FFF plus the lowest kept bit rounds ties towards an even kept mantissa; a carry
    // into the exponent is the correct result (including rounding the largest values to inf).
    let lsb = (bits >> 16) & 1;
    ((bits + 0x7FFF + lsb) >> 16) as u16
}

/// IEEE 754 binary16 to f32, exact for every input (subnormals, infinities, NaN payloads).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits & 0x8000) << 16;
    let exp = u32::from((bits >> 10) & 0x1F);
    let mant = u32::from(bits & 0x03FF);
    match exp {
        // Subnormal (or zero): mant * 2^-24, exact because mant has at most 10 bits.
        0 => {
            let magnitude = mant as f32 * f32::from_bits(0x3380_0000); // 2^-24
            f32::from_bits(sign | magnitude.to_bits())
        }
        0x1F => f32::from_bits(sign | 0x7F80_0000 | (mant << 13)),
        _ => f32::from_bits(sign | ((exp + 127 - 15) << 23) | (mant << 13)),
    }
}

// ---------------------------------------------------------------------------------------------
// FP8 e4m3fn
// ---------------------------------------------------------------------------------------------

/// Largest finite e4m3fn magnitude (code 0x7E).
pub const E4M3_MAX: f32 = 448.0;

/// e4m3fn to f32. The "fn" variant has no infinities: only 0x7F and 0xFF are NaN.
pub fn e4m3_to_f32(code: u8) -> f32 {
    if code & 0x7F == 0x7F {
        return f32::NAN;
    }
    let negative = code & 0x80 != 0;
    let exp = u32::from((code >> 3) & 0x0F);
    let mant = u32::from(code & 0x07);
    let magnitude = if exp == 0 {
        // Subnormal: 2^-6 * m/8 = m * 2^-9, exact.
        mant as f32 * f32::from_bits(0x3B00_0000) // 2^-9
    } else {
        // Rebias 7 -> 127 and move the 3 mantissa bits to the top of f32's 23.
        f32::from_bits(((exp + 120) << 23) | (mant << 20))
    };
    if negative { -magnitude } else { magnitude }
}

/// f32 to e4m3fn, round-to-nearest-even. Finite values beyond ±448 and ±inf saturate to ±448
/// (the "fn" format has no infinity, and the next code up is NaN); NaN maps to 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0x00 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let smallest_normal = f32::from_bits(0x3C80_0000); // 2^-6
    if a < smallest_normal {
        // Subnormal grid is multiples of 2^-9; scaling by a power of two is exact, and a
        // result of 8 is exactly the smallest normal, whose code is also 8.
        let steps = (a * 512.0).round_ties_even();
        return sign | steps as u8;
    }
    // a is a normal f32 in [2^-6, 448): unbiased exponent in [-6, 8].
    let mut exp = ((a.to_bits() >> 23) & 0xFF) as i32 - 127;
    let scaled = a * f32::from_bits(((127 - exp) as u32) << 23) * 8.0; // in [8, 16)
    let mut steps = scaled.round_ties_even() as u32;
    if steps == 16 {
        steps = 8;
        exp += 1;
    }
    let code = (((exp + 7) as u32) << 3) | (steps - 8);
    // a < 448 rounds to at most 448 (0x7E); the clamp is belt and braces against NaN codes.
    sign | code.min(0x7E) as u8
}

// ---------------------------------------------------------------------------------------------
// E8M0 (ue8m0) power-of-two scales
// ---------------------------------------------------------------------------------------------

/// ue8m0 scale byte to f32: 2^(b-127); 0xFF is NaN. b = 0 is 2^-127, an f32 subnormal.
pub fn e8m0_to_f32(code: u8) -> f32 {
    match code {
        0xFF => f32::NAN,
        0 => f32::from_bits(0x0040_0000), // 2^-127: the implicit bit moves into the mantissa
        _ => f32::from_bits(u32::from(code) << 23),
    }
}

/// The ue8m0 code of the smallest power of two >= `x`, used to choose block scales so that
/// `x / scale` never exceeds the element format's maximum.
///
/// Clamped to the representable range: anything above 2^127 (including +inf) gives 0xFE, and
/// anything at or below 2^-127 (including zero and negatives) gives 0x00. NaN gives 0xFF (NaN),
/// so a NaN amax stays visible instead of turning into a plausible scale.
pub fn e8m0_for_at_least(x: f32) -> u8 {
    if x.is_nan() {
        return 0xFF;
    }
    if x <= 0.0 {
        return 0;
    }
    if x.is_infinite() {
        return 0xFE;
    }
    let bits = x.to_bits();
    let exp = bits >> 23;
    let mant = bits & 0x007F_FFFF;
    if exp == 0 {
        // f32 subnormal: only 2^-127 (bits 0x0040_0000) and 2^-126 are candidates.
        return u8::from(bits > 0x0040_0000);
    }
    let code = if mant == 0 { exp } else { exp + 1 };
    code.min(0xFE) as u8
}

// ---------------------------------------------------------------------------------------------
// FP4 e2m1
// ---------------------------------------------------------------------------------------------

/// The e2m1 values by code; bit 3 is the sign.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// e2m1 code to f32. Only the low nibble is read, so a packed byte's low element can be
/// passed directly.
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    E2M1[usize::from(nibble & 0x0F)]
}

/// f32 to e2m1: round to nearest, ties to the even code (mantissa bit 0), saturating to ±6.
/// The sign is kept, so small negatives give -0 (code 8). NaN has no e2m1 encoding and maps
/// to +0 (code 0) so that a stray NaN contributes nothing rather than a large value.
pub fn f32_to_e2m1(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    let sign = if x.is_sign_negative() { 0x08 } else { 0x00 };
    let a = x.abs();
    // Midpoints between neighbours; `<=` at a midpoint picks the lower (even) code and `<`
    // picks the upper one, whichever of the two has mantissa bit 0.
    let magnitude = if a <= 0.25 {
        0 // 0
    } else if a < 0.75 {
        1 // 0.5
    } else if a <= 1.25 {
        2 // 1.0
    } else if a < 1.75 {
        3 // 1.5
    } else if a <= 2.5 {
        4 // 2.0
    } else if a < 3.5 {
        5 // 3.0
    } else if a <= 5.0 {
        6 // 4.0
    } else {
        7 // 6.0
    };
    sign | magnitude
}

/// Packs e2m1 codes two per byte: element `2i` in the LOW nibble, element `2i+1` in the high
/// nibble, which is the layout of both DeepSeek MXFP4 and ModelOpt NVFP4 checkpoints.
pub fn pack_e2m1(codes: &[u8]) -> Result<Vec<u8>, FormatError> {
    if !codes.len().is_multiple_of(2) {
        return Err(FormatError::OddLength { len: codes.len() });
    }
    if let Some((index, &code)) = codes.iter().enumerate().find(|&(_, &c)| c > 0x0F) {
        return Err(FormatError::CodeOutOfRange { index, code });
    }
    Ok(codes
        .chunks_exact(2)
        .map(|pair| pair[0] | (pair[1] << 4))
        .collect())
}

/// Unpacks one byte into its two elements, `[even (low nibble), odd (high nibble)]`.
pub fn unpack_e2m1(byte: u8) -> [f32; 2] {
    [e2m1_to_f32(byte), e2m1_to_f32(byte >> 4)]
}

// ---------------------------------------------------------------------------------------------
// Slice helpers
// ---------------------------------------------------------------------------------------------

/// Widens a bf16 slice.
pub fn bf16_slice_to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16_to_f32(b)).collect()
}

/// Narrows to bf16 (round-to-nearest-even).
pub fn f32_slice_to_bf16(xs: &[f32]) -> Vec<u16> {
    xs.iter().map(|&x| f32_to_bf16(x)).collect()
}

/// Widens an f16 slice.
pub fn f16_slice_to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| f16_to_f32(b)).collect()
}

/// Decodes e4m3fn codes.
pub fn e4m3_slice_to_f32(codes: &[u8]) -> Vec<f32> {
    codes.iter().map(|&c| e4m3_to_f32(c)).collect()
}

/// Encodes to e4m3fn (round-to-nearest-even, saturating).
pub fn f32_slice_to_e4m3(xs: &[f32]) -> Vec<u8> {
    xs.iter().map(|&x| f32_to_e4m3(x)).collect()
}

/// Decodes ue8m0 scale bytes.
pub fn e8m0_slice_to_f32(codes: &[u8]) -> Vec<f32> {
    codes.iter().map(|&c| e8m0_to_f32(c)).collect()
}

/// Encodes to e2m1 codes, one per element (not packed).
pub fn f32_slice_to_e2m1(xs: &[f32]) -> Vec<u8> {
    xs.iter().map(|&x| f32_to_e2m1(x)).collect()
}

/// Unpacks bytes of two e2m1 elements each into `2 * packed.len()` values, even element first.
pub fn unpack_e2m1_slice(packed: &[u8]) -> Vec<f32> {
    packed.iter().flat_map(|&b| unpack_e2m1(b)).collect()
}

#[cfg(test)]
#[allow(
    clippy::float_cmp,
    reason = "the conversions are exact by definition, so tests compare bit-exact values"
)]
mod tests {
    use super::*;

    fn same_bits(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits()
    }

    #[test]
    fn e2m1_all_codes() {
        let expected = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        for (code, &want) in expected.iter().enumerate() {
            let got = e2m1_to_f32(code as u8);
            assert!(same_bits(got, want), "code {code}: {got} != {want}");
        }
        // High bits are ignored: a packed byte's low element reads directly.
        assert!(same_bits(e2m1_to_f32(0xF3), 1.5));
    }

    #[test]
    fn e2m1_rounding_ties_to_even_code() {
        let cases: [(f32, f32); 20] = [
            (0.25, 0.0),
            (0.250_000_1, 0.5),
            (0.75, 1.0),
            (0.749_999_9, 0.5),
            (1.25, 1.0),
            (1.250_000_1, 1.5),
            (1.75, 2.0),
            (2.5, 2.0),
            (2.500_000_2, 3.0),
            (3.5, 4.0),
            (3.499_999_8, 3.0),
            (5.0, 4.0),
            (5.000_000_5, 6.0),
            (6.0, 6.0),
            (7.0, 6.0),
            (1e30, 6.0),
            (f32::INFINITY, 6.0),
            (-0.75, -1.0),
            (-5.0, -4.0),
            (f32::NEG_INFINITY, -6.0),
        ];
        for (x, want) in cases {
            let got = e2m1_to_f32(f32_to_e2m1(x));
            assert!(same_bits(got, want), "{x}: {got} != {want}");
        }
        assert_eq!(f32_to_e2m1(-0.1), 0x08, "small negatives keep their sign");
        assert_eq!(f32_to_e2m1(f32::NAN), 0, "NaN maps to +0 (documented)");
    }

    #[test]
    fn e2m1_nibble_order() {
        assert_eq!(unpack_e2m1(0x71), [0.5, 6.0]);
        assert_eq!(unpack_e2m1(0x9A), [-1.0, -0.5]);
        assert_eq!(pack_e2m1(&[0x1, 0x7, 0xA, 0x9]), Ok(vec![0x71, 0x9A]));
        assert_eq!(unpack_e2m1_slice(&[0x71, 0x9A]), vec![0.5, 6.0, -1.0, -0.5]);
        assert_eq!(
            pack_e2m1(&[1, 2, 3]),
            Err(FormatError::OddLength { len: 3 })
        );
        assert_eq!(
            pack_e2m1(&[1, 0x10]),
            Err(FormatError::CodeOutOfRange {
                index: 1,
                code: 0x10
            })
        );
        assert_eq!(pack_e2m1(&[]), Ok(vec![]));
    }

    #[test]
    fn e4m3_decode_edges() {
        assert!(same_bits(e4m3_to_f32(0x00), 0.0));
        assert!(same_bits(e4m3_to_f32(0x80), -0.0));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // min subnormal
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9)); // max subnormal = 0.875 * 2^-6
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // min normal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x39), 1.125);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x7D), 416.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
        assert!(e4m3_to_f32(0xFF).is_nan());
        // 0x78 would be infinity in IEEE-style e4m3; in e4m3fn it is an ordinary 256.
        assert_eq!(e4m3_to_f32(0x78), 256.0);
    }

    #[test]
    fn e4m3_encode_edges() {
        assert_eq!(f32_to_e4m3(0.0), 0x00);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(1.0), 0x38);
        assert_eq!(f32_to_e4m3(448.0), 0x7E);
        assert_eq!(f32_to_e4m3(500.0), 0x7E);
        assert_eq!(f32_to_e4m3(-500.0), 0xFE);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        // Ties to even: 1.0625 is halfway between 1.0 (m=0) and 1.125 (m=1).
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        // 1.1875 is halfway between 1.125 (m=1) and 1.25 (m=2).
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        assert_eq!(e4m3_to_f32(0x3A), 1.25);
        // Just above a tie rounds up.
        assert_eq!(f32_to_e4m3(1.062_500_1), 0x39);
        // 432 is halfway between 416 (m=5) and 448 (m=6): even is 448.
        assert_eq!(f32_to_e4m3(432.0), 0x7E);
        // Subnormal ties: 1.5 * 2^-9 -> 2 * 2^-9; 0.5 * 2^-9 -> 0.
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(f32_to_e4m3(0.5 * 2f32.powi(-9)), 0x00);
        assert_eq!(f32_to_e4m3(-0.5 * 2f32.powi(-9)), 0x80);
        // Rounding from the subnormal range up into the smallest normal.
        assert_eq!(f32_to_e4m3(7.5 * 2f32.powi(-9)), 0x08);
        // Rounding up across a binade (mantissa carry): 1.9375 is a tie between 1.875 (m=7)
        // and 2.0 (m=0 of the next exponent) and goes to 2.0.
        assert_eq!(f32_to_e4m3(1.9375), 0x40);
        assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00);
    }

    #[test]
    fn e4m3_exhaustive_round_trip() {
        for code in 0..=u8::MAX {
            let value = e4m3_to_f32(code);
            if code & 0x7F == 0x7F {
                assert!(value.is_nan());
                assert_eq!(f32_to_e4m3(value) & 0x7F, 0x7F);
                continue;
            }
            // Bit-level equality also distinguishes 0x00 from 0x80.
            assert_eq!(f32_to_e4m3(value), code, "code {code:#04x} ({value})");
        }
    }

    #[test]
    fn e4m3_encode_is_monotonic_and_nearest() {
        // Every encoding must be one of the two grid neighbours, the closer one.
        let grid: Vec<f32> = (0u8..=0x7E).map(e4m3_to_f32).collect();
        let mut x = 0.0f32;
        while x < 460.0 {
            let got = e4m3_to_f32(f32_to_e4m3(x));
            let best = grid
                .iter()
                .map(|g| (g - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!((got - x).abs() <= best, "{x} -> {got}");
            x = x * 1.0137 + 1e-4;
        }
    }

    #[test]
    fn e8m0_edges() {
        assert_eq!(e8m0_to_f32(0x7F), 1.0);
        assert_eq!(e8m0_to_f32(0x80), 2.0);
        assert_eq!(e8m0_to_f32(0x7E), 0.5);
        assert_eq!(e8m0_to_f32(0x00).to_bits(), 0x0040_0000);
        assert_eq!(f64::from(e8m0_to_f32(0x00)), 2f64.powi(-127));
        assert_eq!(f64::from(e8m0_to_f32(0x01)), 2f64.powi(-126));
        assert_eq!(f64::from(e8m0_to_f32(0xFE)), 2f64.powi(127));
        assert!(e8m0_to_f32(0xFF).is_nan());
    }

    #[test]
    fn e8m0_choose_scale() {
        assert_eq!(e8m0_for_at_least(1.0), 0x7F);
        assert_eq!(e8m0_for_at_least(1.000_000_1), 0x80);
        assert_eq!(e8m0_for_at_least(0.75), 0x7F);
        assert_eq!(e8m0_for_at_least(0.5), 0x7E);
        assert_eq!(e8m0_for_at_least(3.0), 0x80 + 1);
        assert_eq!(e8m0_for_at_least(f32::MAX), 0xFE);
        assert_eq!(e8m0_for_at_least(f32::INFINITY), 0xFE);
        assert_eq!(e8m0_for_at_least(2f32.powi(127)), 0xFE);
        assert_eq!(e8m0_for_at_least(2f32.powi(-126)), 0x01);
        assert_eq!(e8m0_for_at_least(f32::from_bits(0x0040_0000)), 0x00);
        assert_eq!(e8m0_for_at_least(f32::from_bits(0x0040_0001)), 0x01);
        assert_eq!(e8m0_for_at_least(f32::from_bits(1)), 0x00);
        assert_eq!(e8m0_for_at_least(0.0), 0x00);
        assert_eq!(e8m0_for_at_least(-3.0), 0x00);
        assert_eq!(e8m0_for_at_least(f32::NAN), 0xFF);
        // Exhaustive over codes: the chosen scale of an exact power is that power.
        for code in 0u8..=0xFE {
            assert_eq!(e8m0_for_at_least(e8m0_to_f32(code)), code);
        }
    }

    #[test]
    fn e2m1_exhaustive_round_trip() {
        for code in 0u8..16 {
            assert_eq!(f32_to_e2m1(e2m1_to_f32(code)), code);
        }
    }

    #[test]
    fn bf16_values_and_ties() {
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
        assert_eq!(bf16_to_f32(0xC000), -2.0);
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between 1.0 (even) and 1 + 2^-7: stays 1.0.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        // 1 + 3 * 2^-8 is halfway between 0x3F81 (odd) and 0x3F82 (even): goes up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        // Just above a tie rounds up; just below rounds down.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_7FFF)), 0x3F80);
        // Largest finite f32 rounds to infinity, as RNE requires.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xFF80);
        // NaN stays NaN and is quiet, even a signalling NaN whose payload is in the low bits.
        let snan = f32::from_bits(0x7F80_0001);
        assert!(snan.is_nan());
        let b = f32_to_bf16(snan);
        assert!(bf16_to_f32(b).is_nan());
        assert_eq!(b & 0x0040, 0x0040);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
    }

    #[test]
    fn bf16_exhaustive_round_trip() {
        for bits in 0..=u16::MAX {
            let value = bf16_to_f32(bits);
            if value.is_nan() {
                assert!(bf16_to_f32(f32_to_bf16(value)).is_nan());
                continue;
            }
            assert_eq!(f32_to_bf16(value), bits, "bits {bits:#06x}");
        }
    }

    #[test]
    fn f16_values() {
        assert_eq!(f16_to_f32(0x3C00), 1.0);
        assert_eq!(f16_to_f32(0xC000), -2.0);
        assert_eq!(f16_to_f32(0x7BFF), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03FF), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert!(same_bits(f16_to_f32(0x8000), -0.0));
        assert!(same_bits(f16_to_f32(0x8001), -(2f32.powi(-24))));
        assert_eq!(f16_to_f32(0x7C00), f32::INFINITY);
        assert_eq!(f16_to_f32(0xFC00), f32::NEG_INFINITY);
        assert!(f16_to_f32(0x7E00).is_nan());
        assert!(f16_to_f32(0x7C01).is_nan());
    }

    #[test]
    fn f16_exhaustive_against_f64_definition() {
        for bits in 0..=u16::MAX {
            let exp = i32::from((bits >> 10) & 0x1F);
            let mant = f64::from(bits & 0x3FF);
            let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
            let got = f16_to_f32(bits);
            if exp == 0x1F {
                assert_eq!(got.is_nan(), mant != 0.0);
                continue;
            }
            let want = if exp == 0 {
                sign * mant * 2f64.powi(-24)
            } else {
                sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15)
            };
            assert_eq!(f64::from(got), want, "bits {bits:#06x}");
            assert_eq!(got.is_sign_negative(), bits & 0x8000 != 0);
        }
    }

    #[test]
    fn slice_helpers() {
        assert_eq!(bf16_slice_to_f32(&[0x3F80, 0x4000]), vec![1.0, 2.0]);
        assert_eq!(f32_slice_to_bf16(&[1.0, 2.0]), vec![0x3F80, 0x4000]);
        assert_eq!(f16_slice_to_f32(&[0x3C00]), vec![1.0]);
        assert_eq!(e4m3_slice_to_f32(&[0x38, 0x7E]), vec![1.0, 448.0]);
        assert_eq!(f32_slice_to_e4m3(&[1.0, 448.0]), vec![0x38, 0x7E]);
        assert_eq!(e8m0_slice_to_f32(&[0x7F, 0x80]), vec![1.0, 2.0]);
        assert_eq!(f32_slice_to_e2m1(&[0.5, -6.0]), vec![0x1, 0xF]);
    }
}
