//! Shapes and CPU references of `kv_rows.cu`: the per-token row ops around decode attention
//! (norm and RoPE of query heads, K=V rows and attention outputs; FP8 encoding of K=V rows
//! into pages), composed from the engine's own functions.

use engine::{paged::codec, paged::layout::RowFormat, rope::Rope};

/// The norm `norm_rope_rows` applies to each head before its RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowNorm<'a> {
    None,
    Unweighted,
    /// Weighted by `head_dim` values.
    Weighted(&'a [f32]),
}

/// One `norm_rope_rows` launch: rows of `heads` heads of `head_dim` values, RoPE on each head's
/// trailing `rope` dims.
#[derive(Debug, Clone, Copy)]
pub struct NormRope<'a> {
    pub heads: usize,
    pub head_dim: usize,
    pub rope: usize,
    pub norm: RowNorm<'a>,
    pub eps: f32,
    pub inverse: bool,
}

impl NormRope<'_> {
    /// Checks the values and the rows' (sin, cos) table against the shape; the number of rows.
    pub fn check(&self, values: usize, sin_cos: usize) -> Result<usize, String> {
        let width = self.heads * self.head_dim;
        let rows = values / width.max(1);
        let weight_ok = match self.norm {
            RowNorm::Weighted(w) => w.len() == self.head_dim,
            _ => true,
        };
        if self.heads == 0
            || self.head_dim == 0
            || !self.rope.is_multiple_of(2)
            || self.rope > self.head_dim
            || values != rows * width
            || sin_cos != rows * self.rope
            || !weight_ok
        {
            return Err(format!(
                "norm_rope_rows: {values} values and {sin_cos} sin/cos values for rows of {} \
                 heads of {} with {} rope dims",
                self.heads, self.head_dim, self.rope
            ));
        }
        Ok(rows)
    }
}

/// The (sin, cos) pairs of `rope` at each position, `[positions, rope_dim]` interleaved: what
/// the device rotates with (the engine's own values, so the rotation is bit for bit).
pub fn sin_cos_table(rope: &Rope, positions: &[usize]) -> Vec<f32> {
    positions
        .iter()
        .flat_map(|&p| {
            rope.at(p)
                .sin_cos()
                .iter()
                .flat_map(|&(s, c)| [s, c])
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The reference of `norm_rope_rows`: per head the engine's norm, then `rope` at the row's
/// position.
pub fn norm_rope_rows(x: &mut [f32], spec: &NormRope<'_>, positions: &[usize], rope: &Rope) {
    let width = spec.heads * spec.head_dim;
    for (row, &pos) in x.chunks_exact_mut(width).zip(positions) {
        let rotation = rope.at(pos);
        for head in row.chunks_exact_mut(spec.head_dim) {
            match spec.norm {
                RowNorm::None => {}
                RowNorm::Unweighted => engine::tensor::rms_norm_unweighted(head, spec.eps),
                RowNorm::Weighted(w) => engine::tensor::rms_norm(head, w, spec.eps),
            }
            rotation.apply(head, spec.inverse);
        }
    }
}

/// Checks an `fp8_kv_encode` launch: whole rows, one offset per row, every written row inside
/// the pool and no two rows overlapping (the blocks would race).
pub fn check_encode(
    values: usize,
    (nope, rope): (usize, usize),
    offsets: &[i64],
    pool_bytes: usize,
) -> Result<(), String> {
    let dim = nope + rope;
    let bytes = RowFormat::Fp8Kv { nope, rope }.row_bytes(dim) as i64;
    if dim == 0 || values != offsets.len() * dim {
        return Err(format!(
            "fp8_kv_encode: {values} values for {} rows of {dim}",
            offsets.len()
        ));
    }
    let mut written: Vec<i64> = offsets.iter().copied().filter(|&o| o >= 0).collect();
    written.sort_unstable();
    if let Some(&last) = written.last()
        && last + bytes > pool_bytes as i64
    {
        return Err(format!(
            "fp8_kv_encode: a row at byte {last} ends past the pool ({pool_bytes} bytes)"
        ));
    }
    if let Some((a, b)) = written
        .windows(2)
        .map(|p| (p[0], p[1]))
        .find(|(a, b)| b - a < bytes)
    {
        return Err(format!("fp8_kv_encode: rows at bytes {a} and {b} overlap"));
    }
    Ok(())
}

/// The reference of `fp8_kv_encode`: `codec::encode` of each row at its offset (negative:
/// skipped).
pub fn fp8_kv_encode(rows: &[f32], (nope, rope): (usize, usize), pool: &mut [u8], offsets: &[i64]) {
    let format = RowFormat::Fp8Kv { nope, rope };
    let dim = nope + rope;
    let bytes = format.row_bytes(dim);
    for (row, &off) in rows.chunks_exact(dim).zip(offsets) {
        if let Ok(at) = usize::try_from(off) {
            codec::encode(format, row, &mut pool[at..at + bytes]);
        }
    }
}

/// The reference of `fp8_kv_round`: `codec::round` of each of the contiguous rows of
/// `nope + rope` values, in place.
pub fn fp8_kv_round(rows: &mut [f32], (nope, rope): (usize, usize)) {
    let format = RowFormat::Fp8Kv { nope, rope };
    for row in rows.chunks_exact_mut(nope + rope) {
        codec::round(format, row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_row_launches_are_refused() {
        let w = [1.0f32; 8];
        let spec = NormRope {
            heads: 2,
            head_dim: 8,
            rope: 4,
            norm: RowNorm::Weighted(&w),
            eps: 1e-6,
            inverse: false,
        };
        assert_eq!(spec.check(32, 8), Ok(2));
        assert!(
            NormRope { rope: 10, ..spec }.check(32, 20).is_err(),
            "rope wider than a head"
        );
        assert!(
            NormRope { rope: 3, ..spec }.check(32, 6).is_err(),
            "odd rope"
        );
        assert!(spec.check(31, 8).is_err());
        assert!(spec.check(32, 6).is_err(), "table short");
        let narrow = NormRope {
            norm: RowNorm::Weighted(&w[..7]),
            ..spec
        };
        assert!(narrow.check(32, 8).is_err());
        let table = sin_cos_table(&Rope::plain(10_000.0, 4), &[0, 3]);
        assert_eq!(table.len(), 8);
        assert_eq!(&table[..4], &[0.0, 1.0, 0.0, 1.0]);
        // nope 24 + rope 8: 24 + 16 + 8 = 48 bytes a row.
        assert_eq!(check_encode(64, (24, 8), &[0, 48], 96), Ok(()));
        assert_eq!(check_encode(64, (24, 8), &[-1, 48], 96), Ok(()));
        assert!(check_encode(64, (24, 8), &[0, 47], 96).is_err(), "overlap");
        assert!(
            check_encode(64, (24, 8), &[0, 49], 96).is_err(),
            "past the pool"
        );
        assert!(check_encode(63, (24, 8), &[0, 48], 96).is_err());
    }
}
