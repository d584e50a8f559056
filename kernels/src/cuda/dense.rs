//! Launch wrappers of the dense kernels: the experts' clamped SwiGLU (`moe_act.cu`) and the
//! bf16 and FP8-block GEMVs over several vectors (`dense_gemv.cu`: the output head, the shared
//! expert).

use crate::cuda::kernel;
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, non_empty};

/// Warps (output rows) per block of the dense GEMVs (`WARPS_PER_BLOCK` in dense_gemv.cu).
const DENSE_GEMV_WARPS: usize = crate::cuda_constants::dense_gemv::WARPS_PER_BLOCK;
/// Vectors per dense GEMV launch (grid y).
const VECTORS_PER_LAUNCH: usize = 65_535;

/// Threads per block of `swiglu_clamp`.
const SWIGLU_THREADS: u32 = 256;

impl Gpu {
    /// `silu(min(g, limit)) * clamp(u, -limit, limit)` on the GPU (see `cpu::swiglu_clamp`);
    /// the output is poisoned with NaN before the launch.
    pub fn swiglu_clamp(
        &self,
        gate: &[f32],
        up: &[f32],
        limit: f32,
    ) -> Result<Vec<f32>, KernelError> {
        if gate.len() != up.len() {
            return Err(KernelError::Shape(format!(
                "swiglu: {} gate values, {} up values",
                gate.len(),
                up.len()
            )));
        }
        let d_gate = self.stream.clone_htod(&non_empty(gate))?;
        let d_up = self.stream.clone_htod(&non_empty(up))?;
        let mut d_out = self.stream.clone_htod(&vec![f32::NAN; gate.len().max(1)])?;
        self.launch_swiglu_clamp(&d_gate, &d_up, gate.len(), limit, &mut d_out)?;
        let mut out = self.stream.clone_dtoh(&d_out)?;
        out.truncate(gate.len());
        Ok(out)
    }

