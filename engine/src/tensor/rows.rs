//! Weight rows as the dot-product kernels read them: eight decoded f32 values at a time, from
//! f32 slices or straight from a checkpoint's stored bytes (bf16, FP8 e4m3 with 128x128 ue8m0
//! block scales, MXFP4, NVFP4).
//!
//! Every decoder yields exactly the f32 value the load-time expansion in [`crate::quant`]
//! produces for that element (the same scale product, computed with the same single f32
//! multiply), so a product over stored weights is bit-identical to the same product over the
//! expanded matrix: the accumulation order lives in `gemm.rs`, once, for every source.
//!
//! On x86-64 the kernels call the `*_avx2` decoders, which turn eight stored elements into one
//! 256-bit register: bf16 by a 16-bit shift, e4m3 by placing its bits in an f16 (same
//! subnormal rule, a 2^8 smaller value) and converting with F16C, e2m1 by a lane permute of
//! the eight magnitudes and the sign bit moved to bit 31.

#![allow(
    clippy::inline_always,
    reason = "the decoders must inline into the AVX2 kernels to be compiled with their features"
)]
#![allow(
    clippy::cast_ptr_alignment,
    reason = "the SSE/AVX loads used on these pointers are the unaligned ones"
)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256;

use crate::formats::{E2M1, bf16_to_f32, e4m3_to_f32};

/// Values per decoded chunk (one 256-bit register of f32).
pub const LANES: usize = 8;

/// Rows a kernel can read. `row` resolves a row once per block; the chunk functions then read
/// it without further lookups.
pub trait RowSource: Sync {
    /// One resolved row.
    type Row<'a>: Copy
    where
        Self: 'a;

    /// Row `r` (`r < rows`). Panics on a row out of range.
    fn row(&self, r: usize) -> Self::Row<'_>;

    /// Elements per row.
    fn cols(&self) -> usize;

    /// Whether a row costs real work to decode, so that a block of rows read against many
    /// vectors is better decoded once into f32 first.
    const DECODES: bool;

