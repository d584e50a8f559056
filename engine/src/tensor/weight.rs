//! A weight matrix in its stored form: bf16, FP8 e4m3 with 128x128 ue8m0 block scales, MXFP4
//! or NVFP4 bytes borrowed from the memory-mapped checkpoint (or owned f32 for small tensors
//! and tests). Products decode a chunk of a row at a time in registers (`rows.rs`) and give
//! bit for bit what the f32 expansion of the same weights gives.

mod blocks;

use std::{fmt, ops::Range, sync::Arc};

use super::{
    Matrix,
    rows::{Bf16Rows, F32Rows, Fp8BlockRows, Mxfp4Rows, Nvfp4Rows, RowSource},
    rows_times,
};
use crate::{
    formats::{E2M1_MAX, E4M3_MAX, e8m0_to_f32},
    quant::{FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, QuantError},
};

/// Bytes that live as long as any weight reading them: a range of a shared mapping (or of an
/// owned buffer), so a loaded model holds its checkpoint's pages, not copies of them.
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl SharedBytes {
    /// `range` of `owner`; None when the range is outside it.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Option<Self> {
        let total = (*owner).as_ref().len();
        (range.start <= range.end && range.end <= total).then(|| Self {
            owner,
            start: range.start,
            len: range.end - range.start,
        })
    }

    /// An owned buffer (tests, tools, synthesized weights).
    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            owner: Arc::new(bytes),
            start: 0,
            len,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }

    /// `range` of these bytes, sharing their owner; None outside them.
    pub fn slice(&self, range: Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= self.len).then(|| Self {
            owner: Arc::clone(&self.owner),
            start: self.start + range.start,
            len: range.end - range.start,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedBytes({} bytes at {})", self.len, self.start)
    }
}

/// How a [`Weight`]'s elements are stored.
#[derive(Debug, Clone)]
pub enum WeightForm {
    /// Owned f32, row-major.
    F32(Vec<f32>),
    /// bf16 bits, little-endian, row-major.
    Bf16(SharedBytes),
    /// e4m3fn codes, row-major, with the decoded ue8m0 scale of each 128x128 tile
    /// (`[ceil(rows/128), ceil(cols/128)]`, row-major).
    Fp8Block {
        codes: SharedBytes,
        scales: Vec<f32>,
    },
    /// Packed e2m1 (low nibble first) with one ue8m0 byte per 32 elements of a row.
    Mxfp4 {
        packed: SharedBytes,
        scales: SharedBytes,
    },
    /// Packed e2m1 with one e4m3 byte per 16 elements and the per-tensor `scale_2`.
    Nvfp4 {
        packed: SharedBytes,
        scales: SharedBytes,
        scale_2: f32,
    },
}

/// A `[rows, cols]` weight (`[out, in]` as in the checkpoint) in its stored form.
#[derive(Debug, Clone)]
pub struct Weight {
    pub rows: usize,
    pub cols: usize,
    form: WeightForm,
}

/// Calls `$body` with `$src` bound to the row source of `$w`'s form.
macro_rules! with_rows {
    ($w:expr, $src:ident => $body:expr) => {{
        let w = $w;
        let cols = w.cols;
        match &w.form {
            WeightForm::F32(data) => {
                let $src = F32Rows {
                    rows: |r: usize| &data[r * cols..(r + 1) * cols],
                    cols,
                };
                $body
            }
            WeightForm::Bf16(bytes) => {
                let $src = Bf16Rows {
                    bytes: bytes.as_slice(),
                    cols,
                };
                $body
            }
            WeightForm::Fp8Block { codes, scales } => {
                let $src = Fp8BlockRows {
                    codes: codes.as_slice(),
                    scales,
                    cols,
                };
                $body
            }
            WeightForm::Mxfp4 { packed, scales } => {
                let $src = Mxfp4Rows {
                    packed: packed.as_slice(),
                    scales: scales.as_slice(),
                    cols,
                };
                $body
            }
            WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => {
                let $src = Nvfp4Rows {
                    packed: packed.as_slice(),
                    scales: scales.as_slice(),
                    scale_2: *scale_2,
                    cols,
                };
                $body
            }
        }
    }};
}

