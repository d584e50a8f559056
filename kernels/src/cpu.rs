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

/// `y = W · x` for an NVFP4 weight `[rows, cols]` (packed codes, e4m3 block scales, global
/// scale), computed in f64 from the exactly dequantized weights: the reference the GPU GEMV's
/// f32 result is compared with.
pub fn nvfp4_gemv(
    packed: &[u8],
    scales: &[u8],
    scale_2: f32,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let w = quant::dequant_nvfp4(packed, scales, scale_2, rows, cols)?;
    Ok((0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>() as f32
        })
        .collect())
}
