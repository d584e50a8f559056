//! Blocks of a [`Weight`] as weights of their own, stored and so computed exactly as in the
//! whole weight: a tensor-parallel rank's rows of a projection, an expert-sliced rank's rows
//! of `w1`/`w3` and columns of `w2` (what a device holds of them).

use std::ops::Range;

use super::{SharedBytes, Weight, WeightForm};
use crate::quant::{FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK};

impl Weight {
    /// Rows `rows` of this weight as a weight of their own whose every row is stored, and so
    /// computes, exactly as here; None where the form cannot cut there (FP8 blocks share a
    /// scale across 128 rows, so a cut must fall on a block's edge or the last row; the FP4
    /// forms' scales are per row, so they cut anywhere).
    pub fn row_block(&self, rows: Range<usize>) -> Option<Self> {
        if rows.start >= rows.end || rows.end > self.rows {
            return None;
        }
        let (n, cols) = (rows.end - rows.start, self.cols);
        let per_row = |bytes: &SharedBytes, row_bytes: usize| {
            bytes.slice(rows.start * row_bytes..rows.end * row_bytes)
        };
        let form = match &self.form {
            WeightForm::F32(v) => WeightForm::F32(v[rows.start * cols..rows.end * cols].to_vec()),
            WeightForm::Bf16(b) => WeightForm::Bf16(per_row(b, 2 * cols)?),
            WeightForm::Fp8Block { codes, scales } => {
                let edge = |r: usize| r.is_multiple_of(FP8_BLOCK) || r == self.rows;
                if !edge(rows.start) || !edge(rows.end) {
                    return None;
                }
                let tiles = cols.div_ceil(FP8_BLOCK);
                let (t0, t1) = (rows.start / FP8_BLOCK, rows.end.div_ceil(FP8_BLOCK));
                WeightForm::Fp8Block {
                    codes: per_row(codes, cols)?,
                    scales: scales.get(t0 * tiles..t1 * tiles)?.to_vec(),
                }
            }
            WeightForm::Mxfp4 { packed, scales } => WeightForm::Mxfp4 {
                packed: per_row(packed, cols / 2)?,
                scales: per_row(scales, cols / MXFP4_BLOCK)?,
            },
            WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => WeightForm::Nvfp4 {
                packed: per_row(packed, cols / 2)?,
                scales: per_row(scales, cols / NVFP4_BLOCK)?,
                scale_2: *scale_2,
            },
        };
        Some(Self {
            rows: n,
            cols,
            form,
        })
    }