    /// Elements `at..at + 8` of `row` (`at + 8 <= cols`).
    fn chunk(row: Self::Row<'_>, at: usize) -> [f32; LANES];

    /// Element `c` of `row` (`c < cols`).
    fn get(row: Self::Row<'_>, c: usize) -> f32;

    /// [`Self::chunk`] in a register.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C, and `at + 8 <= cols`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn chunk_avx2(row: Self::Row<'_>, at: usize) -> __m256;

    /// Row `r` decoded into `out` (`cols` values).
    fn decode_row(&self, r: usize, out: &mut [f32]) {
        let row = self.row(r);
        for (c, v) in out.iter_mut().enumerate() {
            *v = Self::get(row, c);
        }
    }
}

/// Columns `start..start + cols` of every row of `src`: a product with part of each row (a
/// rank's slice of an expert's down projection). `start` is a multiple of [`LANES`], so every
/// chunk lies where the source's own chunks lie (inside one FP8 tile, one FP4 scale block).
#[derive(Debug, Clone, Copy)]
pub struct ColumnWindow<'s, S> {
    pub src: &'s S,
    pub start: usize,
    pub cols: usize,
}

impl<'s, S: RowSource> ColumnWindow<'s, S> {
    /// The window, or `None` when it leaves the rows or `start` is not a multiple of 8.
    pub fn new(src: &'s S, start: usize, cols: usize) -> Option<Self> {
        (start.is_multiple_of(LANES) && start + cols <= src.cols()).then_some(Self {
            src,
            start,
            cols,
        })
    }
}

impl<'s, S: RowSource> RowSource for ColumnWindow<'s, S> {
    type Row<'a>
        = (S::Row<'s>, usize)
    where
        Self: 'a;
    const DECODES: bool = S::DECODES;

    fn row(&self, r: usize) -> (S::Row<'s>, usize) {
        (self.src.row(r), self.start)
    }

    fn cols(&self) -> usize {
        self.cols
    }

    #[inline(always)]
    fn chunk((row, start): (S::Row<'s>, usize), at: usize) -> [f32; LANES] {
        S::chunk(row, start + at)
    }

    #[inline(always)]
    fn get((row, start): (S::Row<'s>, usize), c: usize) -> f32 {
        S::get(row, start + c)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_avx2((row, start): (S::Row<'s>, usize), at: usize) -> __m256 {
        // SAFETY: at + 8 <= cols (caller), so start + at + 8 <= the source's columns (`new`);
        // start + at is a multiple of 8 as the source's chunks are; the features (caller).
        unsafe { S::chunk_avx2(row, start + at) }
    }
}

/// f32 rows given by a function (activations, expanded small weights).
#[derive(Debug, Clone, Copy)]
pub struct F32Rows<F> {
    pub rows: F,
    pub cols: usize,
}

impl<'s, F: Fn(usize) -> &'s [f32] + Sync> RowSource for F32Rows<F> {
    type Row<'a>
        = &'s [f32]
    where
        Self: 'a;
    const DECODES: bool = false;

    fn row(&self, r: usize) -> &'s [f32] {
        let row = (self.rows)(r);
        assert_eq!(row.len(), self.cols, "row {r} length");
        row
    }

    fn cols(&self) -> usize {
        self.cols
    }

    #[inline(always)]
    fn chunk(row: &'s [f32], at: usize) -> [f32; LANES] {
        let mut out = [0.0; LANES];
        out.copy_from_slice(&row[at..at + LANES]);
        out
    }

    #[inline(always)]
    fn get(row: &'s [f32], c: usize) -> f32 {
        row[c]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_avx2(row: &'s [f32], at: usize) -> __m256 {
        debug_assert!(at + LANES <= row.len());
        // SAFETY: at + 8 <= row.len() (caller); unaligned load; AVX is available (caller).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(row.as_ptr().add(at)) }
    }

    fn decode_row(&self, r: usize, out: &mut [f32]) {
        out.copy_from_slice(self.row(r));
    }
}

/// bf16 rows, little-endian, row-major.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Rows<'s> {
    pub bytes: &'s [u8],
    pub cols: usize,
}

impl<'s> RowSource for Bf16Rows<'s> {
    type Row<'a>
        = &'s [u8]
    where
        Self: 'a;
    const DECODES: bool = true;

    fn row(&self, r: usize) -> &'s [u8] {
        &self.bytes[r * self.cols * 2..(r + 1) * self.cols * 2]
    }

    fn cols(&self) -> usize {
        self.cols
    }

    #[inline(always)]
    fn chunk(row: &'s [u8], at: usize) -> [f32; LANES] {
        std::array::from_fn(|k| Self::get(row, at + k))
    }

    #[inline(always)]
    fn get(row: &'s [u8], c: usize) -> f32 {
        bf16_to_f32(u16::from_le_bytes([row[2 * c], row[2 * c + 1]]))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_avx2(row: &'s [u8], at: usize) -> __m256 {
        use std::arch::x86_64::{
            __m128i, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_slli_epi32,
        };
        debug_assert!(2 * (at + LANES) <= row.len());
        // SAFETY: 16 bytes from 2 * at are inside the row (caller); unaligned load; AVX2.
        unsafe {
            let bits = _mm_loadu_si128(row.as_ptr().add(2 * at).cast::<__m128i>());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
        }
    }
}

/// FP8 e4m3fn rows with one f32 scale (the decoded ue8m0 code) per 128x128 tile.
#[derive(Debug, Clone, Copy)]
pub struct Fp8BlockRows<'s> {
    pub codes: &'s [u8],
    /// `[ceil(rows/128), ceil(cols/128)]` decoded scales.
    pub scales: &'s [f32],
    pub cols: usize,
}

/// An FP8 row: its codes and the scales of its row of tiles.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Row<'s> {
    codes: &'s [u8],
    scales: &'s [f32],
}

impl<'s> RowSource for Fp8BlockRows<'s> {
    type Row<'a>
        = Fp8Row<'s>
    where
        Self: 'a;
    const DECODES: bool = true;

    fn row(&self, r: usize) -> Fp8Row<'s> {
        let tiles = self.cols.div_ceil(128);
        Fp8Row {
            codes: &self.codes[r * self.cols..(r + 1) * self.cols],
            scales: &self.scales[(r / 128) * tiles..(r / 128 + 1) * tiles],
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    #[inline(always)]
    fn chunk(row: Fp8Row<'s>, at: usize) -> [f32; LANES] {
        std::array::from_fn(|k| Self::get(row, at + k))
    }

    #[inline(always)]
    fn get(row: Fp8Row<'s>, c: usize) -> f32 {
        e4m3_to_f32(row.codes[c]) * row.scales[c / 128]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_avx2(row: Fp8Row<'s>, at: usize) -> __m256 {
        use std::arch::x86_64::{_mm256_mul_ps, _mm256_set1_ps};
        debug_assert!(at + LANES <= row.codes.len());
        // SAFETY: 8 codes from `at` are inside the row (caller); F16C and AVX (caller). A
        // chunk never straddles a tile: 128 is a multiple of 8 and `at` is too.
        unsafe {
            let value = e4m3x8_avx2(row.codes.as_ptr().add(at));
            _mm256_mul_ps(value, _mm256_set1_ps(*row.scales.get_unchecked(at / 128)))
        }
    }
}

/// Eight e4m3fn codes to f32 (not valid for the NaN codes, which loading refuses).
///
/// The code's magnitude bits shifted left by 7 are an f16 with the same 3-bit mantissa at the
/// top and the 4-bit exponent in the low bits of f16's five: its value is exactly the e4m3
/// value times 2^-8 for normals and subnormals alike, and F16C widens it exactly.
///
/// # Safety
/// `codes` points at 8 readable bytes; the CPU supports AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn e4m3x8_avx2(codes: *const u8) -> __m256 {
    use std::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_cvtepu8_epi16, _mm_loadl_epi64, _mm_or_si128, _mm_set1_epi16,
        _mm_slli_epi16, _mm256_cvtph_ps, _mm256_mul_ps, _mm256_set1_ps,
    };
    // SAFETY: 8 readable bytes (caller); SSE4.1/F16C/AVX are implied by the caller's features.
    unsafe {
        let bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(codes.cast::<__m128i>()));
        let magnitude = _mm_and_si128(_mm_slli_epi16::<7>(bytes), _mm_set1_epi16(0x3F80));
        let sign = _mm_and_si128(_mm_slli_epi16::<8>(bytes), _mm_set1_epi16(-0x8000));
        let half = _mm_or_si128(magnitude, sign);
        _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0))
    }
}