fn expect_len(what: &'static str, expected: usize, actual: usize) -> Result<(), QuantError> {
    if expected == actual {
        Ok(())
    } else {
        Err(QuantError::WrongByteCount {
            what,
            expected,
            actual,
        })
    }
}

fn elements(rows: usize, cols: usize) -> Result<usize, QuantError> {
    rows.checked_mul(cols)
        .ok_or(QuantError::TooLarge { rows, cols })
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

impl Weight {
    /// Owned f32 data of length `rows * cols`.
    pub fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, QuantError> {
        let n = elements(rows, cols)?;
        if data.len() != n {
            return Err(QuantError::ShapeMismatch {
                what: "f32 weight",
                rows,
                cols,
                expected: n,
                actual: data.len(),
            });
        }
        Ok(Self {
            rows,
            cols,
            form: WeightForm::F32(data),
        })
    }

    /// bf16 bytes (`2 * rows * cols`).
    pub fn bf16(rows: usize, cols: usize, bytes: SharedBytes) -> Result<Self, QuantError> {
        expect_len("bf16 weight", 2 * elements(rows, cols)?, bytes.len())?;
        Ok(Self {
            rows,
            cols,
            form: WeightForm::Bf16(bytes),
        })
    }

    /// e4m3fn codes with ue8m0 tile scale bytes, as [`crate::quant::dequant_fp8_block`] reads.
    pub fn fp8_block(
        rows: usize,
        cols: usize,
        codes: SharedBytes,
        scale: &[u8],
    ) -> Result<Self, QuantError> {
        expect_len("FP8 weight", elements(rows, cols)?, codes.len())?;
        let tiles = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
        expect_len("FP8 block scale", tiles, scale.len())?;
        Ok(Self {
            rows,
            cols,
            form: WeightForm::Fp8Block {
                codes,
                scales: scale.iter().map(|&c| e8m0_to_f32(c)).collect(),
            },
        })
    }

    /// MXFP4 as [`crate::quant::dequant_mxfp4`] reads it.
    pub fn mxfp4(
        rows: usize,
        cols: usize,
        packed: SharedBytes,
        scales: SharedBytes,
    ) -> Result<Self, QuantError> {
        require_multiple("MXFP4", cols, MXFP4_BLOCK)?;
        let n = elements(rows, cols)?;
        expect_len("MXFP4 packed weight", n / 2, packed.len())?;
        expect_len("MXFP4 scale", n / MXFP4_BLOCK, scales.len())?;
        Ok(Self {
            rows,
            cols,
            form: WeightForm::Mxfp4 { packed, scales },
        })
    }

    /// NVFP4 as [`crate::quant::dequant_nvfp4`] reads it.
    pub fn nvfp4(
        rows: usize,
        cols: usize,
        packed: SharedBytes,
        scales: SharedBytes,
        scale_2: f32,
    ) -> Result<Self, QuantError> {
        require_multiple("NVFP4", cols, NVFP4_BLOCK)?;
        let n = elements(rows, cols)?;
        expect_len("NVFP4 packed weight", n / 2, packed.len())?;
        expect_len("NVFP4 block scale", n / NVFP4_BLOCK, scales.len())?;
        Ok(Self {
            rows,
            cols,
            form: WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            },
        })
    }

    pub fn form(&self) -> &WeightForm {
        &self.form
    }

    /// Bytes the weight occupies as stored (what a product reads from memory).
    pub fn stored_bytes(&self) -> usize {
        match &self.form {
            WeightForm::F32(d) => 4 * d.len(),
            WeightForm::Bf16(b) => b.len(),
            WeightForm::Fp8Block { codes, scales } => codes.len() + scales.len(),
            WeightForm::Mxfp4 { packed, scales } | WeightForm::Nvfp4 { packed, scales, .. } => {
                packed.len() + scales.len()
            }
        }
    }

    /// `self · x` as a new vector.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        self.rows_times(0, self.rows, &[x])
    }

    /// `self · x` for several vectors at once; each output equals the one-at-a-time result.
    pub fn apply_many<V: AsRef<[f32]> + Sync>(&self, xs: &[V]) -> Vec<Vec<f32>> {
        self.apply_rows_many(0, self.rows, xs)
    }

    /// `self · x` for several vectors at once into one buffer, vector-major (`out[v * rows +
    /// r]`): [`Self::apply_many`] without a vector per result.
    pub fn apply_many_flat(&self, xs: &[&[f32]]) -> Vec<f32> {
        self.rows_times(0, self.rows, xs)
    }

    /// Rows `r0..r0+n` of `self` times each of `xs` (grouped projections).
    pub fn apply_rows_many<V: AsRef<[f32]> + Sync>(
        &self,
        r0: usize,
        n: usize,
        xs: &[V],
    ) -> Vec<Vec<f32>> {
        assert!(
            r0 + n <= self.rows,
            "rows {r0}..{} of {}",
            r0 + n,
            self.rows
        );
        let refs: Vec<&[f32]> = xs.iter().map(AsRef::as_ref).collect();
        let flat = self.rows_times(r0, n, &refs);
        if n == 0 {
            return vec![Vec::new(); xs.len()];
        }
        flat.chunks_exact(n).map(<[f32]>::to_vec).collect()
    }

    fn rows_times(&self, r0: usize, n: usize, xs: &[&[f32]]) -> Vec<f32> {
        with_rows!(self, src => rows_times(&src, r0, n, xs))
    }

    /// Columns `c0..c0 + n` of every row times each of `xs` (`n` values each): the product of
    /// part of each row, with the engine's dot product over those columns. `c0` must be a
    /// multiple of 8.
    pub fn apply_cols_many<V: AsRef<[f32]> + Sync>(
        &self,
        c0: usize,
        n: usize,
        xs: &[V],
    ) -> Vec<Vec<f32>> {
        let refs: Vec<&[f32]> = xs.iter().map(AsRef::as_ref).collect();
        let rows = self.rows;
        let flat = with_rows!(self, src => {
            let window = super::rows::ColumnWindow::new(&src, c0, n).unwrap_or_else(|| {
                panic!("columns {c0}..{} of {} (from a multiple of 8)", c0 + n, self.cols)
            });
            rows_times(&window, 0, rows, &refs)
        });
        if rows == 0 {
            return vec![Vec::new(); xs.len()];
        }
        flat.chunks_exact(rows).map(<[f32]>::to_vec).collect()
    }

    /// Row `r` decoded to f32 (an embedding lookup).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; self.cols];
        with_rows!(self, src => src.decode_row(r, &mut out));
        out
    }

    /// Every element decoded to f32, row-major (tests and tools; a model never needs it).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols > 0 {
            with_rows!(self, src => {
                for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
                    src.decode_row(r, row);
                }
            });
        }
        out
    }

    /// The decoded matrix (tests and tools).
    pub fn to_matrix(&self) -> Matrix {
        Matrix::new(self.rows, self.cols, self.to_f32())
    }

    /// The row-major index of the first element that decodes to a non-finite value, if any.
    /// Blocks whose largest possible value is finite are skipped without decoding, so this
    /// reads only the codes (and a block's elements only when its scale is extreme).
    pub fn first_non_finite(&self) -> Option<usize> {
        match &self.form {
            WeightForm::F32(d) => d.iter().position(|v| !v.is_finite()),
            WeightForm::Bf16(b) => b
                .as_slice()
                .chunks_exact(2)
                .position(|p| u16::from_le_bytes([p[0], p[1]]) & 0x7F80 == 0x7F80),
            WeightForm::Fp8Block { codes, scales } => {
                let tiles = self.cols.div_ceil(FP8_BLOCK);
                let extreme = scales.iter().any(|s| !(s * E4M3_MAX).is_finite());
                let nan_code = codes.as_slice().iter().any(|&c| c & 0x7F == 0x7F);
                if !extreme && !nan_code {
                    return None;
                }
                codes.as_slice().iter().enumerate().find_map(|(i, &c)| {
                    let (r, col) = (i / self.cols, i % self.cols);
                    let s = scales[(r / FP8_BLOCK) * tiles + col / FP8_BLOCK];
                    (!(crate::formats::e4m3_to_f32(c) * s).is_finite()).then_some(i)
                })
            }
            WeightForm::Mxfp4 { scales, .. } => {
                let first = scales
                    .as_slice()
                    .iter()
                    .position(|&c| !(E2M1_MAX * e8m0_to_f32(c)).is_finite())?;
                self.first_in_blocks(first, MXFP4_BLOCK)
            }
            WeightForm::Nvfp4 {
                scales, scale_2, ..
            } => {
                let first = scales.as_slice().iter().position(|&c| {
                    !(E2M1_MAX * (crate::formats::e4m3_to_f32(c) * scale_2)).is_finite()
                })?;
                self.first_in_blocks(first, NVFP4_BLOCK)
            }
        }
    }

    /// The first non-finite element from block `first` on (FP4 forms, `block` elements each).
    fn first_in_blocks(&self, first: usize, block: usize) -> Option<usize> {
        let decoded = self.to_f32();
        decoded[first * block..]
            .iter()
            .position(|v| !v.is_finite())
            .map(|i| i + first * block)
    }
}

