//! Launch wrappers. The driver library is loaded at run time; on a machine without it (or
//! without a device) [`Gpu::open`] returns `Ok(None)` instead of panicking.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule, CudaStream, LaunchConfig, PushKernelArg};

use crate::fatbins;

/// A failure talking to the GPU.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("the CUDA kernels were not compiled into this build (nvcc missing at build time)")]
    NotCompiled,
    #[error("bad shape: {0}")]
    Shape(String),
}

/// One device with the kernels loaded.
#[derive(Debug)]
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    nvfp4: Arc<CudaModule>,
    gemv: Arc<CudaModule>,
    attn: Arc<CudaModule>,
    indexer: Arc<CudaModule>,
}

/// One batch of indexer queries: request `b` has `visible[b]` keys starting at
/// `key_starts[b]` rows into `keys` (`dim` values each).
#[derive(Debug, Clone, Copy)]
pub struct IndexerBatch<'a> {
    /// `[batch, heads, dim]` queries.
    pub q: &'a [f32],
    /// `[batch, heads]` head weights (already scaled by `heads^-0.5`).
    pub w: &'a [f32],
    pub keys: &'a [f32],
    pub key_starts: &'a [i64],
    pub visible: &'a [i32],
    pub heads: usize,
    pub dim: usize,
    pub scale: f32,
    pub top_k: usize,
}

/// Shapes of one decode-attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    /// Row width (`head_dim`), at most 512.
    pub dim: usize,
    /// KV splits per (request, head); more splits than rows leaves some empty.
    pub splits: usize,
    pub scale: f32,
}

