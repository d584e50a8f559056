//! Launch wrappers of the FP4 kernels: NVFP4 activation quantization, FP4 GEMVs (single and
//! grouped over routed experts) and the NVFP4 tensor-core GEMM.

use crate::cuda::{kernel, params::same};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, non_empty};
use crate::cpu;

// The wgmma kernel takes its WMMA twin's parameters: one launcher.
const _: () = assert!(same(
    kernel::nvfp4_gemm_bf16::PARAMS,
    kernel::nvfp4_gemm_bf16_wgmma::PARAMS
));

// Both architectures' kernels take one parameter list: one launcher.
const _: () = assert!(same(
    kernel::nvfp4_gemm_w4a4_sm100::PARAMS,
    kernel::nvfp4_gemm_w4a4_sm120::PARAMS
));

impl Gpu {
    /// NVFP4-quantizes a row-major `[rows, cols]` matrix on the GPU (see `cpu::nvfp4_quantize_rows`).
    /// `poison` pre-fills the outputs so stale memory can never pass for a result.
    pub fn nvfp4_quantize_rows(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
        global_scale: f32,
        poison: u8,
    ) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        if !cols.is_multiple_of(16) || x.len() != rows * cols {
            return Err(KernelError::Shape(format!(
                "{rows}x{cols} with {} values",
                x.len()
            )));
        }
        let blocks = rows * cols / 16;
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let mut d_packed = self.stream.clone_htod(&vec![poison; (blocks * 8).max(1)])?;
        let mut d_scales = self.stream.clone_htod(&vec![poison; blocks.max(1)])?;
        if blocks > 0 {
            let f = self
                .nvfp4
                .load_function(kernel::nvfp4_quantize_rows::NAME)?;
            let (rows_arg, cols_arg) = (rows as i64, cols as i64);
            let mut launch = self.stream.launch_builder(&f);
            kernel::nvfp4_quantize_rows::args(
                &mut launch,
                &d_x,
                &rows_arg,
                &cols_arg,
                &global_scale,
                &mut d_packed,
                &mut d_scales,
            );
            let threads = 128u32;
            let grid = u32::try_from(blocks.div_ceil(threads as usize))
                .map_err(|_| KernelError::Shape("too many blocks".into()))?;
            // SAFETY: argument types and order match the kernel signature; buffers are sized
            // for `blocks` blocks.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let mut packed = self.stream.clone_dtoh(&d_packed)?;
        let mut scales = self.stream.clone_dtoh(&d_scales)?;
        packed.truncate(blocks * 8);
        scales.truncate(blocks);
        Ok((packed, scales))
    }

