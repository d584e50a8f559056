//! Launch wrappers of the dense kernels: the experts' clamped SwiGLU (`moe_act.cu`) and the
//! bf16 GEMV over several vectors (`dense_gemv.cu`, the output head).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Gpu, KernelError, non_empty};

/// Warps (output rows) per block of `bf16_gemv_many` (`WARPS_PER_BLOCK` there).
const BF16_GEMV_WARPS: usize = 4;
/// Vectors per `bf16_gemv_many` launch (grid y).
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
        let f = self.moe_act.load_function("swiglu_clamp")?;
        let n_arg = n as i64;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(gate).arg(up).arg(&n_arg).arg(&limit).arg(out);
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

impl Gpu {
    /// `y[v] = W · x[v]` for a bf16 weight (raw bits, `[rows, cols]`) and `x` `[vectors,
    /// cols]` (see `cpu::bf16_gemv`); returns `[vectors, rows]`, poisoned with NaN before the
    /// launch.
    pub fn bf16_gemv(
        &self,
        w: &[u16],
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let vectors = x.len().checked_div(cols).unwrap_or(0);
        if w.len() != rows * cols || x.len() != vectors * cols {
            return Err(KernelError::Shape(format!(
                "bf16 gemv {rows}x{cols} with {} inputs",
                x.len()
            )));
        }
        let d_w = self.stream.clone_htod(&non_empty(w))?;
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let mut d_y = self
            .stream
            .clone_htod(&vec![f32::NAN; (vectors * rows).max(1)])?;
        self.launch_bf16_gemv(&d_w, &d_x, rows, cols, vectors, &mut d_y)?;
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(vectors * rows);
        Ok(y)
    }

    /// Launches `y[v] = W · x[v]` on device buffers (in groups of at most 65535 vectors).
    pub fn launch_bf16_gemv(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        vectors: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if w.len() < rows * cols || x.len() < vectors * cols || y.len() < vectors * rows {
            return Err(KernelError::Shape(format!(
                "bf16 gemv {rows}x{cols}, {vectors} vectors"
            )));
        }
        if rows == 0 || vectors == 0 {
            return Ok(());
        }
        let f = self.dense.load_function("bf16_gemv_many")?;
        let grid_x = super::grid_dim(rows.div_ceil(BF16_GEMV_WARPS), "bf16 gemv rows")?;
        let (rows_arg, cols_arg) = (rows as i64, cols as i64);
        let mut first = 0;
        while first < vectors {
            let count = VECTORS_PER_LAUNCH.min(vectors - first);
            let x_part = x.slice(first * cols..(first + count) * cols);
            let mut y_part = y.slice_mut(first * rows..(first + count) * rows);
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(w)
                .arg(&x_part)
                .arg(&rows_arg)
                .arg(&cols_arg)
                .arg(&mut y_part);
            // SAFETY: argument types and order match `bf16_gemv_many`; `w` holds rows x cols,
            // the views hold `count` vectors of inputs and outputs.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid_x, count as u32, 1),
                    block_dim: (32 * BF16_GEMV_WARPS as u32, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
            first += count;
        }
        Ok(())
    }
}
