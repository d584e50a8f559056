//! Block (de)quantization of row-major `[rows, cols]` weight matrices, as CPU references for
//! checkpoint loading and for testing GPU kernels.
//!
//! Three layouts appear in DeepSeek-V4 deployments:
//! - FP8 block: e4m3fn elements with one ue8m0 scale per 128x128 tile (dense weights).
//! - MXFP4: e2m1 elements, two per byte, with one ue8m0 scale per 32 elements along a row
//!   (DeepSeek's native routed-expert format).
//! - NVFP4 (NVIDIA ModelOpt): e2m1 elements, two per byte, one e4m3fn scale per 16 elements
//!   along a row, and one f32 per-tensor `scale_2` multiplied on top.
//!
//! In both FP4 layouts element `2i` of a row sits in the LOW nibble of byte `i`.
//!
//! Non-finite inputs never panic: amax reductions ignore NaN, so a NaN element quantizes to the
//! format's NaN (FP8) or to zero (FP4, which has no NaN), and infinities saturate.

use crate::formats::{
    E2M1_MAX, E4M3_MAX, e2m1_to_f32, e4m3_to_f32, e8m0_for_at_least, e8m0_slice_to_f32,
    e8m0_to_f32, f32_to_e2m1, f32_to_e4m3, unpack_e2m1,
};

/// Side of the square FP8 scale tile.
pub const FP8_BLOCK: usize = 128;
/// Elements sharing one MXFP4 scale (along a row).
pub const MXFP4_BLOCK: usize = 32;
/// Elements sharing one NVFP4 block scale (along a row).
pub const NVFP4_BLOCK: usize = 16;

/// ue8m0 code of 1.0, used for all-zero FP8/MXFP4 blocks where any scale is exact.
const E8M0_ONE: u8 = 0x7F;
/// e4m3 code of 1.0, which ModelOpt stores for all-zero NVFP4 blocks.
const E4M3_ONE: u8 = 0x38;