impl From<Matrix> for Weight {
    fn from(m: Matrix) -> Self {
        Self {
            rows: m.rows,
            cols: m.cols,
            form: WeightForm::F32(m.data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{quant, synth::Rng};

    pub(super) fn bytes(rng: &mut Rng, n: usize, valid: impl Fn(u8) -> bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let b = rng.next_u64() as u8;
            if valid(b) {
                out.push(b);
            }
        }
        out
    }

    pub(super) fn vectors(rng: &mut Rng, count: usize, n: usize) -> Vec<Vec<f32>> {
        (0..count)
            .map(|_| (0..n).map(|_| rng.normal()).collect())
            .collect()
    }

    /// Every product shape of `w` (one vector through the register decoders, many through the
    /// decoded-block path, row slices, large enough to go parallel) equals the product of the
    /// f32 expansion `expanded` bit for bit, and the weight decodes to exactly `expanded`.
    fn check_against_expansion(w: &Weight, expanded: &[f32], rng: &mut Rng) {
        let decoded = w.to_f32();
        assert_eq!(decoded.len(), expanded.len());
        for (i, (a, b)) in decoded.iter().zip(expanded).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "element {i} of {}x{}",
                w.rows,
                w.cols
            );
        }
        if w.rows > 0 {
            let last = w.rows - 1;
            assert_eq!(w.row_f32(last), expanded[last * w.cols..].to_vec());
        }
        let m = Matrix::new(w.rows, w.cols, expanded.to_vec());
        for count in [1usize, 2, 3, 4, 7] {
            let xs = vectors(rng, count, w.cols);
            let got = w.apply_many(&xs);
            let want = m.apply_many(&xs);
            for (g, e) in got.iter().flatten().zip(want.iter().flatten()) {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{count} vectors, {}x{}",
                    w.rows,
                    w.cols
                );
            }
            if w.rows > 2 {
                let part = w.apply_rows_many(1, w.rows - 2, &xs);
                let full_part = m.apply_rows_many(1, w.rows - 2, &xs);
                assert_eq!(part, full_part);
            }
            // A window of columns from 8, ending 3 short (a tail): the product of the
            // expansion's same columns.
            if w.cols >= 16 {
                let (c0, n) = (8, w.cols - 11);
                let window: Vec<f32> = expanded
                    .chunks_exact(w.cols)
                    .flat_map(|row| row[c0..c0 + n].iter().copied())
                    .collect();
                let xs = vectors(rng, count, n);
                let got = w.apply_cols_many(c0, n, &xs);
                let want = Matrix::new(w.rows, n, window).apply_many(&xs);
                for (g, e) in got.iter().flatten().zip(want.iter().flatten()) {
                    assert_eq!(g.to_bits(), e.to_bits(), "columns {c0}+{n} of {}", w.cols);
                }
            }
        }
        assert_eq!(
            w.first_non_finite(),
            expanded.iter().position(|v| !v.is_finite())
        );
    }

    #[test]
    fn bf16_weights_equal_their_expansion() {
        let mut rng = Rng::for_tensor(1, "bf16");
        for (rows, cols) in [
            (1, 1),
            (3, 7),
            (5, 8),
            (9, 13),
            (130, 67),
            (64, 1100),
            (1, 0),
        ] {
            let raw = bytes(&mut rng, 2 * rows * cols, |_| true);
            // Keep the values finite and moderate: random exponents near 1.0.
            let raw: Vec<u8> = raw
                .chunks_exact(2)
                .flat_map(|p| {
                    let bits = (u16::from_le_bytes([p[0], p[1]]) & 0x807F) | 0x3F00;
                    bits.to_le_bytes()
                })
                .collect();
            let expanded = crate::weights::bf16_bytes_to_f32(&raw);
            let w = Weight::bf16(rows, cols, SharedBytes::owned(raw)).unwrap();
            check_against_expansion(&w, &expanded, &mut rng);
        }
    }

    #[test]
    fn fp8_block_weights_equal_their_expansion() {
        let mut rng = Rng::for_tensor(1, "fp8");
        for (rows, cols) in [(1, 8), (3, 7), (129, 130), (200, 257), (2, 1000)] {
            let codes = bytes(&mut rng, rows * cols, |c| c & 0x7F != 0x7F);
            let tiles = rows.div_ceil(128) * cols.div_ceil(128);
            let scale = bytes(&mut rng, tiles, |c| (100..140).contains(&c));
            let expanded = quant::dequant_fp8_block(&codes, &scale, rows, cols).unwrap();
            let w = Weight::fp8_block(rows, cols, SharedBytes::owned(codes), &scale).unwrap();
            check_against_expansion(&w, &expanded, &mut rng);
        }
    }

    #[test]
    fn mxfp4_weights_equal_their_expansion() {
        let mut rng = Rng::for_tensor(1, "mxfp4");
        for (rows, cols) in [(1, 32), (3, 96), (130, 64), (5, 1024)] {
            let packed = bytes(&mut rng, rows * cols / 2, |_| true);
            let scale = bytes(&mut rng, rows * cols / 32, |c| (110..140).contains(&c));
            let expanded = quant::dequant_mxfp4(&packed, &scale, rows, cols).unwrap();
            let w = Weight::mxfp4(
                rows,
                cols,
                SharedBytes::owned(packed),
                SharedBytes::owned(scale),
            )
            .unwrap();
            check_against_expansion(&w, &expanded, &mut rng);
        }
    }

    #[test]
    fn nvfp4_weights_equal_their_expansion() {
        let mut rng = Rng::for_tensor(1, "nvfp4");
        for (rows, cols, scale_2) in [
            (1, 16, 1.0),
            (3, 48, 0.013),
            (130, 64, 3.7e-3),
            (5, 1040, 0.5),
        ] {
            let packed = bytes(&mut rng, rows * cols / 2, |_| true);
            let scale = bytes(&mut rng, rows * cols / 16, |c| c & 0x7F != 0x7F);
            let expanded = quant::dequant_nvfp4(&packed, &scale, scale_2, rows, cols).unwrap();
            let w = Weight::nvfp4(
                rows,
                cols,
                SharedBytes::owned(packed),
                SharedBytes::owned(scale),
                scale_2,
            )
            .unwrap();
            check_against_expansion(&w, &expanded, &mut rng);
        }
    }

    /// Every element code next to every scale code of each format decodes to the expansion's
    /// value (and the non-finite ones are found where the expansion has them).
    #[test]
    fn every_code_of_every_format_decodes_as_expanded() {
        let mut rng = Rng::for_tensor(2, "codes");
        // FP8: 256 codes per row, one row per 128-row tile so each row meets another scale.
        let (rows, cols) = (256, 256);
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i % 256) as u8).collect();
        let scale: Vec<u8> = vec![0x01, 0x7F, 0x80, 0xFE];
        let expanded = quant::dequant_fp8_block(&codes, &scale, rows, cols).unwrap();
        let w = Weight::fp8_block(rows, cols, SharedBytes::owned(codes), &scale).unwrap();
        let decoded = w.to_f32();
        for (i, (a, b)) in decoded.iter().zip(&expanded).enumerate() {
            assert!(crate::tensor::same_value(*a, *b), "fp8 {i}");
        }
        assert_eq!(
            w.first_non_finite(),
            expanded.iter().position(|v| !v.is_finite())
        );
        // MXFP4: every scale code (rows) times all 16 codes twice (32 elements).
        let packed: Vec<u8> = (0..256 * 16)
            .map(|i| (((2 * i) % 16) | (((2 * i + 1) % 16) << 4)) as u8)
            .collect();
        let scale: Vec<u8> = (0..=255).collect();
        let expanded = quant::dequant_mxfp4(&packed, &scale, 256, 32).unwrap();
        let w = Weight::mxfp4(
            256,
            32,
            SharedBytes::owned(packed.clone()),
            SharedBytes::owned(scale.clone()),
        )
        .unwrap();
        let decoded = w.to_f32();
        for (i, (a, b)) in decoded.iter().zip(&expanded).enumerate() {
            assert!(crate::tensor::same_value(*a, *b), "mxfp4 {i}");
        }
        assert_eq!(
            w.first_non_finite(),
            expanded.iter().position(|v| !v.is_finite())
        );
        // The products on rows with finite scales still match (register path at scale 2^-127).
        let finite = Weight::mxfp4(
            128,
            32,
            SharedBytes::owned(packed[..128 * 16].to_vec()),
            SharedBytes::owned(scale[..128].to_vec()),
        )
        .unwrap();
        check_against_expansion(&finite, &expanded[..128 * 32], &mut rng);
        // NVFP4: every block-scale code, two scale_2 values (one overflowing at the top codes).
        let packed: Vec<u8> = (0..256 * 8)
            .map(|i| (((2 * i) % 16) | (((2 * i + 1) % 16) << 4)) as u8)
            .collect();
        for scale_2 in [1.0f32, 1e37] {
            let expanded = quant::dequant_nvfp4(&packed, &scale, scale_2, 256, 16).unwrap();
            let w = Weight::nvfp4(
                256,
                16,
                SharedBytes::owned(packed.clone()),
                SharedBytes::owned(scale.clone()),
                scale_2,
            )
            .unwrap();
            let decoded = w.to_f32();
            for (i, (a, b)) in decoded.iter().zip(&expanded).enumerate() {
                assert!(crate::tensor::same_value(*a, *b), "nvfp4 {i}");
            }
            assert_eq!(
                w.first_non_finite(),
                expanded.iter().position(|v| !v.is_finite())
            );
        }
    }

    #[test]
    fn shapes_and_lengths_are_checked() {
        let b = |n: usize| SharedBytes::owned(vec![0; n]);
        assert!(Weight::bf16(2, 3, b(11)).is_err());
        assert!(Weight::fp8_block(2, 3, b(6), &[]).is_err());
        assert!(Weight::mxfp4(1, 48, b(24), b(1)).is_err());
        assert!(Weight::nvfp4(1, 32, b(16), b(1), 1.0).is_err());
        assert!(Weight::f32(2, 2, vec![0.0; 3]).is_err());
        assert!(SharedBytes::new(std::sync::Arc::new(vec![0u8; 4]), 2..5).is_none());
    }

    #[test]
    fn a_bf16_nan_or_infinity_is_found() {
        let mut raw = vec![0u8; 2 * 12];
        raw[2 * 7..2 * 7 + 2].copy_from_slice(&0x7F80u16.to_le_bytes());
        let w = Weight::bf16(3, 4, SharedBytes::owned(raw)).unwrap();
        assert_eq!(w.first_non_finite(), Some(7));
    }
}