/// Eight packed e2m1 codes (four bytes, low nibble first) to f32.
///
/// # Safety
/// `packed` points at 4 readable bytes; the CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn e2m1x8_avx2(packed: *const u8) -> __m256 {
    use std::arch::x86_64::{
        _mm256_and_si256, _mm256_castps_si256, _mm256_castsi256_ps, _mm256_loadu_ps,
        _mm256_or_si256, _mm256_permutevar8x32_ps, _mm256_set1_epi32, _mm256_setr_epi32,
        _mm256_slli_epi32, _mm256_srlv_epi32,
    };
    // SAFETY: 4 readable bytes (caller); AVX2 (caller). E2M1's first eight entries are the
    // non-negative magnitudes by code.
    unsafe {
        let word = i32::from_le_bytes(std::ptr::read_unaligned(packed.cast::<[u8; 4]>()));
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let codes = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts),
            _mm256_set1_epi32(0xF),
        );
        let magnitudes = _mm256_loadu_ps(E2M1.as_ptr());
        let magnitude = _mm256_permutevar8x32_ps(magnitudes, codes);
        let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(codes, _mm256_set1_epi32(8)));
        _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(magnitude), sign))
    }
}

/// The f32 value of one ue8m0 scale byte, by code.
static E8M0: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = match code {
            0xFF => f32::NAN,
            0 => f32::from_bits(0x0040_0000),
            _ => f32::from_bits((code as u32) << 23),
        };
        code += 1;
    }
    table
};

