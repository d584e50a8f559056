//! The row kernels' CPU references of [`super::EmulatedKernels`]: each head's norm and
//! rotation in place, rows stored as the engine's FP8 K=V rows.

use engine::tensor::{rms_norm, rms_norm_unweighted};

use super::{err, index, part, store};
use crate::step::{
    ShapeError,
    kernels::RowSpec,
    layout::{kv_stride, pack_kv_row},
};
use engine::paged::layout::RowFormat;

/// `norm_rope_rows`: each head of each of `rows` rows normalised (`spec.norm`: none,
/// unweighted, or by `w`) and its last `spec.rope` values rotated by the row's (sin, cos).
pub(super) fn norm_rope_rows(
    x: &mut [f32],
    spec: RowSpec,
    w: &[f32],
    sin_cos: &[f32],
    rows: usize,
) -> Result<(), ShapeError> {
    let (hd, rope) = (spec.head_dim, spec.rope);
    let width = spec.heads * hd;
    let values = x
        .get_mut(..rows * width)
        .ok_or_else(|| err("norm_rope_rows"))?;
    for (r, row) in values.chunks_exact_mut(width.max(1)).enumerate() {
        let sc = part(sin_cos, r * rope, rope, "norm_rope_rows sin/cos")?;
        for head in row.chunks_exact_mut(hd) {
            match spec.norm {
                0 => {}
                1 => rms_norm_unweighted(head, spec.eps),
                _ => rms_norm(
                    head,
                    w.get(..hd).ok_or_else(|| err("norm weight"))?,
                    spec.eps,
                ),
            }
            let start = hd - rope;
            for i in 0..rope / 2 {
                let s = if spec.inverse { -sc[2 * i] } else { sc[2 * i] };
                let c = sc[2 * i + 1];
                let (a, b) = (head[start + 2 * i], head[start + 2 * i + 1]);
                head[start + 2 * i] = a * c - b * s;
                head[start + 2 * i + 1] = b * c + a * s;
            }
        }
    }
    Ok(())
}

/// `fp8_kv_store`: row `i` of `rows` (`nope + rope` values) as the engine's FP8 K=V row at
/// byte offset `offsets[i]` of the f32 arena `arena` (negative: skipped; unaligned: refused).
pub(super) fn fp8_kv_store(
    rows: &[f32],
    (nope, rope): (usize, usize),
    arena: &mut [f32],
    offsets: &[i64],
) -> Result<(), ShapeError> {
    let kv = RowFormat::Fp8Kv { nope, rope };
    let stride = kv_stride(nope + rope, kv)?;
    for (i, &b) in offsets.iter().enumerate() {
        if b < 0 {
            continue;
        }
        if b % 4 != 0 {
            return Err(err("fp8_kv_store: an unaligned row"));
        }
        let row = part(rows, i * (nope + rope), nope + rope, "fp8_kv_store rows")?;
        let stored = pack_kv_row(kv, &row);
        store(arena, index(b / 4, "fp8_kv_store")?, &stored[..stride])?;
    }
    Ok(())
}