/// Why a (de)quantization call rejected its arguments. Every variant names what it expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// An f32 input does not hold `rows * cols` elements.
    #[error("{what}: a [{rows}, {cols}] matrix has {expected} elements, got {actual}")]
    ShapeMismatch {
        what: &'static str,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// The format packs or scales along rows in fixed groups that must tile the row exactly.
    #[error("{format}: cols must be a multiple of {multiple}, got {cols}")]
    NonDivisibleCols {
        format: &'static str,
        multiple: usize,
        cols: usize,
    },
    /// A quantized buffer (elements or scales) has the wrong length for the shape.
    #[error("{what}: expected {expected} bytes, got {actual}")]
    WrongByteCount {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// `rows * cols` does not fit in `usize`.
    #[error("a [{rows}, {cols}] matrix has more elements than fit in memory")]
    TooLarge { rows: usize, cols: usize },
}

fn element_count(rows: usize, cols: usize) -> Result<usize, QuantError> {
    rows.checked_mul(cols)
        .ok_or(QuantError::TooLarge { rows, cols })
}

fn expect_elements(
    what: &'static str,
    rows: usize,
    cols: usize,
    actual: usize,
) -> Result<usize, QuantError> {
    let expected = element_count(rows, cols)?;
    if actual == expected {
        Ok(expected)
    } else {
        Err(QuantError::ShapeMismatch {
            what,
            rows,
            cols,
            expected,
            actual,
        })
    }
}

fn expect_bytes(what: &'static str, expected: usize, actual: usize) -> Result<(), QuantError> {
    if actual == expected {
        Ok(())
    } else {
        Err(QuantError::WrongByteCount {
            what,
            expected,
            actual,
        })
    }
}

fn require_multiple(format: &'static str, cols: usize, multiple: usize) -> Result<(), QuantError> {
    if cols.is_multiple_of(multiple) {
        Ok(())
    } else {
        Err(QuantError::NonDivisibleCols {
            format,
            multiple,
            cols,
        })
    }
}

/// Largest magnitude, ignoring NaN (`f32::max` returns the non-NaN operand), so one NaN does
/// not poison the scale of every other element in its block.
fn amax(xs: &[f32]) -> f32 {
    xs.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// The power-of-two scale for a block whose elements must fit `format_max`. An all-zero (or
/// all-NaN) block gets 1.0: every scale represents zeros exactly and 1.0 is the neutral choice.
fn e8m0_block_scale(block_amax: f32, format_max: f32) -> u8 {
    if block_amax == 0.0 {
        E8M0_ONE
    } else {
        e8m0_for_at_least(block_amax / format_max)
    }
}

// ---------------------------------------------------------------------------------------------
// FP8 e4m3 with 128x128 ue8m0 scales
// ---------------------------------------------------------------------------------------------

/// Dequantizes an e4m3fn `[rows, cols]` matrix with ue8m0 scales laid out row-major as
/// `[ceil(rows/128), ceil(cols/128)]`: `w[r][c] = e4m3(weight[r][c]) * 2^(scale[r/128][c/128]-127)`.
/// Edge tiles may be partial.
pub fn dequant_fp8_block(
    weight: &[u8],
    scale: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let n = element_count(rows, cols)?;
    let tile_cols = cols.div_ceil(FP8_BLOCK);
    // Cannot overflow: ceil(rows/128) * ceil(cols/128) <= rows * cols.
    let tiles = rows.div_ceil(FP8_BLOCK) * tile_cols;
    expect_bytes("FP8 weight", n, weight.len())?;
    expect_bytes("FP8 block scale", tiles, scale.len())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let scales = e8m0_slice_to_f32(scale);
    let mut out = Vec::with_capacity(n);
    for (r, row) in weight.chunks_exact(cols).enumerate() {
        let row_scales = &scales[(r / FP8_BLOCK) * tile_cols..][..tile_cols];
        out.extend(
            row.iter()
                .enumerate()
                .map(|(c, &q)| e4m3_to_f32(q) * row_scales[c / FP8_BLOCK]),
        );
    }
    Ok(out)
}

/// Quantizes to e4m3fn with one ue8m0 scale per 128x128 tile, returning `(weight, scale)` in
/// the layout [`dequant_fp8_block`] reads.
///
/// Each tile's scale is the smallest power of two >= amax/448, so the largest element lands in
/// (224, 448] and nothing saturates; an all-zero tile gets scale 1.0. Dividing by a power of
/// two is exact, so the only rounding is the e4m3 RNE step: every element's error is at most
/// 2^-4 of its tile's amax.
pub fn quant_fp8_block(
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Result<(Vec<u8>, Vec<u8>), QuantError> {
    let n = expect_elements("FP8 input", rows, cols, w.len())?;
    let tile_cols = cols.div_ceil(FP8_BLOCK);
    let tiles = rows.div_ceil(FP8_BLOCK) * tile_cols;
    if n == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let mut tile_amax = vec![0.0f32; tiles];
    for (r, row) in w.chunks_exact(cols).enumerate() {
        let amax_row = &mut tile_amax[(r / FP8_BLOCK) * tile_cols..][..tile_cols];
        for (c, x) in row.iter().enumerate() {
            let m = &mut amax_row[c / FP8_BLOCK];
            *m = m.max(x.abs());
        }
    }
    let scale: Vec<u8> = tile_amax
        .iter()
        .map(|&a| e8m0_block_scale(a, E4M3_MAX))
        .collect();
    let scales = e8m0_slice_to_f32(&scale);
    let mut q = Vec::with_capacity(n);
    for (r, row) in w.chunks_exact(cols).enumerate() {
        let row_scales = &scales[(r / FP8_BLOCK) * tile_cols..][..tile_cols];
        q.extend(
            row.iter()
                .enumerate()
                .map(|(c, &x)| f32_to_e4m3(x / row_scales[c / FP8_BLOCK])),
        );
    }
    Ok((q, scale))
}

// ---------------------------------------------------------------------------------------------
// MXFP4: e2m1 with ue8m0 scales per 32 elements
// ---------------------------------------------------------------------------------------------

/// Dequantizes MXFP4: `packed` is `[rows, cols/2]` (element `2i` in the low nibble), `scale`
/// is ue8m0 `[rows, cols/32]`; `w[r][c] = e2m1 * 2^(scale[r][c/32]-127)`.
pub fn dequant_mxfp4(
    packed: &[u8],
    scale: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    require_multiple("MXFP4", cols, MXFP4_BLOCK)?;
    let n = element_count(rows, cols)?;
    expect_bytes("MXFP4 packed weight", n / 2, packed.len())?;
    expect_bytes("MXFP4 scale", n / MXFP4_BLOCK, scale.len())?;
    let scales = e8m0_slice_to_f32(scale);
    let mut out = Vec::with_capacity(n);
    // Blocks never straddle rows (cols % 32 == 0), so the flat byte index alone finds the
    // scale: 16 bytes per 32-element block.
    for (bytes, &s) in packed.chunks_exact(MXFP4_BLOCK / 2).zip(&scales) {
        for &byte in bytes {
            let [even, odd] = unpack_e2m1(byte);
            out.push(even * s);
            out.push(odd * s);
        }
    }
    Ok(out)
}

/// Quantizes to MXFP4, returning `(packed, scale)` in the layout [`dequant_mxfp4`] reads.
///
/// Each 32-element block's scale is the smallest power of two >= amax/6 (1.0 for an all-zero
/// block), so the block's largest element lands in (3, 6]; codes are `f32_to_e2m1(w / scale)`
/// (RNE, ties to even code). The error of an element is at most half the e2m1 grid spacing
/// around `|w|/scale` (0.25, 0.5 or 1.0) times the scale.
pub fn quant_mxfp4(w: &[f32], rows: usize, cols: usize) -> Result<(Vec<u8>, Vec<u8>), QuantError> {
    require_multiple("MXFP4", cols, MXFP4_BLOCK)?;
    let n = expect_elements("MXFP4 input", rows, cols, w.len())?;
    let mut packed = Vec::with_capacity(n / 2);
    let mut scale = Vec::with_capacity(n / MXFP4_BLOCK);
    for block in w.chunks_exact(MXFP4_BLOCK) {
        let code = e8m0_block_scale(amax(block), E2M1_MAX);
        scale.push(code);
        let s = e8m0_to_f32(code);
        push_e2m1_pairs(&mut packed, block, s);
    }
    Ok((packed, scale))
}

/// Encodes `x / s` two elements per byte, even element in the low nibble. A zero scale (an
/// NVFP4 block scale that underflowed e4m3) gives code 0 instead of dividing by zero, which
/// would turn every element into ±6.
fn push_e2m1_pairs(out: &mut Vec<u8>, block: &[f32], s: f32) {
    let encode = |x: f32| if s == 0.0 { 0 } else { f32_to_e2m1(x / s) };
    out.extend(
        block
            .chunks_exact(2)
            .map(|pair| encode(pair[0]) | (encode(pair[1]) << 4)),
    );
}

// ---------------------------------------------------------------------------------------------
// NVFP4 (ModelOpt): e2m1 with e4m3 scales per 16 elements and an f32 per-tensor scale_2
// ---------------------------------------------------------------------------------------------

/// Dequantizes NVFP4 as ModelOpt stores it: `packed` uint8 `[rows, cols/2]` (element `2i` in
/// the low nibble), `block_scale` e4m3fn `[rows, cols/16]`, and the per-tensor `scale_2`
/// (`weight_scale_2`): `w = e2m1 * (e4m3(block_scale[r][c/16]) * scale_2)`. The two scales are
/// multiplied first, as the quantizer and the GPU kernels do, so rounding matches them.
pub fn dequant_nvfp4(
    packed: &[u8],
    block_scale: &[u8],
    scale_2: f32,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    require_multiple("NVFP4", cols, NVFP4_BLOCK)?;
    let n = element_count(rows, cols)?;
    expect_bytes("NVFP4 packed weight", n / 2, packed.len())?;
    expect_bytes("NVFP4 block scale", n / NVFP4_BLOCK, block_scale.len())?;
    let mut out = Vec::with_capacity(n);
    for (bytes, &code) in packed.chunks_exact(NVFP4_BLOCK / 2).zip(block_scale) {
        let s = e4m3_to_f32(code) * scale_2;
        for &byte in bytes {
            out.push(e2m1_to_f32(byte) * s);
            out.push(e2m1_to_f32(byte >> 4) * s);
        }
    }
    Ok(out)
}

/// Quantizes to NVFP4 following NVIDIA ModelOpt, returning `(packed, block_scale, scale_2)`.
///
/// `scale_2 = global_amax / (6 * 448)` (1.0 when the matrix is all zero), so the largest
/// block's scale lands at e4m3's maximum. Per 16-element block:
/// `block_scale = f32_to_e4m3(block_amax / 6 / scale_2)` (saturating, where ModelOpt's
/// unclamped cast could emit the NaN byte), except that an all-zero block stores 1.0 as
/// ModelOpt does (its codes are zero either way). Codes are
/// `f32_to_e2m1(w / (e4m3(block_scale) * scale_2))`; a block scale that underflowed to zero
/// gives code 0.
///
/// Error: with `S = e4m3(block_scale) * scale_2` and `v = |w| / S`, an element is off by at
/// most half the e2m1 spacing around `v` times `S` when `v <= 6`. Rounding the block scale to
/// e4m3 can push `v` up to 6.4 (or further when the block scale is an e4m3 subnormal, i.e. the
/// block is ~3e4 times smaller than the matrix amax); those elements saturate to ±6.
pub fn quant_nvfp4(
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Result<(Vec<u8>, Vec<u8>, f32), QuantError> {
    require_multiple("NVFP4", cols, NVFP4_BLOCK)?;
    let n = expect_elements("NVFP4 input", rows, cols, w.len())?;
    let global_amax = amax(w);
    let scale_2 = if global_amax == 0.0 {
        1.0
    } else {
        global_amax / (E2M1_MAX * E4M3_MAX)
    };
    let mut packed = Vec::with_capacity(n / 2);
    let mut block_scale = Vec::with_capacity(n / NVFP4_BLOCK);
    nvfp4_blocks(w, scale_2, &mut packed, &mut block_scale);
    Ok((packed, block_scale, scale_2))
}

/// Reference NVFP4 quantization of one activation row with a given per-tensor scale, for
/// testing GPU activation-quant kernels: the same per-16 rule as [`quant_nvfp4`] with
/// `scale_2 = global_scale`. Returns `(packed, block_scales)`.
///
/// `global_scale` is in the dequantization direction (`amax / (6 * 448)`, like a ModelOpt
/// checkpoint's `input_scale`), NOT the reciprocal that FlashInfer / TensorRT-LLM quantize
/// kernels take as their "global scale" argument. It should be positive and finite: zero
/// gives all-zero codes, and non-finite values give NaN block scales and zero codes.
pub fn quant_nvfp4_activation(
    x: &[f32],
    global_scale: f32,
) -> Result<(Vec<u8>, Vec<u8>), QuantError> {
    require_multiple("NVFP4 activation", x.len(), NVFP4_BLOCK)?;
    let mut packed = Vec::with_capacity(x.len() / 2);
    let mut block_scale = Vec::with_capacity(x.len() / NVFP4_BLOCK);
    nvfp4_blocks(x, global_scale, &mut packed, &mut block_scale);
    Ok((packed, block_scale))
}

/// Shared per-16 NVFP4 rule; `x.len()` is a multiple of 16 (checked by callers).
fn nvfp4_blocks(x: &[f32], scale_2: f32, packed: &mut Vec<u8>, block_scale: &mut Vec<u8>) {
    for block in x.chunks_exact(NVFP4_BLOCK) {
        let block_amax = amax(block);
        let code = if block_amax == 0.0 {
            E4M3_ONE
        } else {
            f32_to_e4m3(block_amax / E2M1_MAX / scale_2)
        };
        block_scale.push(code);
        push_e2m1_pairs(packed, block, e4m3_to_f32(code) * scale_2);
    }
}

#[cfg(test)]
#[allow(
    clippy::float_cmp,
    clippy::many_single_char_names,
    reason = "hand-computed values are exact; short names follow the math (w, q, s, d)"
)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Deterministic values (xorshift64) around `magnitude`, with exact zeros and 10x outliers
    /// so blocks have varied amax.
    fn sample(n: usize, seed: u64, magnitude: f32) -> Vec<f32> {
        let mut state = seed | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                match state % 16 {
                    0 => 0.0,
                    1 => (2.0 * u - 1.0) * 10.0 * magnitude,
                    _ => (2.0 * u - 1.0) * magnitude,
                }
            })
            .collect()
    }

    /// Half the e2m1 grid spacing around a scaled magnitude: the grid steps by 0.5 up to 2,
    /// by 1 up to 4 and by 2 up to 6.
    fn half_spacing(v: f64) -> f64 {
        if v <= 2.0 {
            0.25
        } else if v <= 4.0 {
            0.5
        } else {
            1.0
        }
    }

    fn err(a: f32, b: f32) -> f64 {
        (f64::from(a) - f64::from(b)).abs()
    }

    /// Asserted bound: every element is within 2^-4 of its 128x128 tile's amax.
    fn check_fp8(w: &[f32], rows: usize, cols: usize) {
        let (q, s) = quant_fp8_block(w, rows, cols).unwrap();
        let d = dequant_fp8_block(&q, &s, rows, cols).unwrap();
        let tile_cols = cols.div_ceil(128);
        let mut tile_amax = vec![0.0f32; rows.div_ceil(128) * tile_cols];
        for r in 0..rows {
            for c in 0..cols {
                let t = &mut tile_amax[(r / 128) * tile_cols + c / 128];
                *t = t.max(w[r * cols + c].abs());
            }
        }
        for r in 0..rows {
            for c in 0..cols {
                let i = r * cols + c;
                let bound = f64::from(tile_amax[(r / 128) * tile_cols + c / 128]) / 16.0;
                assert!(err(d[i], w[i]) <= bound, "[{r},{c}]: {} vs {}", d[i], w[i]);
            }
        }
    }

    /// Asserted bound: |error| <= half the e2m1 spacing around |w|/scale, times the scale.
    fn check_mxfp4(w: &[f32], rows: usize, cols: usize) {
        let (p, s) = quant_mxfp4(w, rows, cols).unwrap();
        let d = dequant_mxfp4(&p, &s, rows, cols).unwrap();
        for (i, (&x, &y)) in w.iter().zip(&d).enumerate() {
            let scale = f64::from(e8m0_to_f32(s[i / 32]));
            let v = f64::from(x.abs()) / scale;
            // The scale is chosen so nothing needs to saturate.
            assert!(v <= 6.0, "element {i}: |w|/scale = {v}");
            assert!(
                err(x, y) <= half_spacing(v) * scale,
                "element {i}: {y} vs {x}"
            );
        }
    }

    /// Asserted bound, with `S` the effective block scale and `v = |w| / S`: half the e2m1
    /// spacing times `S` when `v <= 6`, the saturation error `|w| - 6S` beyond; and `v <= 6.4`
    /// (so the error is at most `S`) whenever the ideal block scale is an e4m3 normal.
    fn check_nvfp4(w: &[f32], rows: usize, cols: usize) {
        let (p, bs, s2) = quant_nvfp4(w, rows, cols).unwrap();
        let d = dequant_nvfp4(&p, &bs, s2, rows, cols).unwrap();
        let mut block_amax = vec![0.0f32; w.len() / 16];
        for (i, x) in w.iter().enumerate() {
            block_amax[i / 16] = block_amax[i / 16].max(x.abs());
        }
        for (i, (&x, &y)) in w.iter().zip(&d).enumerate() {
            let s = f64::from(e4m3_to_f32(bs[i / 16]) * s2);
            if s == 0.0 {
                assert_eq!(y, 0.0);
                continue;
            }
            let v = f64::from(x.abs()) / s;
            // Slack covers the f32 rounding of w / S in the quantizer.
            let slack = 1e-6 * s;
            let bound = if v <= 6.0 {
                half_spacing(v) * s
            } else {
                (v - 6.0) * s
            };
            assert!(err(x, y) <= bound + slack, "element {i}: {y} vs {x}");
            let ideal = f64::from(block_amax[i / 16]) / 6.0 / f64::from(s2);
            if ideal >= 2f64.powi(-6) {
                assert!(v <= 6.0 / (1.0 - 1.0 / 16.0) + 1e-6, "element {i}: v = {v}");
            }
        }
    }

    #[test]
    fn fp8_small_hand_computed() {
        // amax 448 -> scale 2^0; codes are plain e4m3 encodings.
        let w = [1.0, -2.0, 448.0, 0.5, 3.0, -0.25];
        let (q, s) = quant_fp8_block(&w, 2, 3).unwrap();
        assert_eq!(s, vec![0x7F]);
        assert_eq!(q, vec![0x38, 0xC0, 0x7E, 0x30, 0x44, 0xA8]);
        assert_eq!(dequant_fp8_block(&q, &s, 2, 3).unwrap(), w.to_vec());
        // amax 1000 -> 1000/448 = 2.23 -> scale 4 (code 0x81); 1000/4 = 250 rounds to 256.
        let (q, s) = quant_fp8_block(&[1000.0, 1.0], 1, 2).unwrap();
        assert_eq!(s, vec![0x81]);
        assert_eq!(q, vec![0x78, 0x28]); // 256 and 0.25
        assert_eq!(dequant_fp8_block(&q, &s, 1, 2).unwrap(), vec![1024.0, 1.0]);
    }

    #[test]
    fn fp8_partial_blocks_130x200() {
        let (rows, cols) = (130, 200);
        // Tile multipliers; each tile contains both -8 and +8 times its multiplier.
        let mult = [[1.0f32, 100.0], [0.01, 0.0]];
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                (((r * 7 + c * 13) % 17) as f32 - 8.0) * mult[r / 128][c / 128]
            })
            .collect();
        let (q, s) = quant_fp8_block(&w, rows, cols).unwrap();
        // 8/448 -> 2^-5; 800/448 -> 2^1; 0.08/448 -> 2^-12; all-zero tile -> 2^0.
        assert_eq!(s, vec![127 - 5, 127 + 1, 127 - 12, 127]);
        let d = dequant_fp8_block(&q, &s, rows, cols).unwrap();
        let at = |r: usize, c: usize| r * cols + c;
        // w[0][0] = -8: -8 / 2^-5 = -256 = 0xF8, exact.
        assert_eq!((q[at(0, 0)], d[at(0, 0)]), (0xF8, -8.0));
        // w[1][130] = 600: 600 / 2 = 300 -> 288 (1.125 * 2^8, code 0x79) -> 576.
        assert_eq!((q[at(1, 130)], d[at(1, 130)]), (0x79, 576.0));
        // w[128][5] = 0.01: 0.01 * 4096 = 40.96 -> 40 (1.25 * 2^5, code 0x62) -> 40 / 4096.
        assert_eq!((q[at(128, 5)], d[at(128, 5)]), (0x62, 40.0 / 4096.0));
        // w[129][127] = -0.04: -163.84 -> -160 (code 0xF2) -> -160 / 4096.
        assert_eq!((q[at(129, 127)], d[at(129, 127)]), (0xF2, -160.0 / 4096.0));
        // The partial bottom-right tile is all zero (a signed zero: residue 5 gives -3 * 0.0).
        assert_eq!((q[at(129, 199)], d[at(129, 199)]), (0x80, 0.0));
        check_fp8(&w, rows, cols);
    }

    #[test]
    fn mxfp4_hand_computed() {
        let mut w = vec![0.0f32; 64];
        w[..4].copy_from_slice(&[0.5, 6.0, -1.0, -0.5]);
        w[32..36].copy_from_slice(&[12.0, 1.0, 5.0, -7.0]);
        let (p, s) = quant_mxfp4(&w, 2, 32).unwrap();
        // Row 0: amax 6 -> scale 1. Row 1: amax 12 -> scale 2; 5/2 = 2.5 ties to 2.0 and
        // -7/2 = -3.5 ties to -4.0 (the even codes).
        assert_eq!(s, vec![0x7F, 0x80]);
        let mut want = vec![0u8; 32];
        want[..2].copy_from_slice(&[0x71, 0x9A]);
        want[16..18].copy_from_slice(&[0x17, 0xE4]);
        assert_eq!(p, want);
        let d = dequant_mxfp4(&p, &s, 2, 32).unwrap();
        assert_eq!(&d[..4], &[0.5, 6.0, -1.0, -0.5]);
        assert_eq!(&d[32..36], &[12.0, 1.0, 4.0, -8.0]);
        assert!(d[4..32].iter().chain(&d[36..]).all(|&x| x == 0.0));
    }

    #[test]
    fn nvfp4_hand_computed() {
        let mut w = vec![0.0f32; 32];
        w[..2].copy_from_slice(&[1344.0, 224.0]);
        w[16..18].copy_from_slice(&[3.0, -1.5]);
        let (p, bs, s2) = quant_nvfp4(&w, 1, 32).unwrap();
        // scale_2 = 1344 / 2688 = 0.5. Block 0: 1344/6/0.5 = 448 (0x7E), effective scale 224.
        // Block 1: 3/6/0.5 = 1 (0x38), effective scale 0.5.
        assert_eq!(s2, 0.5);
        assert_eq!(bs, vec![0x7E, 0x38]);
        let mut want = vec![0u8; 16];
        want[0] = 0x27; // element 0 = 6 (code 7, low nibble), element 1 = 1 (code 2)
        want[8] = 0xD7; // element 16 = 6 (code 7), element 17 = -3 (code 0xD)
        assert_eq!(p, want);
        assert_eq!(dequant_nvfp4(&p, &bs, s2, 1, 32).unwrap(), w);
    }

    #[test]
    fn nvfp4_zero_and_underflowing_blocks() {
        // All-zero matrix: scale_2 = 1, every block stores 1.0 as ModelOpt does.
        let (p, bs, s2) = quant_nvfp4(&[0.0; 32], 1, 32).unwrap();
        assert_eq!((p, bs, s2), (vec![0; 16], vec![0x38, 0x38], 1.0));
        // Block 1 is so small relative to the matrix that its e4m3 scale rounds to zero:
        // its codes must be 0, not ±6 from a division by zero.
        let mut w = vec![0.0f32; 32];
        w[0] = 2688.0;
        w[16] = 1e-4;
        let (p, bs, s2) = quant_nvfp4(&w, 1, 32).unwrap();
        assert_eq!((bs.clone(), s2), (vec![0x7E, 0x00], 1.0));
        assert_eq!(p[8], 0);
        let d = dequant_nvfp4(&p, &bs, s2, 1, 32).unwrap();
        assert_eq!((d[0], d[16]), (2688.0, 0.0));
    }

    #[test]
    fn nvfp4_activation_matches_weight_rule() {
        let (rows, cols) = (3, 64);
        let w = sample(rows * cols, 7, 3.0);
        let (p, bs, s2) = quant_nvfp4(&w, rows, cols).unwrap();
        for r in 0..rows {
            let (ap, abs) = quant_nvfp4_activation(&w[r * cols..][..cols], s2).unwrap();
            assert_eq!(ap, &p[r * cols / 2..][..cols / 2]);
            assert_eq!(abs, &bs[r * cols / 16..][..cols / 16]);
        }
        let mut x = [0.0f32; 16];
        x[..2].copy_from_slice(&[3.0, -1.5]);
        let (ap, abs) = quant_nvfp4_activation(&x, 0.5).unwrap();
        assert_eq!(abs, vec![0x38]);
        assert_eq!(ap, vec![0xD7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            quant_nvfp4_activation(&[1.0; 17], 1.0),
            Err(QuantError::NonDivisibleCols {
                format: "NVFP4 activation",
                multiple: 16,
                cols: 17
            })
        );
    }

    #[test]
    fn round_trip_bounds_on_sampled_matrices() {
        for (rows, cols, seed, mag) in [(1, 32, 1, 1.0), (129, 256, 2, 1e-3), (7, 96, 3, 5e4)] {
            let w = sample(rows * cols, seed, mag);
            check_fp8(&w, rows, cols);
            check_mxfp4(&w, rows, cols);
            check_nvfp4(&w, rows, cols);
        }
    }

    #[test]
    fn non_finite_inputs_do_not_panic() {
        let mut w = vec![1.0f32; 32];
        w[0] = f32::NAN;
        w[1] = f32::INFINITY;
        w[2] = f32::NEG_INFINITY;
        let (q, s) = quant_fp8_block(&w, 1, 32).unwrap();
        assert_eq!(q[0], 0x7F, "NaN stays NaN in FP8");
        assert_eq!(
            s,
            vec![0xFE],
            "an infinite amax clamps to the largest scale"
        );
        assert!(dequant_fp8_block(&q, &s, 1, 32).is_ok());
        let (p, s) = quant_mxfp4(&w, 1, 32).unwrap();
        assert_eq!(p[0] & 0x0F, 0, "NaN becomes zero in e2m1");
        assert!(dequant_mxfp4(&p, &s, 1, 32).is_ok());
        let (p, bs, s2) = quant_nvfp4(&w, 1, 32).unwrap();
        assert!(dequant_nvfp4(&p, &bs, s2, 1, 32).is_ok());
    }

    #[test]
    fn empty_matrices() {
        assert_eq!(quant_fp8_block(&[], 0, 5), Ok((vec![], vec![])));
        assert_eq!(dequant_fp8_block(&[], &[], 5, 0), Ok(vec![]));
        assert_eq!(quant_mxfp4(&[], 0, 64), Ok((vec![], vec![])));
        assert_eq!(dequant_nvfp4(&[], &[], 1.0, 3, 0), Ok(vec![]));
    }

    #[test]
    fn shape_and_byte_count_errors() {
        let wrong = |what, expected, actual| QuantError::WrongByteCount {
            what,
            expected,
            actual,
        };
        assert_eq!(
            dequant_fp8_block(&[0; 5], &[0x7F], 2, 3),
            Err(wrong("FP8 weight", 6, 5))
        );
        assert_eq!(
            dequant_fp8_block(&[0; 6], &[], 2, 3),
            Err(wrong("FP8 block scale", 1, 0))
        );
        // 130x200 needs a 2x2 scale grid.
        assert_eq!(
            dequant_fp8_block(&vec![0; 26_000], &[0; 3], 130, 200),
            Err(wrong("FP8 block scale", 4, 3))
        );
        assert_eq!(
            quant_fp8_block(&[0.0; 5], 2, 3),
            Err(QuantError::ShapeMismatch {
                what: "FP8 input",
                rows: 2,
                cols: 3,
                expected: 6,
                actual: 5
            })
        );
        assert_eq!(
            dequant_mxfp4(&[0; 24], &[0; 1], 1, 48),
            Err(QuantError::NonDivisibleCols {
                format: "MXFP4",
                multiple: 32,
                cols: 48
            })
        );
        assert_eq!(
            dequant_mxfp4(&[0; 15], &[0; 1], 1, 32),
            Err(wrong("MXFP4 packed weight", 16, 15))
        );
        assert_eq!(
            dequant_mxfp4(&[0; 16], &[0; 2], 1, 32),
            Err(wrong("MXFP4 scale", 1, 2))
        );
        assert!(matches!(
            quant_mxfp4(&[0.0; 16], 1, 16),
            Err(QuantError::NonDivisibleCols { multiple: 32, .. })
        ));
        assert!(matches!(
            quant_nvfp4(&[0.0; 8], 1, 8),
            Err(QuantError::NonDivisibleCols { multiple: 16, .. })
        ));
        assert_eq!(
            dequant_nvfp4(&[0; 16], &[0; 1], 1.0, 1, 32),
            Err(wrong("NVFP4 block scale", 2, 1))
        );
        assert_eq!(
            dequant_fp8_block(&[], &[], usize::MAX, 2),
            Err(QuantError::TooLarge {
                rows: usize::MAX,
                cols: 2
            })
        );
        let message = wrong("FP8 weight", 6, 5).to_string();
        assert!(
            message.contains("expected 6") && message.contains("got 5"),
            "{message}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn random_shapes_round_trip_within_bounds(
            rows in 1usize..=300,
            col_blocks in 1usize..=10,
            seed in any::<u64>(),
            exponent in -20i32..=20,
        ) {
            let cols = col_blocks * 32;
            let w = sample(rows * cols, seed, 2f32.powi(exponent));
            check_fp8(&w, rows, cols);
            check_mxfp4(&w, rows, cols);
            check_nvfp4(&w, rows, cols);
        }

        #[test]
        fn arbitrary_buffers_never_panic(
            a in proptest::collection::vec(any::<u8>(), 0..600),
            b in proptest::collection::vec(any::<u8>(), 0..40),
            rows in 0usize..40,
            cols in 0usize..80,
            scale_2 in any::<f32>(),
        ) {
            let _ = dequant_fp8_block(&a, &b, rows, cols);
            let _ = dequant_mxfp4(&a, &b, rows, cols);
            let _ = dequant_nvfp4(&a, &b, scale_2, rows, cols);
            let floats: Vec<f32> = a.iter().map(|&x| f32::from(x) - 128.0).collect();
            let _ = quant_fp8_block(&floats, rows, cols);
            let _ = quant_mxfp4(&floats, rows, cols);
            let _ = quant_nvfp4(&floats, rows, cols);
            let _ = quant_nvfp4_activation(&floats, scale_2);
        }
    }
}
