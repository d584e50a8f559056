//! Launch wrappers of the attention kernels: split-KV decode attention and the lightning
//! indexer.

use crate::cuda::{kernel, params::same};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, grid_dim, non_empty};
use crate::step::kernels::ScoreSpec;

// One launcher for both: their parameters are the same (checked when compiling).
const _: () = assert!(same(
    kernel::indexer_scores::PARAMS,
    kernel::indexer_scores_mma::PARAMS
));

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

/// Split partials and output of decode attention for a fixed batch (see
/// [`Gpu::attn_scratch`]).
#[derive(Debug)]
pub struct AttnScratch {
    batch: usize,
    m: CudaSlice<f32>,
    l: CudaSlice<f32>,
    acc: CudaSlice<f32>,
    /// `[batch, heads, dim]` after a launch.
    pub out: CudaSlice<f32>,
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

impl AttnShape {
    /// Checks the shape against a batch, a number of sinks and the query length.
    fn check(&self, batch: usize, sinks: usize, q_len: usize) -> Result<(), KernelError> {
        if self.dim == 0
            || self.dim > 512
            || self.heads == 0
            || self.splits == 0
            || self.splits > 65_535
            || sinks != self.heads
            || q_len != batch * self.heads * self.dim
        {
            return Err(KernelError::Shape(format!(
                "attn_decode batch {batch} heads {} dim {} splits {}",
                self.heads, self.dim, self.splits
            )));
        }
        Ok(())
    }
}

impl Gpu {
    /// Decode attention with sinks over rows at byte offsets of `pool` (see
    /// `cpu::attn_decode`). `q` is `[batch, heads, dim]`, `starts` has `batch + 1` entries into
    /// `row_offsets`. Output and partials poisoned with NaN before the launch.
    pub fn attn_decode(
        &self,
        q: &[f32],
        pool: &[u8],
        row_offsets: &[i64],
        starts: &[i64],
        sinks: &[f32],
        shape: AttnShape,
    ) -> Result<Vec<f32>, KernelError> {
        let batch = starts.len().saturating_sub(1);
        shape.check(batch, sinks.len(), q.len())?;
        let d_q = self.stream.clone_htod(&non_empty(q))?;
        let d_pool = self.stream.clone_htod(&non_empty(pool))?;
        let d_offsets = self.stream.clone_htod(&non_empty(row_offsets))?;
        let d_starts = self.stream.clone_htod(&non_empty(starts))?;
        let d_sinks = self.stream.clone_htod(&non_empty(sinks))?;
        let mut scratch = self.attn_scratch(batch, shape)?;
        self.launch_attn_decode(
            &d_q,
            &d_pool,
            &d_offsets,
            &d_starts,
            &d_sinks,
            shape,
            &mut scratch,
        )?;
        let mut out = self.stream.clone_dtoh(&scratch.out)?;
        out.truncate(batch * shape.heads * shape.dim);
        Ok(out)
    }

    /// Split partials and output for `batch` requests of `shape`, poisoned with NaN.
    pub fn attn_scratch(&self, batch: usize, shape: AttnShape) -> Result<AttnScratch, KernelError> {
        let parts = batch * shape.heads * shape.splits;
        let nan = |n: usize| self.stream.clone_htod(&vec![f32::NAN; n.max(1)]);
        Ok(AttnScratch {
            batch,
            m: nan(parts)?,
            l: nan(parts)?,
            acc: nan(parts * shape.dim)?,
            out: nan(batch * shape.heads * shape.dim)?,
        })
    }

