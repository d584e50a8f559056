//! Launch wrapper of the grouped routed-expert GEMM for prefill chunks: `moe_align.cu` groups
//! the pairs by expert on the device, `nvfp4_grouped_gemm_bf16` / `mxfp4_grouped_gemm_bf16`
//! multiplies each expert's tiles.
//! Every buffer is sized by (pairs, experts) alone, so a graph can capture the launches with a
//! routing that changes from step to step in device memory.

use crate::cuda::{kernel, params::same};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, grid_dim, non_empty};
use crate::{
    arch::Bf16Mma,
    moe_group::{TILE_ROWS, check, max_tiles},
};

// The wgmma kernels take their WMMA twins' parameters: one launcher each pair.
const _: () = assert!(
    same(
        kernel::nvfp4_grouped_gemm_bf16::PARAMS,
        kernel::nvfp4_grouped_gemm_bf16_wgmma::PARAMS
    ) && same(
        kernel::mxfp4_grouped_gemm_bf16::PARAMS,
        kernel::mxfp4_grouped_gemm_bf16_wgmma::PARAMS
    )
);

/// The grouping buffers for up to `pairs` pairs over `experts` experts.
#[derive(Debug)]
pub struct MoeGrouping {
    pairs: usize,
    experts: usize,
    counts: CudaSlice<i32>,
    cursor: CudaSlice<i32>,
    tile_starts: CudaSlice<i32>,
    tile_expert: CudaSlice<i32>,
    tile_count: CudaSlice<i32>,
    sorted_pair: CudaSlice<i32>,
}

/// Stacked FP4 experts on the device, `[experts, n, k]`: NVFP4 (e4m3 scales per 16 and a
/// global scale per expert) or MXFP4 (ue8m0 scales per 32, no global scale).
#[derive(Debug, Clone, Copy)]
pub struct DeviceStack<'a> {
    pub packed: &'a CudaSlice<u8>,
    pub scales: &'a CudaSlice<u8>,
    /// NVFP4's global scale per expert; `None` for MXFP4.
    pub scale_2: Option<&'a CudaSlice<f32>>,
    pub experts: usize,
    pub n: usize,
    pub k: usize,
}

fn blocks(count: usize, per: usize) -> Result<u32, KernelError> {
    grid_dim(count.div_ceil(per).max(1), "moe grouping")
}

