//! CPU references of the kernels, with semantics identical to the CUDA code.

use engine::quant::{self, QuantError};

/// NVFP4 activation quantization of a row-major `[rows, cols]` matrix: returns the packed
/// e2m1 codes (`rows * cols / 2` bytes) and the e4m3 block scales (`rows * cols / 16`).
pub fn nvfp4_quantize_rows(
    x: &[f32],
    rows: usize,
    cols: usize,
    global_scale: f32,
) -> Result<(Vec<u8>, Vec<u8>), QuantError> {
    let mut packed = Vec::with_capacity(x.len() / 2);
    let mut scales = Vec::with_capacity(x.len() / 16);
    if cols == 0 {
        return Ok((packed, scales));
    }
    for row in x.chunks(cols).take(rows) {
        let (p, s) = quant::quant_nvfp4_activation(row, global_scale)?;
        packed.extend(p);
        scales.extend(s);
    }
    Ok((packed, scales))
}
