//! Launch wrapper of the sm_100 (B200) NVFP4 x NVFP4 GEMM on 5th-generation tensor cores
//! (`nvfp4_gemm_sm100.cu`): the same operation as [`Gpu::nvfp4_gemm_w4a4`] (sm_120), through
//! `tcgen05.mma` with the accumulator and the block scales in Tensor Memory.

use super::{Gpu, KernelError};

/// Output tile of `nvfp4_gemm_w4a4_sm100`: `TILE_M` rows of A by `TILE_N` rows of W.
const TILE_M: usize = crate::cuda_constants::nvfp4_gemm_sm100::TILE_M;
const TILE_N: usize = crate::cuda_constants::nvfp4_gemm_sm100::TILE_N;

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
        if crate::arch::fp4_mma(major, minor).map_err(KernelError::Unsupported)?
            != crate::arch::Fp4Mma::Sm100Tcgen05
        {
            return Err(KernelError::Unsupported(format!(
                "this is the sm_100 kernel; on sm_{major}{minor} use nvfp4_gemm_w4a4"
            )));
        }
        // SAFETY: the device is sm_100, where the kernel has its real
        // body; it takes the W4A4 parameter list, 128 threads per 128 x 128 tile and static
        // shared memory (36 KiB).
        unsafe { self.launch_w4a4(super::fp4::W4a4::Sm100, (TILE_M, TILE_N), a, w, (m, n, k)) }
    }
}