    /// Launches decode attention on device buffers; the result is in `scratch.out`
    /// (`[batch, heads, dim]`). Every offset must point at a whole row inside `pool`.
    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per kernel parameter"
    )]
    pub fn launch_attn_decode(
        &self,
        q: &CudaSlice<f32>,
        pool: &CudaSlice<u8>,
        row_offsets: &CudaSlice<i64>,
        starts: &CudaSlice<i64>,
        sinks: &CudaSlice<f32>,
        shape: AttnShape,
        scratch: &mut AttnScratch,
    ) -> Result<(), KernelError> {
        let AttnShape {
            heads,
            dim,
            splits,
            scale,
        } = shape;
        let batch = scratch.batch;
        shape.check(batch, heads, batch * heads * dim)?;
        let parts = batch * heads * splits;
        if starts.len() < batch + 1
            || sinks.len() < heads
            || q.len() < batch * heads * dim
            || scratch.m.len() < parts
            || scratch.l.len() < parts
            || scratch.acc.len() < parts * dim
            || scratch.out.len() < batch * heads * dim
        {
            return Err(KernelError::Shape("attn_decode buffers".into()));
        }
        if batch == 0 {
            return Ok(());
        }
        let grid_x = super::grid_dim(batch * heads, "attention heads")?;
        let (heads_i, dim_i, splits_i) = (heads as i32, dim as i32, splits as i32);
        let partial = self.attn.load_function(kernel::attn_decode_partial::NAME)?;
        let mut launch = self.stream.launch_builder(&partial);
        kernel::attn_decode_partial::args(
            &mut launch,
            q,
            pool,
            row_offsets,
            starts,
            &heads_i,
            &dim_i,
            &splits_i,
            &scale,
            &mut scratch.m,
            &mut scratch.l,
            &mut scratch.acc,
        );
        // SAFETY: argument types and order match `attn_decode_partial`; every offset points
        // at a whole row inside `pool` (the caller's contract, checked by the tests).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_x, splits as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        let merge = self.attn.load_function(kernel::attn_decode_merge::NAME)?;
        let mut launch = self.stream.launch_builder(&merge);
        kernel::attn_decode_merge::args(
            &mut launch,
            &scratch.m,
            &scratch.l,
            &scratch.acc,
            sinks,
            &heads_i,
            &dim_i,
            &splits_i,
            &mut scratch.out,
        );
        // SAFETY: argument types and order match `attn_decode_merge`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_x, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// `indexer_scores` (the engine's bits) or, with `sp.tensor_cores`, `indexer_scores_mma`
    /// over f32 key rows (token t's at rows `starts[t]..`), `[tokens, max_keys]` written for
    /// each token's visible keys. The caller keeps the rows inside `keys`.
    pub fn launch_indexer_scores(
        &self,
        (q, w, keys): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        (starts, visible): (&CudaSlice<i64>, &CudaSlice<i32>),
        sp: ScoreSpec,
        scores: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (n, heads, dim) = (sp.tokens as i32, sp.heads as i32, sp.dim as i32);
        let max_keys = sp.max_keys as i64;
        if sp.tokens == 0 {
            return Ok(());
        }
        let config = if sp.tensor_cores {
            crate::indexer_mma::check_shape(sp.heads, sp.dim)?;
            let (groups, tokens) = crate::indexer_mma::grid(&sp);
            LaunchConfig {
                grid_dim: (
                    grid_dim(groups, "key groups")?,
                    grid_dim(tokens, "tokens")?,
                    1,
                ),
                block_dim: (crate::indexer_mma::THREADS as u32, 1, 1),
                shared_mem_bytes: crate::indexer_mma::shared_bytes(sp.heads, sp.dim) as u32,
            }
        } else {
            // A group of eight threads per (token, key).
            LaunchConfig {
                grid_dim: (
                    grid_dim((sp.tokens * sp.max_keys * 8).div_ceil(256).max(1), "keys")?,
                    1,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            }
        };
        let f = self.indexer.load_function(if sp.tensor_cores {
            kernel::indexer_scores_mma::NAME
        } else {
            kernel::indexer_scores::NAME
        })?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::indexer_scores::args(
            &mut launch,
            q,
            w,
            keys,
            starts,
            visible,
            &n,
            &heads,
            &dim,
            &sp.scale,
            &max_keys,
            scores,
        );
        // SAFETY: both kernels take these parameters in this order; each token's rows inside
        // `keys` (the caller's check), `scores` `tokens * max_keys`; the tensor-core kernel's
        // shared memory as `indexer_mma::shared_bytes` sizes it.
        unsafe { launch.launch(config)? };
        Ok(())
    }

    /// [`Gpu::launch_indexer_scores`] on the tensor cores from host buffers (the tests' and
    /// kernel-bench's entry): `[tokens, max_keys]`, NaN where no score is written.
    pub fn indexer_scores_mma(
        &self,
        x: &crate::indexer_mma::ScoreInputs<'_>,
        sp: ScoreSpec,
    ) -> Result<Vec<f32>, KernelError> {
        crate::indexer_mma::check(x, &sp)?;
        let s = &self.stream;
        let (q, w) = (
            s.clone_htod(&non_empty(x.q))?,
            s.clone_htod(&non_empty(x.w))?,
        );
        let keys = s.clone_htod(&non_empty(x.keys))?;
        let (starts, visible) = (
            s.clone_htod(&non_empty(x.starts))?,
            s.clone_htod(&non_empty(x.visible))?,
        );
        let mut scores = s.clone_htod(&vec![f32::NAN; (sp.tokens * sp.max_keys).max(1)])?;
        let sp = ScoreSpec {
            tensor_cores: true,
            ..sp
        };
        self.launch_indexer_scores((&q, &w, &keys), (&starts, &visible), sp, &mut scores)?;
        let mut out = s.clone_dtoh(&scores)?;
        out.truncate(sp.tokens * sp.max_keys);
        Ok(out)
    }

    /// Lightning-indexer scores and top-k per request (see `cpu::indexer_topk`): returns, per
    /// request, the chosen key indices in ascending order, or `None` where a visible score is
    /// NaN (no selection is defined).
    pub fn indexer_topk(
        &self,
        batch: &IndexerBatch<'_>,
    ) -> Result<Vec<Option<Vec<usize>>>, KernelError> {
        let n = batch.visible.len();
        crate::emulate::check_indexer_batch(
            batch.q.len(),
            batch.w.len(),
            batch.keys.len(),
            batch.key_starts,
            batch.visible,
            (batch.heads, batch.dim, batch.top_k),
        )
        .map_err(KernelError::Shape)?;
        let max_keys = batch.visible.iter().copied().max().unwrap_or(0).max(1) as usize;
        let d_q = self.stream.clone_htod(batch.q)?;
        let d_w = self.stream.clone_htod(batch.w)?;
        // At least one whole row: groups without a key read the first row (their dot is
        // thrown away, but every thread of a warp takes part in the shuffles).
        let d_keys = self.stream.clone_htod(&if batch.keys.is_empty() {
            vec![0.0; batch.dim]
        } else {
            batch.keys.to_vec()
        })?;
        let d_starts = self.stream.clone_htod(batch.key_starts)?;
        let d_visible = self.stream.clone_htod(batch.visible)?;
        let mut d_scores = self.stream.clone_htod(&vec![f32::NAN; n * max_keys])?;
        let mut d_out = self.stream.clone_htod(&vec![i32::MIN; n * batch.top_k])?;
        if n > 0 {
            let spec = ScoreSpec {
                tokens: n,
                heads: batch.heads,
                dim: batch.dim,
                scale: batch.scale,
                max_keys,
                tensor_cores: false,
            };
            let (inputs, rows) = ((&d_q, &d_w, &d_keys), (&d_starts, &d_visible));
            self.launch_indexer_scores(inputs, rows, spec, &mut d_scores)?;
            let (max_keys_i, k_i) = (max_keys as i64, batch.top_k as i32);
            let topk = self.indexer.load_function(kernel::indexer_topk::NAME)?;
            let mut launch = self.stream.launch_builder(&topk);
            kernel::indexer_topk::args(
                &mut launch,
                &d_scores,
                &d_visible,
                &max_keys_i,
                &k_i,
                &mut d_out,
            );
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
                if row.contains(&crate::emulate::TOPK_POISONED) {
                    return None;
                }
                let mut chosen: Vec<usize> = row
                    .iter()
                    .filter(|&&i| i >= 0)
                    .map(|&i| i as usize)
                    .collect();
                chosen.sort_unstable();
                Some(chosen)
            })
            .collect())
    }
}
