//! Launch wrapper of `dense_gemm.cu`: a dense linear (bf16, or FP8 with f32 tile scales) times
//! many activation rows on bf16 tensor cores, K split by [`crate::dense_gemm::splits`] for
//! this device's multiprocessors and the partials summed in split order.

use crate::cuda::{
    kernel,
    params::{Raw, Reads, same},
};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, grid_dim, non_empty};
use crate::{
    arch::Bf16Mma,
    dense_gemm::{DenseRows, TILE, splits},
};

// The wgmma kernels take their WMMA twins' parameters: one launcher each pair.
const _: () = assert!(
    same(
        kernel::dense_gemm_bf16::PARAMS,
        kernel::dense_gemm_bf16_wgmma::PARAMS
    ) && same(
        kernel::dense_gemm_fp8_block::PARAMS,
        kernel::dense_gemm_fp8_block_wgmma::PARAMS
    )
);

/// Threads per block of `dense_gemm_*` and of `sum_splits`.
const GEMM_THREADS: u32 = crate::cuda_constants::dense_gemm::THREADS as u32;
const _: () =
    assert!(crate::cuda_constants::dense_gemm::THREADS == crate::cuda_constants::wgmma::THREADS);
const SUM_THREADS: u32 = 256;

/// A dense weight on the device, in the engine's forms.
#[derive(Debug, Clone, Copy)]
pub enum GemmWeight<'a> {
    /// bf16 bits, two bytes a value.
    Bf16(&'a CudaSlice<u8>),
    /// The same, held as `u16`s.
    Bf16Bits(&'a CudaSlice<u16>),
    /// e4m3 codes and the f32 scale of each 128 x 128 tile (their bytes).
    Fp8Block {
        codes: &'a CudaSlice<u8>,
        scales: &'a CudaSlice<u8>,
    },
}

impl GemmWeight<'_> {
    /// Whether it holds rows `..rows` of `k` values (and their scales).
    fn holds(&self, rows: usize, k: usize) -> bool {
        match *self {
            Self::Bf16(w) => w.len() >= 2 * rows * k,
            Self::Bf16Bits(w) => w.len() >= rows * k,
            Self::Fp8Block { codes, scales } => {
                codes.len() >= rows * k && scales.len() >= 4 * rows.div_ceil(128) * k.div_ceil(128)
            }
        }
    }
}

impl Gpu {
    /// `(splits, columns a split covers)` of an `m x n x k` product on this GPU.
    pub fn dense_gemm_plan(&self, (m, n, k): (usize, usize, usize)) -> (usize, usize) {
        splits(m, n, k, self.multiprocessors)
    }

    /// The partial values an `m x n x k` product needs besides its output (0 when unsplit).
    pub fn dense_gemm_scratch(&self, (m, n, k): (usize, usize, usize)) -> usize {
        match self.dense_gemm_plan((m, n, k)) {
            (1, _) => 0,
            (parts, _) => parts * m * n,
        }
    }

