//! Launch wrapper of the sm_100 (B200) NVFP4 x NVFP4 GEMM on 5th-generation tensor cores
//! (`nvfp4_gemm_sm100.cu`): the same operation as [`Gpu::nvfp4_gemm_w4a4`] (sm_120), through
//! `tcgen05.mma` with the accumulator and the block scales in Tensor Memory.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{Gpu, KernelError, non_empty};

/// Output tile of `nvfp4_gemm_w4a4_sm100`: `TILE_M` rows of A by `TILE_N` rows of W.
const TILE_M: usize = 128;
const TILE_N: usize = 128;
/// Threads per block (`THREADS` in the kernel); its shared memory is static (36 KiB).
const THREADS: u32 = 128;

impl Gpu {
    /// `C = A · Wᵀ` with NVFP4 activations and weights on sm_100 tensor cores (see
    /// `cpu::nvfp4_gemm_w4a4`); `k` must be a multiple of 64, `m` and `n` any size. Returns
    /// [`KernelError::Unsupported`] on any device other than compute capability 10.0: the real
    /// body is built for sm_100a only (an sm_103 would run the trapping stub through the
    /// compute_90 PTX). Output poisoned with NaN before the launch.
    ///
    /// The kernel has been compiled but not yet run on an sm_100 device; the GPU test
    /// `nvfp4_gemm_sm100` is what establishes it.
    pub fn nvfp4_gemm_w4a4_sm100(
        &self,
        a: (&[u8], &[u8], f32),
        w: (&[u8], &[u8], f32),
        (m, n, k): (usize, usize, usize),
    ) -> Result<Vec<f32>, KernelError> {
        let (major, minor) = self.ctx.compute_capability()?;
        if (major, minor) != (10, 0) {
            return Err(KernelError::Unsupported(format!(
                "the tcgen05 block-scaled FP4 MMA kernel is built for sm_100a (this device is \
                 sm_{major}{minor})"
            )));
        }
        if !k.is_multiple_of(64)
            || a.0.len() != m * k / 2
            || a.1.len() != m * k / 16
            || w.0.len() != n * k / 2
            || w.1.len() != n * k / 16
        {
            return Err(KernelError::Shape(format!("w4a4 gemm {m}x{n}x{k}")));
        }
        let grid = (
            super::grid_dim(n.div_ceil(TILE_N), "gemm columns")?,
            super::grid_dim(m.div_ceil(TILE_M), "gemm rows")?,
        );
        if grid.1 > 65_535 {
            return Err(KernelError::Shape(format!(
                "gemm m = {m} (at most 65535 tiles)"
            )));
        }
        let d_a = self.stream.clone_htod(&non_empty(a.0))?;
        let d_sa = self.stream.clone_htod(&non_empty(a.1))?;
        let d_w = self.stream.clone_htod(&non_empty(w.0))?;
        let d_sw = self.stream.clone_htod(&non_empty(w.1))?;
        let mut d_c = self.stream.clone_htod(&vec![f32::NAN; (m * n).max(1)])?;
        if m > 0 && n > 0 {
            let f = self.gemm_sm100.load_function("nvfp4_gemm_w4a4_sm100")?;
            let (m_arg, n_arg, k_arg) = (m as i64, n as i64, k as i64);
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&d_a)
                .arg(&d_sa)
                .arg(&a.2)
                .arg(&d_w)
                .arg(&d_sw)
                .arg(&w.2)
                .arg(&m_arg)
                .arg(&n_arg)
                .arg(&k_arg)
                .arg(&mut d_c);
            // SAFETY: argument types and order match `nvfp4_gemm_w4a4_sm100`; buffer sizes
            // checked above (the kernel reads whole 16-byte code chunks and 4-byte scale words
            // only inside rows < m / n and K < k, and k is a multiple of 64); the device is
            // sm_100, where the kernel has its real body; its shared memory is static.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid.0, grid.1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let mut c = self.stream.clone_dtoh(&d_c)?;
        c.truncate(m * n);
        Ok(c)
    }
}