    /// `y = W · x` with an NVFP4 weight (dequantize path; see `cpu::nvfp4_gemv`). `y` is
    /// poisoned with NaN before the launch.
    pub fn nvfp4_gemv(
        &self,
        packed: &[u8],
        scales: &[u8],
        scale_2: f32,
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, KernelError> {
        self.gemv_host(GemvFormat::Nvfp4 { scale_2 }, packed, scales, x, rows, cols)
    }

    /// `y = W · x` with an MXFP4 weight (see `cpu::mxfp4_gemv`); `y` poisoned with NaN.
    pub fn mxfp4_gemv(
        &self,
        packed: &[u8],
        scales: &[u8],
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, KernelError> {
        self.gemv_host(GemvFormat::Mxfp4, packed, scales, x, rows, cols)
    }

    fn gemv_host(
        &self,
        format: GemvFormat,
        packed: &[u8],
        scales: &[u8],
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let d_packed = self.stream.clone_htod(&non_empty(packed))?;
        let d_scales = self.stream.clone_htod(&non_empty(scales))?;
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let mut d_y = self.stream.clone_htod(&vec![f32::NAN; rows.max(1)])?;
        self.launch_gemv(format, &d_packed, &d_scales, &d_x, rows, cols, &mut d_y)?;
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(rows);
        Ok(y)
    }

    /// Launches `y = W · x` on device buffers (`W` is `[rows, cols]` in `format`).
    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per kernel parameter"
    )]
    pub fn launch_gemv(
        &self,
        format: GemvFormat,
        packed: &CudaSlice<u8>,
        scales: &CudaSlice<u8>,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let block = format.block();
        if !cols.is_multiple_of(block)
            || packed.len() < rows * cols / 2
            || scales.len() < rows * cols / block
            || x.len() < cols
            || y.len() < rows
        {
            return Err(KernelError::Shape(format!("{format:?} gemv {rows}x{cols}")));
        }
        if rows == 0 {
            return Ok(());
        }
        let (rows_arg, cols_arg) = (rows as i64, cols as i64);
        let f = self.gemv.load_function(match format {
            GemvFormat::Nvfp4 { .. } => kernel::nvfp4_gemv::NAME,
            GemvFormat::Mxfp4 => kernel::mxfp4_gemv::NAME,
        })?;
        let mut launch = self.stream.launch_builder(&f);
        match format {
            GemvFormat::Nvfp4 { ref scale_2 } => kernel::nvfp4_gemv::args(
                &mut launch,
                packed,
                scales,
                scale_2,
                x,
                &rows_arg,
                &cols_arg,
                y,
            ),
            GemvFormat::Mxfp4 => {
                kernel::mxfp4_gemv::args(&mut launch, packed, scales, x, &rows_arg, &cols_arg, y);
            }
        }
        let grid = super::grid_dim(rows.div_ceil(GEMV_WARPS), "gemv rows")?;
        // SAFETY: argument types and order match the kernel; buffer sizes checked above.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (32 * GEMV_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// The routed-expert GEMVs of a decode step (see `cpu::grouped_gemv`): returns
    /// `[pairs, rows]`, poisoned with NaN before the launch. Token and expert indices are
    /// checked here (the kernel trusts them).
    pub fn grouped_gemv(
        &self,
        experts: cpu::Experts<'_>,
        x: &[f32],
        pair_token: &[usize],
        pair_expert: &[usize],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let (code_bytes, _) = experts.bytes_per_expert(rows, cols);
        let (packed, scales, scale_2) = match experts {
            cpu::Experts::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => (packed, scales, Some(scale_2)),
            cpu::Experts::Mxfp4 { packed, scales } => (packed, scales, None),
        };
        let count = packed.len().checked_div(code_bytes).unwrap_or(0);
        let tokens = x.len().checked_div(cols).unwrap_or(0);
        let pairs = pair_token.len();
        if pair_expert.len() != pairs
            || pair_token.iter().any(|&t| t >= tokens)
            || pair_expert.iter().any(|&e| e >= count)
            || scale_2.is_some_and(|s| s.len() != count)
        {
            return Err(KernelError::Shape(format!(
                "grouped gemv: {pairs} pairs over {tokens} tokens and {count} experts"
            )));
        }
        let to_i32 = |v: &[usize]| -> Result<Vec<i32>, KernelError> {
            v.iter()
                .map(|&i| i32::try_from(i).map_err(|_| KernelError::Shape("index".into())))
                .collect()
        };
        let d_packed = self.stream.clone_htod(&non_empty(packed))?;
        let d_scales = self.stream.clone_htod(&non_empty(scales))?;
        let d_scale_2 = scale_2
            .map(|s| self.stream.clone_htod(&non_empty(s)))
            .transpose()?;
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let d_token = self.stream.clone_htod(&non_empty(&to_i32(pair_token)?))?;
        let d_expert = self.stream.clone_htod(&non_empty(&to_i32(pair_expert)?))?;
        let mut d_y = self
            .stream
            .clone_htod(&vec![f32::NAN; (pairs * rows).max(1)])?;
        let device = DeviceExperts {
            packed: &d_packed,
            scales: &d_scales,
            scale_2: d_scale_2.as_ref(),
            experts: count,
            rows,
            cols,
        };
        self.launch_grouped_gemv(&device, &d_x, &d_token, &d_expert, pairs, &mut d_y)?;
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(pairs * rows);
        Ok(y)
    }

    /// Launches the grouped GEMV on device buffers: `y[p] = W[pair_expert[p]] · x[pair_token[p]]`.
    pub fn launch_grouped_gemv(
        &self,
        experts: &DeviceExperts<'_>,
        x: &CudaSlice<f32>,
        pair_token: &CudaSlice<i32>,
        pair_expert: &CudaSlice<i32>,
        pairs: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let DeviceExperts {
            packed,
            scales,
            scale_2,
            experts: count,
            rows,
            cols,
        } = *experts;
        let block = if scale_2.is_some() { 16 } else { 32 };
        if !cols.is_multiple_of(block)
            || packed.len() < count * rows * cols / 2
            || scales.len() < count * rows * cols / block
            || scale_2.is_some_and(|s| s.len() < count)
            || pair_token.len() < pairs
            || pair_expert.len() < pairs
            || x.len() < cols
            || y.len() < pairs * rows
        {
            return Err(KernelError::Shape(format!(
                "grouped gemv: {count} experts of {rows}x{cols}, {pairs} pairs"
            )));
        }
        if pairs == 0 || rows == 0 {
            return Ok(());
        }
        let (rows_arg, cols_arg) = (rows as i64, cols as i64);
        // The kernel poisons a pair whose indices fall outside these instead of reading there.
        let (experts_arg, tokens_arg) = (count as i64, (x.len() / cols.max(1)) as i64);
        let f = self.gemv.load_function(if scale_2.is_some() {
            kernel::nvfp4_grouped_gemv::NAME
        } else {
            kernel::mxfp4_grouped_gemv::NAME
        })?;
        let mut launch = self.stream.launch_builder(&f);
        let shape = (&rows_arg, &cols_arg, &experts_arg, &tokens_arg);
        let (rows_p, cols_p, experts_p, tokens_p) = shape;
        match scale_2 {
            Some(scale_2) => kernel::nvfp4_grouped_gemv::args(
                &mut launch,
                packed,
                scales,
                scale_2,
                x,
                pair_token,
                pair_expert,
                rows_p,
                cols_p,
                experts_p,
                tokens_p,
                y,
            ),
            None => kernel::mxfp4_grouped_gemv::args(
                &mut launch,
                packed,
                scales,
                x,
                pair_token,
                pair_expert,
                rows_p,
                cols_p,
                experts_p,
                tokens_p,
                y,
            ),
        }
        let grid_x = super::grid_dim(rows.div_ceil(GEMV_WARPS), "grouped gemv rows")?;
        if pairs > 65_535 {
            return Err(KernelError::Shape(format!("{pairs} pairs (at most 65535)")));
        }
        // SAFETY: argument types and order match the kernel; buffer sizes checked above; the
        // kernel reads through no pair index outside `experts_arg` / `tokens_arg`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_x, pairs as u32, 1),
                block_dim: (32 * GEMV_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// `C = bf16(A) · Wᵀ` on tensor cores (see `cpu::nvfp4_gemm`): `A` `[m, k]`, NVFP4 `W`
    /// `[n, k]`; returns `[m, n]`, poisoned with NaN before the launch.
    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per kernel parameter"
    )]
    pub fn nvfp4_gemm(
        &self,
        a: &[f32],
        packed: &[u8],
        scales: &[u8],
        scale_2: f32,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Vec<f32>, KernelError> {
        if a.len() != m * k || packed.len() != n * k / 2 || scales.len() != n * k / 16 {
            return Err(KernelError::Shape(format!("nvfp4 gemm {m}x{n}x{k}")));
        }
        let d_a = self.stream.clone_htod(&non_empty(a))?;
        let d_packed = self.stream.clone_htod(&non_empty(packed))?;
        let d_scales = self.stream.clone_htod(&non_empty(scales))?;
        let mut d_c = self.stream.clone_htod(&vec![f32::NAN; (m * n).max(1)])?;
        self.launch_nvfp4_gemm(&d_a, &d_packed, &d_scales, scale_2, (m, n, k), &mut d_c)?;
        let mut c = self.stream.clone_dtoh(&d_c)?;
        c.truncate(m * n);
        Ok(c)
    }

    /// Launches the NVFP4 GEMM on device buffers; `(m, n, k)` as in [`Self::nvfp4_gemm`].
    pub fn launch_nvfp4_gemm(
        &self,
        a: &CudaSlice<f32>,
        packed: &CudaSlice<u8>,
        scales: &CudaSlice<u8>,
        scale_2: f32,
        (m, n, k): (usize, usize, usize),
        c: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if !k.is_multiple_of(16)
            || a.len() < m * k
            || packed.len() < n * k / 2
            || scales.len() < n * k / 16
            || c.len() < m * n
        {
            return Err(KernelError::Shape(format!("nvfp4 gemm {m}x{n}x{k}")));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let wgmma = self.bf16_mma() == crate::arch::Bf16Mma::Wgmma;
        let f = self.gemm.load_function(if wgmma {
            kernel::nvfp4_gemm_bf16_wgmma::NAME
        } else {
            kernel::nvfp4_gemm_bf16::NAME
        })?;
        let (m_arg, n_arg, k_arg) = (m as i64, n as i64, k as i64);
        let mut launch = self.stream.launch_builder(&f);
        kernel::nvfp4_gemm_bf16::args(
            &mut launch,
            a,
            packed,
            scales,
            &scale_2,
            &m_arg,
            &n_arg,
            &k_arg,
            c,
        );
        let grid = (
            super::grid_dim(n.div_ceil(GEMM_TILE), "gemm columns")?,
            super::grid_dim(m.div_ceil(GEMM_TILE), "gemm rows")?,
        );
        if grid.1 > 65_535 {
            return Err(KernelError::Shape(format!(
                "gemm m = {m} (at most 65535 tiles)"
            )));
        }
        // SAFETY: the chosen kernel's parameters in order (its typed launcher); sizes checked
        // above.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid.0, grid.1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// `C = A · Wᵀ` with NVFP4 activations and weights on sm_120 FP4 tensor cores (see
    /// `cpu::nvfp4_gemm_w4a4`); `k` must be a multiple of 64. Returns [`KernelError::Unsupported`]
    /// on any other compute capability, sm_121 included ([`crate::arch::fp4_mma`]). Output poisoned with NaN before the launch.
    pub fn nvfp4_gemm_w4a4(
        &self,
        a: (&[u8], &[u8], f32),
        w: (&[u8], &[u8], f32),
        (m, n, k): (usize, usize, usize),
    ) -> Result<Vec<f32>, KernelError> {
        let (major, minor) = self.ctx.compute_capability()?;
        if crate::arch::fp4_mma(major, minor).map_err(KernelError::Unsupported)?
            != crate::arch::Fp4Mma::Sm120MmaSync
        {
            return Err(KernelError::Unsupported(format!(
                "this is the sm_120 kernel; on sm_{major}{minor} use nvfp4_gemm_w4a4_sm100"
            )));
        }
        // SAFETY: the device is exactly sm_120, where the kernel has its real
        // body; it takes the W4A4 parameter list and 128 threads per 64 x 64 tile.
        unsafe { self.launch_w4a4(W4a4::Sm120, (GEMM_TILE, GEMM_TILE), a, w, (m, n, k)) }
    }

    /// Uploads the W4A4 operands, poisons `C` with NaN, launches `kernel` with 128 threads per
    /// `tile` (rows of A, rows of W) and copies `C` back.
    ///
    /// # Safety
    /// `kernel` must compute `tile` with 128 threads and static shared memory, and have its
    /// real body on this device.
    pub(super) unsafe fn launch_w4a4(
        &self,
        kernel: W4a4,
        tile: (usize, usize),
        a: (&[u8], &[u8], f32),
        w: (&[u8], &[u8], f32),
        (m, n, k): (usize, usize, usize),
    ) -> Result<Vec<f32>, KernelError> {
        if !k.is_multiple_of(64)
            || a.0.len() != m * k / 2
            || a.1.len() != m * k / 16
            || w.0.len() != n * k / 2
            || w.1.len() != n * k / 16
        {
            return Err(KernelError::Shape(format!("w4a4 gemm {m}x{n}x{k}")));
        }
        let grid = (
            super::grid_dim(n.div_ceil(tile.1), "gemm columns")?,
            super::grid_dim(m.div_ceil(tile.0), "gemm rows")?,
        );
        if grid.1 > 65_535 {
            return Err(KernelError::Shape(format!(
                "gemm m = {m} (at most 65535 row tiles)"
            )));
        }
        let d_a = self.stream.clone_htod(&non_empty(a.0))?;
        let d_sa = self.stream.clone_htod(&non_empty(a.1))?;
        let d_w = self.stream.clone_htod(&non_empty(w.0))?;
        let d_sw = self.stream.clone_htod(&non_empty(w.1))?;
        let mut d_c = self.stream.clone_htod(&vec![f32::NAN; (m * n).max(1)])?;
        if m > 0 && n > 0 {
            let f = match kernel {
                W4a4::Sm100 => self
                    .gemm_sm100
                    .load_function(kernel::nvfp4_gemm_w4a4_sm100::NAME),
                W4a4::Sm120 => self
                    .gemm_sm120
                    .load_function(kernel::nvfp4_gemm_w4a4_sm120::NAME),
            }?;
            let (m_arg, n_arg, k_arg) = (m as i64, n as i64, k as i64);
            let mut launch = self.stream.launch_builder(&f);
            let (a_codes, a_scales, w_codes, w_scales) = (&d_a, &d_sa, &d_w, &d_sw);
            kernel::nvfp4_gemm_w4a4_sm120::args(
                &mut launch,
                a_codes,
                a_scales,
                &a.2,
                w_codes,
                w_scales,
                &w.2,
                &m_arg,
                &n_arg,
                &k_arg,
                &mut d_c,
            );
            // SAFETY: the kernel's parameters in order (its typed launcher), the buffer sizes
            // checked above.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid.0, grid.1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let mut c = self.stream.clone_dtoh(&d_c)?;
        c.truncate(m * n);
        Ok(c)
    }
}

/// The block-scaled FP4 tensor-core GEMM kernels (W4A4): one per architecture, the same
/// parameters.
#[derive(Debug, Clone, Copy)]
pub(super) enum W4a4 {
    /// `nvfp4_gemm_w4a4_sm100` (tcgen05).
    Sm100,
    /// `nvfp4_gemm_w4a4_sm120` (block-scaled mma.sync).
    Sm120,
}

/// Warps (output rows) per block of the GEMV kernels (`WARPS_PER_BLOCK` in `fp4_gemv.cu`).
const GEMV_WARPS: usize = crate::cuda_constants::fp4_gemv::WARPS_PER_BLOCK;
/// Output tile edge of `nvfp4_gemm_bf16` (`BM` = `BN`).
const GEMM_TILE: usize = crate::cuda_constants::nvfp4_gemm::BM;
const _: () = assert!(GEMM_TILE == crate::cuda_constants::nvfp4_gemm::BN);

/// The FP4 format of a GEMV weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GemvFormat {
    /// e4m3 scales per 16 and a global scale.
    Nvfp4 { scale_2: f32 },
    /// ue8m0 scales per 32.
    Mxfp4,
}

impl GemvFormat {
    fn block(self) -> usize {
        match self {
            GemvFormat::Nvfp4 { .. } => 16,
            GemvFormat::Mxfp4 => 32,
        }
    }
}

/// Routed experts on the device, stacked `[experts, rows, cols]`; NVFP4 when `scale_2` (one
/// per expert) is given, MXFP4 otherwise.
#[derive(Debug, Clone, Copy)]
pub struct DeviceExperts<'a> {
    pub packed: &'a CudaSlice<u8>,
    pub scales: &'a CudaSlice<u8>,
    pub scale_2: Option<&'a CudaSlice<f32>>,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}