    /// Columns `cols` of every row as a weight of its own (a copy: the columns are not
    /// contiguous), every value stored as here; its products are this weight's products over
    /// those columns ([`Self::apply_cols_many`]) bit for bit. None where the form cannot cut
    /// there: a cut must fall on a scale block's edge (FP8 128, MXFP4 32, NVFP4 16 columns)
    /// or the last column.
    pub fn col_block(&self, cols: Range<usize>) -> Option<Self> {
        if cols.start >= cols.end || cols.end > self.cols {
            return None;
        }
        let (n, whole) = (cols.end - cols.start, self.cols);
        let on_edges = |block: usize| {
            let edge = |c: usize| c.is_multiple_of(block) || c == whole;
            edge(cols.start) && edge(cols.end)
        };
        // Bytes `from..to` of each row of `row_bytes`, back to back.
        let cut = |bytes: &SharedBytes, row_bytes: usize, (from, to): (usize, usize)| {
            let all = bytes.as_slice();
            let mut out = Vec::with_capacity(self.rows * (to - from));
            for r in 0..self.rows {
                out.extend_from_slice(all.get(r * row_bytes + from..r * row_bytes + to)?);
            }
            Some(SharedBytes::owned(out))
        };
        let fp4 = |packed: &SharedBytes, scales: &SharedBytes, block: usize| {
            if !on_edges(block) {
                return None;
            }
            let bytes = (cols.start / 2, cols.end / 2);
            let blocks = (cols.start / block, cols.end / block);
            Some((
                cut(packed, whole / 2, bytes)?,
                cut(scales, whole / block, blocks)?,
            ))
        };
        let form = match &self.form {
            WeightForm::F32(v) => WeightForm::F32(
                v.chunks_exact(whole)
                    .flat_map(|row| &row[cols.clone()])
                    .copied()
                    .collect(),
            ),
            WeightForm::Bf16(b) => {
                WeightForm::Bf16(cut(b, 2 * whole, (2 * cols.start, 2 * cols.end))?)
            }
            WeightForm::Fp8Block { codes, scales } => {
                if !on_edges(FP8_BLOCK) {
                    return None;
                }
                let tiles = whole.div_ceil(FP8_BLOCK);
                let (t0, t1) = (cols.start / FP8_BLOCK, cols.end.div_ceil(FP8_BLOCK));
                WeightForm::Fp8Block {
                    codes: cut(codes, whole, (cols.start, cols.end))?,
                    scales: scales
                        .chunks_exact(tiles)
                        .flat_map(|row| &row[t0..t1])
                        .copied()
                        .collect(),
                }
            }
            WeightForm::Mxfp4 { packed, scales } => {
                let (packed, scales) = fp4(packed, scales, MXFP4_BLOCK)?;
                WeightForm::Mxfp4 { packed, scales }
            }
            WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => {
                let (packed, scales) = fp4(packed, scales, NVFP4_BLOCK)?;
                WeightForm::Nvfp4 {
                    packed,
                    scales,
                    scale_2: *scale_2,
                }
            }
        };
        Some(Self {
            rows: self.rows,
            cols: n,
            form,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::super::tests::{bytes, vectors};
    use crate::{
        synth::Rng,
        tensor::{Matrix, SharedBytes, Weight},
    };

    /// One weight of each form: f32 5x40, bf16 130x67, FP8 300x260, MXFP4 3x96, NVFP4 5x64.
    fn every_form(rng: &mut Rng) -> [Weight; 5] {
        let f32s = Weight::from(Matrix::new(5, 40, vectors(rng, 1, 200).concat()));
        let raw = bytes(rng, 2 * 130 * 67, |_| true)
            .chunks_exact(2)
            .flat_map(|p| ((u16::from_le_bytes([p[0], p[1]]) & 0x807F) | 0x3F00).to_le_bytes())
            .collect();
        let bf16 = Weight::bf16(130, 67, SharedBytes::owned(raw)).unwrap();
        let codes = bytes(rng, 300 * 260, |c| c & 0x7F != 0x7F);
        let scale = bytes(rng, 3 * 3, |c| (100..140).contains(&c));
        let fp8 = Weight::fp8_block(300, 260, SharedBytes::owned(codes), &scale).unwrap();
        let owned = SharedBytes::owned;
        let mx = Weight::mxfp4(
            3,
            96,
            owned(bytes(rng, 3 * 48, |_| true)),
            owned(bytes(rng, 3 * 3, |c| (110..140).contains(&c))),
        )
        .unwrap();
        let nv = Weight::nvfp4(
            5,
            64,
            owned(bytes(rng, 5 * 32, |_| true)),
            owned(bytes(rng, 5 * 4, |c| (40..90).contains(&c))),
            0.75,
        )
        .unwrap();
        [f32s, bf16, fp8, mx, nv]
    }

    /// A row block computes its rows as the whole weight does, bit for bit: f32, bf16 and the
    /// FP4 forms cut anywhere, FP8 blocks on a block's edge or at the last row; elsewhere none.
    #[test]
    fn row_blocks_compute_their_rows_as_the_whole_weight() {
        let mut rng = Rng::for_tensor(2, "row-blocks");
        let [f32s, bf16, fp8, mx, nv] = every_form(&mut rng);
        let cases = [
            (&f32s, 1..4, true),
            (&bf16, 3..100, true),
            (&fp8, 128..256, true),
            (&fp8, 256..300, true),
            (&fp8, 0..300, true),
            (&mx, 1..2, true),
            (&nv, 2..5, true),
            (&fp8, 64..128, false),
            (&fp8, 128..200, false),
            (&f32s, 4..6, false),
            (&nv, 3..3, false),
        ];
        for (w, rows, cut) in cases {
            let block = w.row_block(rows.clone());
            assert_eq!(block.is_some(), cut, "rows {rows:?} of {}", w.rows);
            let Some(block) = block else { continue };
            assert_eq!((block.rows, block.cols), (rows.len(), w.cols));
            let xs = vectors(&mut rng, 3, w.cols);
            let whole = w.apply_rows_many(rows.start, rows.len(), &xs);
            assert_eq!(block.apply_many(&xs), whole, "rows {rows:?}");
        }
    }

    /// A column block computes as the whole weight over its columns, bit for bit, and decodes
    /// to those columns: f32 and bf16 cut on any multiple of 8, the block forms on their
    /// blocks' edges (or the last column); elsewhere none.
    #[test]
    fn column_blocks_compute_as_the_whole_weight_over_their_columns() {
        let mut rng = Rng::for_tensor(3, "column-blocks");
        let [f32s, bf16, fp8, mx, nv] = every_form(&mut rng);
        let cases = [
            (&f32s, 8..40, true),
            (&f32s, 16..24, true),
            (&bf16, 8..67, true),
            (&fp8, 128..256, true),
            (&fp8, 256..260, true),
            (&fp8, 0..260, true),
            (&mx, 32..64, true),
            (&mx, 64..96, true),
            (&nv, 16..48, true),
            (&nv, 48..64, true),
            (&fp8, 64..128, false),
            (&fp8, 128..200, false),
            (&mx, 16..48, false),
            (&nv, 8..16, false),
            (&nv, 16..72, false),
            (&f32s, 8..8, false),
        ];
        for (w, cols, cut) in cases {
            let block = w.col_block(cols.clone());
            assert_eq!(block.is_some(), cut, "columns {cols:?} of {}", w.cols);
            let Some(block) = block else { continue };
            assert_eq!((block.rows, block.cols), (w.rows, cols.len()));
            let whole = w.to_f32();
            let want: Vec<f32> = whole
                .chunks_exact(w.cols)
                .flat_map(|row| &row[cols.clone()])
                .copied()
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&block.to_f32()), bits(&want), "columns {cols:?}");
            let xs = vectors(&mut rng, 3, cols.len());
            let over = w.apply_cols_many(cols.start, cols.len(), &xs);
            assert_eq!(block.apply_many(&xs), over, "columns {cols:?}");
        }
    }
}