    /// Launches `c = bf16(a) · W[row0..row0 + n]ᵀ` (`a` `[m, k]`, `c` `[m, n]`; see
    /// `crate::dense_gemm::reference`) on the tiles' instruction ([`Gpu::bf16_mma`]). Every
    /// output value is written; `scratch` holds [`Gpu::dense_gemm_scratch`] values.
    pub fn launch_dense_gemm(
        &self,
        w: GemmWeight<'_>,
        row0: usize,
        a: &CudaSlice<f32>,
        (m, n, k): (usize, usize, usize),
        scratch: &mut CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (parts, k_split) = self.dense_gemm_plan((m, n, k));
        let split = parts > 1;
        if !w.holds(row0 + n, k)
            || a.len() < m * k
            || c.len() < m * n
            || (split && scratch.len() < parts * m * n)
        {
            return Err(KernelError::Shape(format!(
                "dense gemm {m}x{n}x{k} at row {row0}, {parts} splits"
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = (
            grid_dim(n.div_ceil(TILE), "dense gemm columns")?,
            grid_dim(m.div_ceil(TILE), "dense gemm rows")?,
            grid_dim(parts, "dense gemm splits")?,
        );
        let (m_arg, row0_arg, n_arg, k_arg, split_arg) =
            (m as i64, row0 as i64, n as i64, k as i64, k_split as i64);
        let out = if split { &mut *scratch } else { &mut *c };
        let wgmma = self.bf16_mma == Bf16Mma::Wgmma;
        let f = self.dense_gemm.load_function(match (w, wgmma) {
            (GemmWeight::Bf16(_) | GemmWeight::Bf16Bits(_), false) => kernel::dense_gemm_bf16::NAME,
            (GemmWeight::Bf16(_) | GemmWeight::Bf16Bits(_), true) => {
                kernel::dense_gemm_bf16_wgmma::NAME
            }
            (GemmWeight::Fp8Block { .. }, false) => kernel::dense_gemm_fp8_block::NAME,
            (GemmWeight::Fp8Block { .. }, true) => kernel::dense_gemm_fp8_block_wgmma::NAME,
        })?;
        let mut launch = self.stream.launch_builder(&f);
        // The weight's bytes, and an FP8 weight's f32 tile scales (held as bytes).
        let (bits, tile_scales);
        let (weight, scales): (&dyn Reads<u8>, Option<&dyn Reads<f32>>) = match w {
            GemmWeight::Bf16(w) => (w, None),
            GemmWeight::Bf16Bits(w) => {
                bits = Raw(w);
                (&bits, None)
            }
            GemmWeight::Fp8Block { codes, scales } => {
                tile_scales = Raw(scales);
                (codes, Some(&tile_scales))
            }
        };
        let (m_p, row0_p, n_p, k_p, split_p) = (&m_arg, &row0_arg, &n_arg, &k_arg, &split_arg);
        match scales {
            None => kernel::dense_gemm_bf16::args(
                &mut launch,
                a,
                m_p,
                weight,
                row0_p,
                n_p,
                k_p,
                split_p,
                out,
            ),
            Some(scales) => kernel::dense_gemm_fp8_block::args(
                &mut launch,
                a,
                m_p,
                weight,
                scales,
                row0_p,
                n_p,
                k_p,
                split_p,
                out,
            ),
        }
        // SAFETY: argument types and order match the kernels; the weight holds rows up to
        // row0 + n of k values (and their scales), `a` m rows of k, the output (or the
        // scratch) every split's m x n values.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: grid,
                block_dim: (GEMM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        if split {
            let count = m * n;
            let (parts_arg, count_arg) = (parts as i64, count as i64);
            let f = self.dense_gemm.load_function(kernel::sum_splits::NAME)?;
            let blocks = grid_dim(count.div_ceil(SUM_THREADS as usize).min(65_535), "sum")?;
            let mut launch = self.stream.launch_builder(&f);
            kernel::sum_splits::args(&mut launch, &*scratch, &parts_arg, &count_arg, c);
            // SAFETY: `scratch` holds `parts` partials of `count` values, `c` `count` values.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (SUM_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        Ok(())
    }

    /// [`Gpu::launch_dense_gemm`] from host buffers: `[m, n]`, poisoned with NaN before the
    /// launch (the tests' entry).
    pub fn dense_gemm(
        &self,
        w: DenseRows<'_>,
        row0: usize,
        a: &[f32],
        (m, n, k): (usize, usize, usize),
    ) -> Result<Vec<f32>, KernelError> {
        let s = &self.stream;
        let d_a = s.clone_htod(&non_empty(a))?;
        let mut d_c = s.clone_htod(&vec![f32::NAN; (m * n).max(1)])?;
        let mut scratch =
            s.clone_htod(&vec![f32::NAN; self.dense_gemm_scratch((m, n, k)).max(1)])?;
        match w {
            DenseRows::Bf16(bytes) => {
                let d_w = s.clone_htod(&non_empty(bytes))?;
                let weight = GemmWeight::Bf16(&d_w);
                self.launch_dense_gemm(weight, row0, &d_a, (m, n, k), &mut scratch, &mut d_c)?;
            }
            DenseRows::Fp8Block { codes, scales } => {
                let bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
                let (d_w, d_s) = (
                    s.clone_htod(&non_empty(codes))?,
                    s.clone_htod(&non_empty(&bytes))?,
                );
                let weight = GemmWeight::Fp8Block {
                    codes: &d_w,
                    scales: &d_s,
                };
                self.launch_dense_gemm(weight, row0, &d_a, (m, n, k), &mut scratch, &mut d_c)?;
            }
        }
        let mut c = s.clone_dtoh(&d_c)?;
        c.truncate(m * n);
        Ok(c)
    }
}
