//! The linears of [`super::EmulatedKernels`]: the exact one (the engine's own products) and the
//! fast one (`dense_gemm`'s reference, f64 over the bf16 operands, on the weights the device
//! GEMM takes, with the scratch its split plan asks for).

use super::{EmuRows, err, store};
use crate::{
    dense_gemm::{self, DenseRows},
    step::ShapeError,
};

/// The multiprocessors the emulated device plans its splits for (an H100's).
const MULTIPROCESSORS: usize = 132;

/// The weight as the dense GEMM reads it: bf16 or FP8-block rows.
/// `exact_gemv`: rows `row0..row0 + rows` of `w` times `n` vectors of `x`, `[n, rows]`.
pub(super) fn exact_gemv(
    w: &EmuRows,
    (row0, rows): (usize, usize),
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    let cols = match w {
        EmuRows::Weight(w) => w.cols,
        EmuRows::Matrix(m) => m.cols,
    };
    let inputs: Vec<&[f32]> = (0..n)
        .map(|v| {
            x.get(v * cols..(v + 1) * cols)
                .ok_or_else(|| err("exact_gemv"))
        })
        .collect::<Result<_, _>>()?;
    let outs = match w {
        EmuRows::Weight(w) => w.apply_rows_many(row0, rows, &inputs),
        EmuRows::Matrix(m) => m.apply_rows_many(row0, rows, &inputs),
    };
    for (v, o) in outs.iter().enumerate() {
        store(y, v * rows, o)?;
    }
    Ok(())
}

pub(super) fn dense_rows(w: &EmuRows) -> Option<DenseRows<'_>> {
    match w {
        EmuRows::Weight(w) => DenseRows::of(w),
        EmuRows::Matrix(_) => None,
    }
}

pub(super) fn scratch(n: usize, rows: usize, cols: usize) -> usize {
    match dense_gemm::splits(n, rows, cols, MULTIPROCESSORS) {
        (1, _) => 0,
        (parts, _) => parts * n * rows,
    }
}

pub(super) fn fast_linear(
    w: &EmuRows,
    (row0, rows): (usize, usize),
    x: &[f32],
    n: usize,
    scratch_values: &mut [f32],
    y: &mut [f32],
) -> Result<(), ShapeError> {
    let w_rows = dense_rows(w).ok_or_else(|| {
        ShapeError("the fast linear takes bf16 and FP8-block weights only".into())
    })?;
    let cols = match w {
        EmuRows::Weight(w) => w.cols,
        EmuRows::Matrix(m) => m.cols,
    };
    let needed = scratch(n, rows, cols);
    // The device writes its split partials there: the step must not keep anything in it.
    scratch_values
        .get_mut(..needed)
        .ok_or_else(|| err("fast_linear scratch"))?
        .fill(f32::NAN);
    let a = x.get(..n * cols).ok_or_else(|| err("fast_linear"))?;
    let c = dense_gemm::reference(a, w_rows, row0, (n, rows, cols)).map_err(ShapeError)?;
    store(y, 0, &c)
}

#[cfg(test)]
mod tests {
    use engine::tensor::{SharedBytes, Weight};

    use super::*;

    /// A linear the dense GEMM splits (few tiles, long rows): the scratch its plan asks for is
    /// required and left poisoned, the rows from an offset are the reference's.
    #[test]
    fn a_split_linear_takes_its_scratch_and_gives_the_reference() {
        let (rows, cols, n, row0) = (300usize, 2048usize, 2usize, 130usize);
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 0x77) as u8).collect();
        let scales: Vec<u8> = (0..rows.div_ceil(128) * cols.div_ceil(128))
            .map(|i| 120 + (i % 5) as u8)
            .collect();
        let w = EmuRows::Weight(
            Weight::fp8_block(rows, cols, SharedBytes::owned(codes), &scales).unwrap(),
        );
        let out = rows - row0;
        let needed = scratch(n, out, cols);
        assert!(needed >= 2 * n * out, "the plan splits K: {needed}");
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i % 19) as f32 - 9.0) / 7.0)
            .collect();
        let mut y = vec![f32::NAN; n * out];
        let mut short = vec![0.0; needed - 1];
        assert!(fast_linear(&w, (row0, out), &x, n, &mut short, &mut y).is_err());
        let mut part = vec![0.0; needed];
        fast_linear(&w, (row0, out), &x, n, &mut part, &mut y).unwrap();
        assert!(part.iter().all(|v| v.is_nan()));
        let want = dense_gemm::reference(&x, dense_rows(&w).unwrap(), row0, (n, out, cols));
        assert_eq!(y, want.unwrap());
    }
}
