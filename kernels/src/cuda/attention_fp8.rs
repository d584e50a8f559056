//! Launch wrapper of `attn_decode_fp8.cu`: decode attention with all heads of a request against
//! each tile of its FP8 rows on tensor cores (plan, partials, combine). Buffers are sized by
//! (batch, parts) alone, so a graph can capture the three launches with lengths that change
//! from step to step in device memory.

use crate::cuda::{kernel, params::Raw};
use std::{
    collections::{HashMap, hash_map::Entry},
    sync::{Mutex, PoisonError},
};

use cudarc::driver::{CudaSlice, LaunchConfig, sys::CUfunction_attribute_enum};

use super::{Gpu, KernelError, grid_dim, non_empty};
use crate::attn_fp8::{Fp8AttnShape, THREADS, check_inputs};

/// The plan, the partials and the output of decode attention for a fixed batch and shape.
#[derive(Debug)]
pub struct Fp8AttnScratch {
    batch: usize,
    shape: Fp8AttnShape,
    items: CudaSlice<i64>,
    split_starts: CudaSlice<i32>,
    item_count: CudaSlice<i32>,
    m: CudaSlice<f32>,
    l: CudaSlice<f32>,
    acc: CudaSlice<f32>,
    /// `[batch, heads, nope + rope]` after a launch.
    pub out: CudaSlice<f32>,
}

/// Scratches kept by batch and shape (its scale by bits), each made once: a scratch is 5
/// buffers made and filled from the host (12.6 MB of NaNs for 32 requests of 64 heads).
#[derive(Debug, Default)]
pub struct KeptScratch(Mutex<HashMap<ScratchKey, Fp8AttnScratch>>);

/// A scratch's batch, heads, nope and rope values, scale bits and parts.
type ScratchKey = (usize, usize, usize, usize, u32, usize);

/// The attention's inputs on the device: queries, the rows' pool, their offsets and starts,
/// the sinks.
pub type Fp8AttnInputs<'a, P> = (
    &'a CudaSlice<f32>,
    &'a CudaSlice<P>,
    &'a CudaSlice<i64>,
    &'a CudaSlice<i64>,
    &'a CudaSlice<f32>,
);

impl Gpu {
    /// Decode attention over FP8 rows at byte offsets of `pool` (see `cpu::attn_decode_fp8`,
    /// within `2^-8 · max |row value|` of it). `starts` has `batch + 1` entries into
    /// `row_offsets`; offset -1 is an empty slot, other negative offsets poison their request.
    /// Every input is checked first; outputs and partials are poisoned with NaN.
    pub fn attn_decode_fp8(
        &self,
        q: &[f32],
        pool: &[u8],
        row_offsets: &[i64],
        starts: &[i64],
        sinks: &[f32],
        shape: Fp8AttnShape,
    ) -> Result<Vec<f32>, KernelError> {
        let batch = check_inputs(
            &shape,
            q.len(),
            pool.len(),
            row_offsets,
            starts,
            sinks.len(),
        )?;
        let d_q = self.stream.clone_htod(&non_empty(q))?;
        let d_pool = self.stream.clone_htod(&non_empty(pool))?;
        let d_offsets = self.stream.clone_htod(&non_empty(row_offsets))?;
        let d_starts = self.stream.clone_htod(starts)?;
        let d_sinks = self.stream.clone_htod(sinks)?;
        let mut scratch = self.attn_fp8_scratch(batch, shape)?;
        self.launch_attn_decode_fp8(&d_q, &d_pool, &d_offsets, &d_starts, &d_sinks, &mut scratch)?;
        let mut out = self.stream.clone_dtoh(&scratch.out)?;
        out.truncate(batch * shape.heads * shape.dim());
        Ok(out)
    }

    /// [`Self::launch_attn_decode_fp8`] for `batch` requests into `out`, with the scratch of
    /// that batch and shape from `kept` (poisoned again on the device, so a value the launch
    /// leaves unwritten shows as NaN rather than as the last one's).
    pub fn attn_decode_fp8_kept<P: cudarc::driver::DeviceRepr>(
        &self,
        kept: &KeptScratch,
        (q, pool, offsets, starts, sinks): Fp8AttnInputs<'_, P>,
        (batch, shape): (usize, Fp8AttnShape),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let n = batch * shape.heads * shape.dim();
        if out.len() < n {
            return Err(KernelError::Shape("attn_fast output".into()));
        }
        let key = (
            batch,
            shape.heads,
            shape.nope,
            shape.rope,
            shape.scale.to_bits(),
            shape.parts,
        );
        let mut kept = kept.0.lock().unwrap_or_else(PoisonError::into_inner);
        let scratch = match kept.entry(key) {
            Entry::Occupied(e) => {
                let scratch = e.into_mut();
                for buf in [
                    &mut scratch.m,
                    &mut scratch.l,
                    &mut scratch.acc,
                    &mut scratch.out,
                ] {
                    self.launch_fill_nan(buf)?;
                }
                scratch
            }
            Entry::Vacant(e) => e.insert(self.attn_fp8_scratch(batch, shape)?),
        };
        self.launch_attn_decode_fp8(q, pool, offsets, starts, sinks, scratch)?;
        let mut view = out.slice_mut(0..n);
        Ok(self
            .stream
            .memcpy_dtod(&scratch.out.slice(0..n), &mut view)?)
    }