/// MXFP4 rows: packed e2m1 (low nibble first) with one ue8m0 scale per 32 elements.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Rows<'s> {
    pub packed: &'s [u8],
    pub scales: &'s [u8],
    /// A multiple of 32.
    pub cols: usize,
}

/// A packed FP4 row: its bytes and its block scale bytes.
#[derive(Debug, Clone, Copy)]
pub struct Fp4Row<'s> {
    packed: &'s [u8],
    scales: &'s [u8],
    /// NVFP4's per-tensor scale (unused for MXFP4).
    scale_2: f32,
}

impl<'s> RowSource for Mxfp4Rows<'s> {
    type Row<'a>
        = Fp4Row<'s>
    where
        Self: 'a;
    const DECODES: bool = true;

    fn row(&self, r: usize) -> Fp4Row<'s> {
        Fp4Row {
            packed: &self.packed[r * self.cols / 2..(r + 1) * self.cols / 2],
            scales: &self.scales[r * self.cols / 32..(r + 1) * self.cols / 32],
            scale_2: 1.0,
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    #[inline(always)]
    fn chunk(row: Fp4Row<'s>, at: usize) -> [f32; LANES] {
        std::array::from_fn(|k| Self::get(row, at + k))
    }

    #[inline(always)]
    fn get(row: Fp4Row<'s>, c: usize) -> f32 {
        E2M1[usize::from((row.packed[c / 2] >> (4 * (c % 2))) & 0xF)]
            * E8M0[usize::from(row.scales[c / 32])]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_avx2(row: Fp4Row<'s>, at: usize) -> __m256 {
        use std::arch::x86_64::{_mm256_mul_ps, _mm256_set1_ps};
        debug_assert!(at + LANES <= 2 * row.packed.len());
        // SAFETY: the 4 bytes from at / 2 and the scale at / 32 are inside the row (caller;
        // cols is a multiple of 32 so a chunk never straddles a block); AVX2 (caller).
        unsafe {
            let scale = *E8M0.get_unchecked(usize::from(*row.scales.get_unchecked(at / 32)));
            _mm256_mul_ps(
                e2m1x8_avx2(row.packed.as_ptr().add(at / 2)),
                _mm256_set1_ps(scale),
            )
        }
    }
}

/// NVFP4 rows: packed e2m1 with one e4m3 scale per 16 elements and an f32 `scale_2` on top;
/// element value `e2m1 * (e4m3(block scale) * scale_2)`, the product in that order.
#[derive(Debug, Clone, Copy)]
pub struct Nvfp4Rows<'s> {
    pub packed: &'s [u8],
    pub scales: &'s [u8],
    pub scale_2: f32,
    /// A multiple of 16.
    pub cols: usize,
}

/// The f32 value of one e4m3fn code, by code.
static E4M3: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let c = code as u32;
        let (exp, mant) = ((c >> 3) & 0xF, c & 7);
        let magnitude = if c & 0x7F == 0x7F {
            f32::NAN
        } else if exp == 0 {
            // Subnormal: m * 2^-9, exact.
            mant as f32 * f32::from_bits(0x3B00_0000)
        } else {
            f32::from_bits(((exp + 120) << 23) | (mant << 20))
        };
        table[code] = if c & 0x80 != 0 { -magnitude } else { magnitude };
        code += 1;
    }
    table
};

impl<'s> RowSource for Nvfp4Rows<'s> {
    type Row<'a>
        = Fp4Row<'s>
    where
        Self: 'a;
    const DECODES: bool = true;