impl Gpu {
    /// The routed experts of a prefill chunk (see `cpu::grouped_gemm`): pair `p` multiplies
    /// token `pair_token[p]` of `a` (`[tokens, k]`) by expert `pair_expert[p]` of the NVFP4
    /// stack; `[pairs, n]`, a NaN row for an expert outside the stack. Inputs checked first.
    #[expect(
        clippy::too_many_arguments,
        reason = "the chunk, its routing and the stack"
    )]
    pub fn nvfp4_grouped_gemm(
        &self,
        a: &[f32],
        pair_token: &[i32],
        pair_expert: &[i32],
        (packed, scales, scale_2): (&[u8], &[u8], &[f32]),
        tokens: usize,
        n: usize,
        k: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let stack = (packed, scales, Some(scale_2), scale_2.len());
        self.grouped_gemm_host(a, (pair_token, pair_expert), stack, (tokens, n, k))
    }

    /// The same over `experts` stacked MXFP4 experts (codes, ue8m0 scales per 32; see
    /// `cpu::mxfp4_gemm` per pair).
    pub fn mxfp4_grouped_gemm(
        &self,
        a: &[f32],
        (pair_token, pair_expert): (&[i32], &[i32]),
        (packed, scales, experts): (&[u8], &[u8], usize),
        (tokens, n, k): (usize, usize, usize),
    ) -> Result<Vec<f32>, KernelError> {
        let stack = (packed, scales, None, experts);
        self.grouped_gemm_host(a, (pair_token, pair_expert), stack, (tokens, n, k))
    }

    fn grouped_gemm_host(
        &self,
        a: &[f32],
        (pair_token, pair_expert): (&[i32], &[i32]),
        (packed, scales, scale_2, experts): (&[u8], &[u8], Option<&[f32]>, usize),
        (tokens, n, k): (usize, usize, usize),
    ) -> Result<Vec<f32>, KernelError> {
        let pairs = pair_token.len();
        if pair_expert.len() != pairs {
            return Err(KernelError::Shape("grouped gemm: pair lists differ".into()));
        }
        check(
            (tokens, pairs, experts),
            (n, k),
            pair_token,
            (a.len(), packed.len(), scales.len()),
            scale_2.map(<[f32]>::len),
        )?;
        let d_a = self.stream.clone_htod(&non_empty(a))?;
        let d_token = self.stream.clone_htod(&non_empty(pair_token))?;
        let d_expert = self.stream.clone_htod(&non_empty(pair_expert))?;
        let d_packed = self.stream.clone_htod(packed)?;
        let d_scales = self.stream.clone_htod(scales)?;
        let d_scale_2 = scale_2.map(|s| self.stream.clone_htod(s)).transpose()?;
        let mut grouping = self.moe_grouping(pairs, experts)?;
        let mut out = self.stream.clone_htod(&vec![0.0f32; (pairs * n).max(1)])?;
        let stack = DeviceStack {
            packed: &d_packed,
            scales: &d_scales,
            scale_2: d_scale_2.as_ref(),
            experts,
            n,
            k,
        };
        self.launch_grouped_gemm(&d_a, &d_token, &d_expert, &stack, &mut grouping, &mut out)?;
        let mut out = self.stream.clone_dtoh(&out)?;
        out.truncate(pairs * n);
        Ok(out)
    }

    /// Grouping buffers for up to `pairs` pairs over `experts` experts.
    pub fn moe_grouping(&self, pairs: usize, experts: usize) -> Result<MoeGrouping, KernelError> {
        let tiles = max_tiles(pairs, experts);
        let zeros = |n: usize| self.stream.clone_htod(&vec![0i32; n.max(1)]);
        Ok(MoeGrouping {
            pairs,
            experts,
            counts: zeros(experts)?,
            cursor: zeros(experts)?,
            tile_starts: zeros(experts + 1)?,
            tile_expert: zeros(tiles)?,
            tile_count: zeros(1)?,
            sorted_pair: self
                .stream
                .clone_htod(&vec![-1i32; (tiles * TILE_ROWS).max(1)])?,
        })
    }

    /// `kept`'s grouping for `pairs` pairs over `experts` experts where its buffers hold them
    /// (each launch rewrites every entry it reads), a new one there otherwise: a step's many
    /// grouped GEMMs make their buffers once, not six small uploads each.
    pub fn moe_grouping_kept<'k>(
        &self,
        kept: &'k mut Option<MoeGrouping>,
        pairs: usize,
        experts: usize,
    ) -> Result<&'k mut MoeGrouping, KernelError> {
        let fits = kept.as_ref().is_some_and(|g| {
            g.experts == experts && max_tiles(pairs, experts) <= g.tile_expert.len()
        });
        if !fits {
            *kept = Some(self.moe_grouping(pairs, experts)?);
        }
        let g = kept
            .as_mut()
            .ok_or_else(|| KernelError::Shape("moe grouping: none kept".into()))?;
        g.pairs = pairs;
        Ok(g)
    }

    /// The grouping and the grouped GEMM on device buffers: `out` (`[pairs, n]`) is filled with
    /// NaN first, so a pair routed outside the stack shows. Tokens of `pair_token` must lie in
    /// `a` (the host wrapper checks; here it is the caller's contract).
    pub fn launch_grouped_gemm(
        &self,
        a: &CudaSlice<f32>,
        pair_token: &CudaSlice<i32>,
        pair_expert: &CudaSlice<i32>,
        stack: &DeviceStack<'_>,
        g: &mut MoeGrouping,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (pairs, experts) = (g.pairs, g.experts);
        let (n, k) = (stack.n, stack.k);
        let block = if stack.scale_2.is_some() { 16 } else { 32 };
        if experts != stack.experts
            || !k.is_multiple_of(block)
            || n == 0
            || pair_token.len() < pairs
            || pair_expert.len() < pairs
            || out.len() < pairs * n
            || stack.packed.len() < experts * n * k / 2
            || stack.scales.len() < experts * n * k / block
            || stack.scale_2.is_some_and(|s| s.len() < experts)
        {
            return Err(KernelError::Shape(format!(
                "grouped gemm: {pairs} pairs, {experts} experts of {n}x{k}"
            )));
        }
        if pairs == 0 {
            return Ok(());
        }
        let (pairs_i, experts_i) = (pairs as i32, experts as i32);
        self.launch_fill_nan_first(out, pairs * n)?;
        let zero = self.moe_align.load_function(kernel::moe_zero::NAME)?;
        let mut launch = self.stream.launch_builder(&zero);
        kernel::moe_zero::args(&mut launch, &mut g.counts, &experts_i);
        // SAFETY: `moe_zero(int*, int)`; `counts` holds `experts`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(experts as u32))? };
        let count = self.moe_align.load_function(kernel::moe_count::NAME)?;
        let mut launch = self.stream.launch_builder(&count);
        kernel::moe_count::args(
            &mut launch,
            pair_expert,
            &pairs_i,
            &experts_i,
            &mut g.counts,
        );
        let by_pair = LaunchConfig {
            grid_dim: (blocks(pairs, 256)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `moe_count(const int*, int, int, int*)`; sizes from the grouping.
        unsafe { launch.launch(by_pair)? };
        let align = self.moe_align.load_function(kernel::moe_align::NAME)?;
        let mut launch = self.stream.launch_builder(&align);
        kernel::moe_align::args(
            &mut launch,
            &g.counts,
            &experts_i,
            &mut g.tile_starts,
            &mut g.tile_expert,
            &mut g.tile_count,
            &mut g.cursor,
            &mut g.sorted_pair,
        );
        // SAFETY: `moe_align`'s parameters in order; `tile_expert` and `sorted_pair` hold the
        // most tiles `pairs` pairs can make (`max_tiles`).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        let scatter = self.moe_align.load_function(kernel::moe_scatter::NAME)?;
        let mut launch = self.stream.launch_builder(&scatter);
        kernel::moe_scatter::args(
            &mut launch,
            pair_expert,
            &pairs_i,
            &experts_i,
            &g.tile_starts,
            &mut g.cursor,
            &mut g.sorted_pair,
        );
        // SAFETY: `moe_scatter`'s parameters in order; slots within the aligned tiles.
        unsafe { launch.launch(by_pair)? };
        let wgmma = self.bf16_mma() == Bf16Mma::Wgmma;
        let gemm = self.gemm.load_function(match (stack.scale_2, wgmma) {
            (Some(_), false) => kernel::nvfp4_grouped_gemm_bf16::NAME,
            (None, false) => kernel::mxfp4_grouped_gemm_bf16::NAME,
            (Some(_), true) => kernel::nvfp4_grouped_gemm_bf16_wgmma::NAME,
            (None, true) => kernel::mxfp4_grouped_gemm_bf16_wgmma::NAME,
        })?;
        let (n_i, k_i) = (n as i64, k as i64);
        let mut launch = self.stream.launch_builder(&gemm);
        let tiles = (&g.sorted_pair, &g.tile_expert, &g.tile_count);
        let (sorted, tile_expert, tile_count) = tiles;
        let (packed, scales) = (stack.packed, stack.scales);
        match stack.scale_2 {
            Some(scale_2) => kernel::nvfp4_grouped_gemm_bf16::args(
                &mut launch,
                a,
                pair_token,
                sorted,
                tile_expert,
                tile_count,
                packed,
                scales,
                scale_2,
                &n_i,
                &k_i,
                out,
            ),
            None => kernel::mxfp4_grouped_gemm_bf16::args(
                &mut launch,
                a,
                pair_token,
                sorted,
                tile_expert,
                tile_count,
                packed,
                scales,
                &n_i,
                &k_i,
                out,
            ),
        }
        let column_blocks = grid_dim(n.div_ceil(64), "grouped gemm columns")?;
        if column_blocks > 65_535 {
            return Err(KernelError::Shape(format!("grouped gemm n = {n}")));
        }
        // SAFETY: the chosen kernel's parameters in order (its typed launcher); blocks past
        // the tile count return at once.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (
                    grid_dim(max_tiles(pairs, experts), "tiles")?,
                    column_blocks,
                    1,
                ),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}
