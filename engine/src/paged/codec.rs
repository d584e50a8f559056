//! Encoding one state row into its stored bytes and back.

use super::layout::RowFormat;
use crate::formats;

/// Writes `row` into `out` (exactly `format.row_bytes(row.len())` bytes).
pub fn encode(format: RowFormat, row: &[f32], out: &mut [u8]) {
    let Some((nope, rope)) = format.e4m3_bf16_split(row.len()) else {
        for (chunk, v) in out.chunks_exact_mut(4).zip(row) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        return;
    };
    let (q, rest) = out.split_at_mut(nope);
    let (r, scales) = rest.split_at_mut(2 * rope);
    scales.fill(0);
    for (b, block) in row[..nope].chunks(64).enumerate() {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale_code =
            formats::e8m0_for_at_least((amax / formats::E4M3_MAX).max(f32::MIN_POSITIVE));
        let scale = formats::e8m0_to_f32(scale_code);
        scales[b] = scale_code;
        for (i, v) in block.iter().enumerate() {
            q[b * 64 + i] = formats::f32_to_e4m3(v / scale);
        }
    }
    for (chunk, v) in r.chunks_exact_mut(2).zip(&row[nope..nope + rope]) {
        chunk.copy_from_slice(&formats::f32_to_bf16(*v).to_le_bytes());
    }
}

/// `row` as storing it in `format` and reading it back gives it (F32: unchanged). Rounding a
/// rounded row changes nothing, so a row rounded when computed is stored without further loss.
pub fn round(format: RowFormat, row: &mut [f32]) {
    if format == RowFormat::F32 {
        return;
    }
    let mut bytes = vec![0; format.row_bytes(row.len())];
    encode(format, row, &mut bytes);
    row.copy_from_slice(&decode(format, &bytes, row.len()));
}

/// Reads a row of `elements` values from its stored bytes.
pub fn decode(format: RowFormat, bytes: &[u8], elements: usize) -> Vec<f32> {
    let Some((nope, rope)) = format.e4m3_bf16_split(elements) else {
        return bytes[..4 * elements]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
    };
    let mut out = Vec::with_capacity(nope + rope);
    let scales = &bytes[nope + 2 * rope..];
    for (i, &q) in bytes[..nope].iter().enumerate() {
        out.push(formats::e4m3_to_f32(q) * formats::e8m0_to_f32(scales[i / 64]));
    }
    for b in bytes[nope..nope + 2 * rope].chunks_exact(2) {
        out.push(formats::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_round_trip_is_exact() {
        let row: Vec<f32> = (0..7).map(|i| i as f32 * -0.37 + 1e-30).collect();
        let mut bytes = vec![0; 28];
        encode(RowFormat::F32, &row, &mut bytes);
        assert_eq!(decode(RowFormat::F32, &bytes, 7), row);
    }

    /// A rounded row rounds to itself (a block whose maximum rounded down may take the next
    /// smaller scale, on which its values are still exact), so storing a row rounded when it
    /// was computed loses nothing more.
    #[test]
    fn rounding_a_rounded_row_changes_nothing() {
        let format = RowFormat::Fp8Kv {
            nope: 100,
            rope: 28,
        };
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for case in 0..2000 {
            let magnitude = 2f32.powi((case % 60) - 30);
            let row: Vec<f32> = (0..128)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * magnitude
                })
                .collect();
            let mut once = row.clone();
            round(format, &mut once);
            let mut twice = once.clone();
            round(format, &mut twice);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&twice), bits(&once), "case {case}");
            assert_ne!(bits(&once), bits(&row), "case {case}: FP8 rounds");
        }
        let mut nan = vec![1.0f32; 128];
        nan[3] = f32::NAN;
        round(format, &mut nan);
        assert!(nan[3].is_nan(), "NaN in, NaN out");
        let mut plain = vec![0.3f32; 7];
        round(RowFormat::F32, &mut plain);
        assert_eq!(plain, vec![0.3f32; 7]);
    }

    /// A bf16 row is each value rounded to nearest even (ties to the even mantissa, NaN kept,
    /// overflow to infinity), two little-endian bytes per value: the same bytes as an FP8 row
    /// with no e4m3 part, and the same values as the FP8 row's rope dims.
    #[test]
    fn bf16_rows_round_each_value_to_nearest_even() {
        let cases: [(u32, u32); 7] = [
            (0x3f80_0000, 0x3f80_0000), // 1.0 is a bf16
            (0x3f80_8000, 0x3f80_0000), // a tie goes to the even mantissa (down)
            (0x3f81_8000, 0x3f82_0000), // a tie goes to the even mantissa (up)
            (0x3f80_8001, 0x3f81_0000), // past the tie: up
            (0xbf80_7fff, 0xbf80_0000), // below the tie: down, sign kept
            (0x7f7f_ffff, 0x7f80_0000), // f32::MAX rounds to infinity
            (0x0000_0001, 0x0000_0000), // the smallest subnormal rounds to zero
        ];
        let row: Vec<f32> = cases.iter().map(|&(x, _)| f32::from_bits(x)).collect();
        let mut bytes = vec![0xAA; RowFormat::Bf16.row_bytes(row.len())];
        assert_eq!(bytes.len(), 14);
        encode(RowFormat::Bf16, &row, &mut bytes);
        let back = decode(RowFormat::Bf16, &bytes, row.len());
        for ((&(x, want), got), b) in cases.iter().zip(&back).zip(bytes.chunks_exact(2)) {
            assert_eq!(got.to_bits(), want, "{x:#010x}");
            assert_eq!(u16::from_le_bytes([b[0], b[1]]), (want >> 16) as u16);
        }
        let mut as_fp8 = vec![0x55; bytes.len()];
        let no_e4m3 = RowFormat::Fp8Kv { nope: 0, rope: 7 };
        assert_eq!(no_e4m3.row_bytes(7), bytes.len());
        encode(no_e4m3, &row, &mut as_fp8);
        assert_eq!(as_fp8, bytes);
        let mut nan = vec![0.5f32, f32::NAN, -0.0];
        round(RowFormat::Bf16, &mut nan);
        assert!(nan[1].is_nan(), "NaN in, NaN out");
        assert_eq!(nan[2].to_bits(), (-0.0f32).to_bits());
        let mut twice = back.clone();
        round(RowFormat::Bf16, &mut twice);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&twice), bits(&back), "a rounded row rounds to itself");
    }

    #[test]
    fn fp8_row_matches_deepseek_layout_and_error_bound() {
        let format = RowFormat::Fp8Kv {
            nope: 448,
            rope: 64,
        };
        let row: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut bytes = vec![0xAA; format.row_bytes(512)];
        assert_eq!(bytes.len(), 584);
        encode(format, &row, &mut bytes);
        assert_eq!(bytes[583], 0, "pad byte after 7 scales");
        let back = decode(format, &bytes, 512);
        for (b, block) in row[..448].chunks(64).enumerate() {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, v) in block.iter().enumerate() {
                // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block max.
                assert!((back[b * 64 + i] - v).abs() <= amax / 16.0);
            }
        }
        for (got, want) in back[448..].iter().zip(&row[448..]) {
            assert!((got - want).abs() <= want.abs() / 128.0, "bf16 rope dims");
        }
    }
}