    /// Launches the clamped SwiGLU over the first `n` values of device buffers.
    pub fn launch_swiglu_clamp(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if gate.len() < n || up.len() < n || out.len() < n {
            return Err(KernelError::Shape(format!("swiglu over {n} values")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.moe_act.load_function(kernel::swiglu_clamp::NAME)?;
        let n_arg = n as i64;
        let mut launch = self.stream.launch_builder(&f);
        kernel::swiglu_clamp::args(&mut launch, gate, up, &n_arg, &limit, out);
        // A grid-stride loop: enough blocks to fill the device, never more than 65535 x 256.
        let blocks = super::grid_dim(n.div_ceil(SWIGLU_THREADS as usize).min(65_535), "swiglu")?;
        // SAFETY: argument types and order match the kernel; all buffers hold `n` values.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (SWIGLU_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}

/// A dense weight on the host, `[rows, cols]`.
#[derive(Debug, Clone, Copy)]
pub enum HostDense<'a> {
    /// bf16 bits.
    Bf16(&'a [u16]),
    /// e4m3 codes with ue8m0 scales per 128x128 tile.
    Fp8Block { w: &'a [u8], scales: &'a [u8] },
}

impl Gpu {
    /// `y[v] = W[rows] · x[v]` for a dense weight `[total rows, cols]` (see `cpu::bf16_gemv`,
    /// `cpu::fp8_block_gemv`) and `x` `[vectors, cols]`; returns `[vectors, rows.len()]`,
    /// poisoned with NaN before the launch.
    pub fn dense_gemv(
        &self,
        weight: HostDense<'_>,
        x: &[f32],
        (total, cols): (usize, usize),
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, KernelError> {
        let vectors = x.len().checked_div(cols).unwrap_or(0);
        let sized = match weight {
            HostDense::Bf16(w) => w.len() == total * cols,
            HostDense::Fp8Block { w, scales } => {
                w.len() == total * cols && scales.len() == total.div_ceil(128) * cols.div_ceil(128)
            }
        };
        if !sized || x.len() != vectors * cols || rows.start > rows.end || rows.end > total {
            return Err(KernelError::Shape(format!(
                "dense gemv {total}x{cols}, rows {rows:?}, {} inputs",
                x.len()
            )));
        }
        let n = rows.len();
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let mut d_y = self
            .stream
            .clone_htod(&vec![f32::NAN; (vectors * n).max(1)])?;
        match weight {
            HostDense::Bf16(w) => {
                let d_w = self.stream.clone_htod(&non_empty(w))?;
                let weight = DenseWeight::Bf16(&d_w);
                self.launch_dense_gemv(weight, rows.start, &d_x, (n, cols), vectors, &mut d_y)?;
            }
            HostDense::Fp8Block { w, scales } => {
                let d_w = self.stream.clone_htod(&non_empty(w))?;
                let d_s = self.stream.clone_htod(&non_empty(scales))?;
                let weight = DenseWeight::Fp8Block {
                    w: &d_w,
                    scales: &d_s,
                };
                self.launch_dense_gemv(weight, rows.start, &d_x, (n, cols), vectors, &mut d_y)?;
            }
        }
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(vectors * n);
        Ok(y)
    }

    /// Launches `y[v] = W · x[v]` for a bf16 weight on device buffers.
    pub fn launch_bf16_gemv(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        vectors: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.launch_dense_gemv(DenseWeight::Bf16(w), 0, x, (rows, cols), vectors, y)
    }

    /// Launches `y[v] = W[row0..row0 + rows] · x[v]` on device buffers (`W` has `cols`
    /// columns; in groups of at most 65535 vectors).
    pub fn launch_dense_gemv(
        &self,
        weight: DenseWeight<'_>,
        row0: usize,
        x: &CudaSlice<f32>,
        (rows, cols): (usize, usize),
        vectors: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let end = row0 + rows;
        let weight_ok = match weight {
            DenseWeight::Bf16(w) => w.len() >= end * cols,
            DenseWeight::Fp8Block { w, scales } => {
                w.len() >= end * cols && scales.len() >= end.div_ceil(128) * cols.div_ceil(128)
            }
        };
        if !weight_ok || x.len() < vectors * cols || y.len() < vectors * rows {
            return Err(KernelError::Shape(format!(
                "dense gemv {rows}x{cols}, {vectors} vectors"
            )));
        }
        if rows == 0 || vectors == 0 {
            return Ok(());
        }
        let f = self.dense.load_function(match weight {
            DenseWeight::Bf16(_) => kernel::bf16_gemv_many::NAME,
            DenseWeight::Fp8Block { .. } => kernel::fp8_block_gemv_many::NAME,
        })?;
        let grid_x = super::grid_dim(rows.div_ceil(DENSE_GEMV_WARPS), "dense gemv rows")?;
        let (row0_arg, rows_arg, cols_arg) = (row0 as i64, rows as i64, cols as i64);
        let mut first = 0;
        while first < vectors {
            let count = VECTORS_PER_LAUNCH.min(vectors - first);
            let x_part = x.slice(first * cols..(first + count) * cols);
            let mut y_part = y.slice_mut(first * rows..(first + count) * rows);
            let mut launch = self.stream.launch_builder(&f);
            match weight {
                DenseWeight::Bf16(w) => kernel::bf16_gemv_many::args(
                    &mut launch,
                    w,
                    &x_part,
                    &row0_arg,
                    &rows_arg,
                    &cols_arg,
                    &mut y_part,
                ),
                DenseWeight::Fp8Block { w, scales } => kernel::fp8_block_gemv_many::args(
                    &mut launch,
                    w,
                    scales,
                    &x_part,
                    &row0_arg,
                    &rows_arg,
                    &cols_arg,
                    &mut y_part,
                ),
            }
            // SAFETY: argument types and order match `bf16_gemv_many` / `fp8_block_gemv_many`;
            // the weight holds rows up to row0 + rows (and their scales), the views hold
            // `count` vectors of inputs and outputs.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid_x, count as u32, 1),
                    block_dim: (32 * DENSE_GEMV_WARPS as u32, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
            first += count;
        }
        Ok(())
    }
}

/// A dense weight `[rows, cols]` on the device.
#[derive(Debug, Clone, Copy)]
pub enum DenseWeight<'a> {
    /// bf16 bits.
    Bf16(&'a CudaSlice<u16>),
    /// e4m3 codes with ue8m0 scales per 128x128 tile (`[ceil(rows/128), ceil(cols/128)]`).
    Fp8Block {
        w: &'a CudaSlice<u8>,
        scales: &'a CudaSlice<u8>,
    },
}