    /// Plan, partials and output for `batch` requests of `shape`, poisoned with NaN.
    pub fn attn_fp8_scratch(
        &self,
        batch: usize,
        shape: Fp8AttnShape,
    ) -> Result<Fp8AttnScratch, KernelError> {
        shape.check()?;
        let cap = shape.capacity(batch);
        let (heads, dim) = (shape.heads, shape.dim());
        let nan = |n: usize| self.stream.clone_htod(&vec![f32::NAN; n.max(1)]);
        Ok(Fp8AttnScratch {
            batch,
            shape,
            items: self.stream.clone_htod(&vec![-1i64; 3 * cap])?,
            split_starts: self.stream.clone_htod(&vec![0i32; batch + 1])?,
            item_count: self.stream.clone_htod(&[0i32])?,
            m: nan(cap * heads)?,
            l: nan(cap * heads)?,
            acc: nan(cap * heads * dim)?,
            out: nan(batch * heads * dim)?,
        })
    }

    /// The three launches on device buffers; the result is in `scratch.out`. Every
    /// non-negative offset must point at a whole row inside `pool` and `starts` must rise from
    /// 0 (the host wrapper checks both; here they are the caller's contract).
    pub fn launch_attn_decode_fp8<P: cudarc::driver::DeviceRepr>(
        &self,
        q: &CudaSlice<f32>,
        pool: &CudaSlice<P>,
        row_offsets: &CudaSlice<i64>,
        starts: &CudaSlice<i64>,
        sinks: &CudaSlice<f32>,
        scratch: &mut Fp8AttnScratch,
    ) -> Result<(), KernelError> {
        let (batch, shape) = (scratch.batch, scratch.shape);
        shape.check()?;
        let (heads, dim) = (shape.heads, shape.dim());
        let cap = shape.capacity(batch);
        if starts.len() < batch + 1
            || sinks.len() < heads
            || q.len() < batch * heads * dim
            || scratch.items.len() < 3 * cap
            || scratch.m.len() < cap * heads
            || scratch.acc.len() < cap * heads * dim
            || scratch.out.len() < batch * heads * dim
        {
            return Err(KernelError::Shape("attn_decode_fp8 buffers".into()));
        }
        if batch == 0 {
            return Ok(());
        }
        let (batch_i, parts_i) = (
            i32::try_from(batch).map_err(|_| KernelError::Shape("batch".into()))?,
            shape.parts as i32,
        );
        let (heads_i, nope_i, rope_i, dim_i) = (
            heads as i32,
            shape.nope as i32,
            shape.rope as i32,
            dim as i32,
        );
        let plan = self.attn_fp8.load_function(kernel::attn_fp8_plan::NAME)?;
        let mut launch = self.stream.launch_builder(&plan);
        kernel::attn_fp8_plan::args(
            &mut launch,
            starts,
            &batch_i,
            &parts_i,
            &mut scratch.items,
            &mut scratch.split_starts,
            &mut scratch.item_count,
        );
        // SAFETY: argument types and order match `attn_fp8_plan`; `items` holds
        // `batch + parts` items, the most the plan makes.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        let partial = self
            .attn_fp8
            .load_function(kernel::attn_fp8_partial::NAME)?;
        let smem = shape.smem_bytes() as u32;
        partial.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let pool_bytes = Raw(pool);
        let mut launch = self.stream.launch_builder(&partial);
        kernel::attn_fp8_partial::args(
            &mut launch,
            q,
            &pool_bytes,
            row_offsets,
            starts,
            &scratch.items,
            &scratch.item_count,
            &heads_i,
            &nope_i,
            &rope_i,
            &shape.scale,
            &mut scratch.m,
            &mut scratch.l,
            &mut scratch.acc,
        );
        // SAFETY: argument types and order match `attn_fp8_partial`; blocks past the plan's
        // item count return at once; the shared memory is the kernel's layout for `shape`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(cap, "attention work items")?, 1, 1),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: smem,
            })?;
        }
        let combine = self
            .attn_fp8
            .load_function(kernel::attn_fp8_combine::NAME)?;
        let mut launch = self.stream.launch_builder(&combine);
        kernel::attn_fp8_combine::args(
            &mut launch,
            &scratch.m,
            &scratch.l,
            &scratch.acc,
            &scratch.split_starts,
            sinks,
            &heads_i,
            &dim_i,
            &mut scratch.out,
        );
        // SAFETY: argument types and order match `attn_fp8_combine`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(batch * heads, "attention heads")?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}