    fn row(&self, r: usize) -> Fp4Row<'s> {
        Fp4Row {
            packed: &self.packed[r * self.cols / 2..(r + 1) * self.cols / 2],
            scales: &self.scales[r * self.cols / 16..(r + 1) * self.cols / 16],
            scale_2: self.scale_2,
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    #[inline(always)]
    fn chunk(row: Fp4Row<'s>, at: usize) -> [f32; LANES] {
        std::array::from_fn(|k| Self::get(row, at + k))
    }

    #[inline(always)]
    fn get(row: Fp4Row<'s>, c: usize) -> f32 {
        let s = E4M3[usize::from(row.scales[c / 16])] * row.scale_2;
        E2M1[usize::from((row.packed[c / 2] >> (4 * (c % 2))) & 0xF)] * s
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn chunk_avx2(row: Fp4Row<'s>, at: usize) -> __m256 {
        use std::arch::x86_64::{_mm256_mul_ps, _mm256_set1_ps};
        debug_assert!(at + LANES <= 2 * row.packed.len());
        // SAFETY: as for MXFP4, with 16-element blocks.
        unsafe {
            let s =
                *E4M3.get_unchecked(usize::from(*row.scales.get_unchecked(at / 16))) * row.scale_2;
            _mm256_mul_ps(
                e2m1x8_avx2(row.packed.as_ptr().add(at / 2)),
                _mm256_set1_ps(s),
            )
        }
    }
}

/// The scalar definitions the tables must equal (checked by tests for every code).
pub fn e4m3_table(code: u8) -> f32 {
    E4M3[usize::from(code)]
}

/// See [`e4m3_table`].
pub fn e8m0_table(code: u8) -> f32 {
    E8M0[usize::from(code)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{e2m1_to_f32, e8m0_to_f32};

    use crate::tensor::same_value as same;

    #[test]
    fn tables_equal_the_scalar_definitions_for_every_code() {
        for code in 0..=255u8 {
            assert!(same(e4m3_table(code), e4m3_to_f32(code)), "e4m3 {code:#x}");
            assert!(same(e8m0_table(code), e8m0_to_f32(code)), "e8m0 {code:#x}");
        }
        for code in 0..16u8 {
            assert!(same(E2M1[usize::from(code)], e2m1_to_f32(code)));
        }
    }

    /// Every e4m3 code (except the NaN codes) through the F16C path, at every lane, equals
    /// the scalar definition; likewise every e2m1 code at every lane and nibble, and every
    /// bf16 bit pattern.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn register_decoders_equal_the_scalar_ones_for_every_code() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return;
        }
        let lanes = |v: __m256| {
            let mut out = [0.0f32; 8];
            // SAFETY: 8 floats; AVX present (checked above).
            unsafe { std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), v) };
            out
        };
        for code in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            for lane in 0..8 {
                let mut codes = [0x38u8; 8];
                codes[lane] = code;
                // SAFETY: 8 bytes; features checked above.
                let got = lanes(unsafe { e4m3x8_avx2(codes.as_ptr()) });
                assert_eq!(
                    got[lane].to_bits(),
                    e4m3_to_f32(code).to_bits(),
                    "{code:#x}"
                );
            }
        }
        for code in 0..16u8 {
            for lane in 0..8 {
                let mut nibbles = [0u8; 8];
                nibbles[lane] = code;
                let packed: Vec<u8> = nibbles.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
                // SAFETY: 4 bytes; features checked above.
                let got = lanes(unsafe { e2m1x8_avx2(packed.as_ptr()) });
                assert_eq!(got[lane].to_bits(), e2m1_to_f32(code).to_bits(), "{code}");
            }
        }
        for bits in 0..=u16::MAX {
            let mut row = [0u8; 16];
            row[6..8].copy_from_slice(&bits.to_le_bytes());
            // SAFETY: 16 bytes; features checked above.
            let got = lanes(unsafe { Bf16Rows::chunk_avx2(&row, 0) });
            assert!(same(got[3], bf16_to_f32(bits)), "{bits:#x}");
        }
    }
}
