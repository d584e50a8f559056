//! The fast linear of [`super::EmulatedKernels`]: `dense_gemm`'s reference (f64 over the bf16
//! operands) on the weights the device GEMM takes, with the scratch its split plan asks for.

use engine::tensor::WeightForm;

use super::{EmuRows, err, store};
use crate::{
    dense_gemm::{self, DenseRows},
    step::ShapeError,
};

/// The multiprocessors the emulated device plans its splits for (an H100's).
const MULTIPROCESSORS: usize = 132;

/// The weight as the dense GEMM reads it: bf16 or FP8-block rows.
pub(super) fn dense_rows(w: &EmuRows) -> Option<DenseRows<'_>> {
    let EmuRows::Weight(w) = w else {
        return None;
    };
    match w.form() {
        WeightForm::Bf16(bytes) => Some(DenseRows::Bf16(bytes.as_slice())),
        WeightForm::Fp8Block { codes, scales } => Some(DenseRows::Fp8Block {
            codes: codes.as_slice(),
            scales,
        }),
        _ => None,
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