impl Gpu {
    /// Device 0, or `None` when no driver or no device is present.
    pub fn open() -> Result<Option<Self>, KernelError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Ok(None);
        }
        if CudaContext::device_count()? < 1 {
            return Ok(None);
        }
        if fatbins::NVFP4_QUANT.is_empty() {
            return Err(KernelError::NotCompiled);
        }
        let ctx = CudaContext::new(0)?;
        let stream = ctx.default_stream();
        let load = |bin: &[u8]| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin.to_vec()));
        let nvfp4 = load(fatbins::NVFP4_QUANT)?;
        let gemv = load(fatbins::NVFP4_GEMV)?;
        let attn = load(fatbins::ATTN_DECODE)?;
        let indexer = load(fatbins::INDEXER)?;
        Ok(Some(Self {
            ctx,
            stream,
            nvfp4,
            gemv,
            attn,
            indexer,
        }))
    }

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
        let d_x = self.stream.clone_htod(x)?;
        let mut d_packed = self.stream.clone_htod(&vec![poison; blocks * 8])?;
        let mut d_scales = self.stream.clone_htod(&vec![poison; blocks])?;
        if blocks > 0 {
            let f = self.nvfp4.load_function("nvfp4_quantize_rows")?;
            let (rows_arg, cols_arg) = (rows as i64, cols as i64);
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&d_x)
                .arg(&rows_arg)
                .arg(&cols_arg)
                .arg(&global_scale)
                .arg(&mut d_packed)
                .arg(&mut d_scales);
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
        Ok((
            self.stream.clone_dtoh(&d_packed)?,
            self.stream.clone_dtoh(&d_scales)?,
        ))
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
        if !cols.is_multiple_of(16)
            || packed.len() != rows * cols / 2
            || scales.len() != rows * cols / 16
            || x.len() != cols
        {
            return Err(KernelError::Shape(format!("nvfp4_gemv {rows}x{cols}")));
        }
        let d_packed = self.stream.clone_htod(packed)?;
        let d_scales = self.stream.clone_htod(scales)?;
        let d_x = self.stream.clone_htod(x)?;
        let mut d_y = self.stream.clone_htod(&vec![f32::NAN; rows])?;
        if rows > 0 {
            let f = self.gemv.load_function("nvfp4_gemv")?;
            let (rows_arg, cols_arg) = (rows as i64, cols as i64);
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&d_packed)
                .arg(&d_scales)
                .arg(&scale_2)
                .arg(&d_x)
                .arg(&rows_arg)
                .arg(&cols_arg)
                .arg(&mut d_y);
            let warps_per_block = 4usize;
            let grid = u32::try_from(rows.div_ceil(warps_per_block))
                .map_err(|_| KernelError::Shape("too many rows".into()))?;
            // SAFETY: argument types and order match the kernel; buffers are sized above.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (32 * warps_per_block as u32, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        Ok(self.stream.clone_dtoh(&d_y)?)
    }

    /// Decode attention with sinks over rows at byte offsets of `pool` (see
    /// `cpu::attn_decode`). `q` is `[batch, heads, dim]`, `starts` has `batch + 1` entries into
    /// `row_offsets`. Output poisoned with NaN before the launch.
    pub fn attn_decode(
        &self,
        q: &[f32],
        pool: &[u8],
        row_offsets: &[i64],
        starts: &[i64],
        sinks: &[f32],
        shape: AttnShape,
    ) -> Result<Vec<f32>, KernelError> {
        let AttnShape {
            heads,
            dim,
            splits,
            scale,
        } = shape;
        let batch = starts.len().saturating_sub(1);
        if dim == 0
            || dim > 512
            || splits == 0
            || sinks.len() != heads
            || q.len() != batch * heads * dim
        {
            return Err(KernelError::Shape(format!(
                "attn_decode batch {batch} heads {heads} dim {dim} splits {splits}"
            )));
        }
        let d_q = self.stream.clone_htod(q)?;
        let d_pool = self.stream.clone_htod(pool)?;
        let d_offsets = self.stream.clone_htod(&if row_offsets.is_empty() {
            vec![0]
        } else {
            row_offsets.to_vec()
        })?;
        let d_starts = self.stream.clone_htod(starts)?;
        let d_sinks = self.stream.clone_htod(sinks)?;
        let parts = batch * heads * splits;
        let mut d_m = self.stream.clone_htod(&vec![f32::NAN; parts.max(1)])?;
        let mut d_l = self.stream.clone_htod(&vec![f32::NAN; parts.max(1)])?;
        let mut d_acc = self
            .stream
            .clone_htod(&vec![f32::NAN; (parts * dim).max(1)])?;
        let mut d_out = self
            .stream
            .clone_htod(&vec![f32::NAN; (batch * heads * dim).max(1)])?;
        if batch > 0 {
            let grid_x =
                u32::try_from(batch * heads).map_err(|_| KernelError::Shape("grid".into()))?;
            let (heads_i, dim_i, splits_i) = (heads as i32, dim as i32, splits as i32);
            let partial = self.attn.load_function("attn_decode_partial")?;
            let mut launch = self.stream.launch_builder(&partial);
            launch
                .arg(&d_q)
                .arg(&d_pool)
                .arg(&d_offsets)
                .arg(&d_starts)
                .arg(&heads_i)
                .arg(&dim_i)
                .arg(&splits_i)
                .arg(&scale)
                .arg(&mut d_m)
                .arg(&mut d_l)
                .arg(&mut d_acc);
            // SAFETY: argument types and order match `attn_decode_partial`; every offset points
            // at a whole row inside `pool` (the caller's contract, checked by the tests).
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid_x, splits as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
            let merge = self.attn.load_function("attn_decode_merge")?;
            let mut launch = self.stream.launch_builder(&merge);
            launch
                .arg(&d_m)
                .arg(&d_l)
                .arg(&d_acc)
                .arg(&d_sinks)
                .arg(&heads_i)
                .arg(&dim_i)
                .arg(&splits_i)
                .arg(&mut d_out);
            // SAFETY: argument types and order match `attn_decode_merge`.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid_x, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let mut out = self.stream.clone_dtoh(&d_out)?;
        out.truncate(batch * heads * dim);
        Ok(out)
    }

    /// Lightning-indexer scores and top-k per request (see `cpu::indexer_topk`): returns, per
    /// request, the chosen key indices in ascending order.
    pub fn indexer_topk(&self, batch: &IndexerBatch<'_>) -> Result<Vec<Vec<usize>>, KernelError> {
        let n = batch.visible.len();
        let max_keys = batch.visible.iter().copied().max().unwrap_or(0).max(1) as usize;
        if batch.q.len() != n * batch.heads * batch.dim
            || batch.w.len() != n * batch.heads
            || batch.key_starts.len() != n
            || batch.top_k == 0
        {
            return Err(KernelError::Shape("indexer_topk".into()));
        }
        let d_q = self.stream.clone_htod(batch.q)?;
        let d_w = self.stream.clone_htod(batch.w)?;
        let d_keys = self.stream.clone_htod(&if batch.keys.is_empty() {
            vec![0.0]
        } else {
            batch.keys.to_vec()
        })?;
        let d_starts = self.stream.clone_htod(batch.key_starts)?;
        let d_visible = self.stream.clone_htod(batch.visible)?;
        let mut d_scores = self.stream.clone_htod(&vec![f32::NAN; n * max_keys])?;
        let mut d_out = self.stream.clone_htod(&vec![i32::MIN; n * batch.top_k])?;
        if n > 0 {
            let (n_i, heads_i, dim_i, k_i) = (
                n as i32,
                batch.heads as i32,
                batch.dim as i32,
                batch.top_k as i32,
            );
            let max_keys_i = max_keys as i64;
            let scores = self.indexer.load_function("indexer_scores")?;
            let mut launch = self.stream.launch_builder(&scores);
            launch
                .arg(&d_q)
                .arg(&d_w)
                .arg(&d_keys)
                .arg(&d_starts)
                .arg(&d_visible)
                .arg(&n_i)
                .arg(&heads_i)
                .arg(&dim_i)
                .arg(&batch.scale)
                .arg(&max_keys_i)
                .arg(&mut d_scores);
            let warps = n * max_keys;
            let grid = u32::try_from((warps * 32).div_ceil(256))
                .map_err(|_| KernelError::Shape("grid".into()))?;
            // SAFETY: argument types and order match `indexer_scores`; buffers sized above.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
            let topk = self.indexer.load_function("indexer_topk")?;
            let mut launch = self.stream.launch_builder(&topk);
            launch
                .arg(&mut d_scores)
                .arg(&d_visible)
                .arg(&max_keys_i)
                .arg(&k_i)
                .arg(&mut d_out);
            // SAFETY: argument types and order match `indexer_topk`.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let out = self.stream.clone_dtoh(&d_out)?;
        Ok(out
            .chunks(batch.top_k)
            .take(n)
            .map(|row| {
                let mut chosen: Vec<usize> = row
                    .iter()
                    .filter(|&&i| i >= 0)
                    .map(|&i| i as usize)
                    .collect();
                chosen.sort_unstable();
                chosen
            })
            .collect())
    }
}
