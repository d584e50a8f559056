//! Launch wrappers of `kv_rows.cu`: per-head norm and RoPE of rows, FP8 encoding of K=V rows
//! into the page pool.

use crate::cuda::{kernel, params::RawMut};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, grid_dim, non_empty};
use crate::rows::{NormRope, RowNorm, check_encode};

impl Gpu {
    /// [`crate::rows::norm_rope_rows`] on the device, bit for bit: `x` is
    /// `[rows, heads * head_dim]`, `sin_cos` the rows' rotation values
    /// ([`crate::rows::sin_cos_table`]).
    pub fn norm_rope_rows(
        &self,
        x: &[f32],
        spec: &NormRope<'_>,
        sin_cos: &[f32],
    ) -> Result<Vec<f32>, KernelError> {
        let rows = spec.check(x.len(), sin_cos.len())?;
        let mut d_x = self.stream.clone_htod(&non_empty(x))?;
        let weight = match spec.norm {
            RowNorm::Weighted(w) => w.to_vec(),
            _ => Vec::new(),
        };
        let d_w = self.stream.clone_htod(&non_empty(&weight))?;
        let d_sc = self.stream.clone_htod(&non_empty(sin_cos))?;
        self.launch_norm_rope_rows(&mut d_x, spec, &d_w, &d_sc, rows)?;
        let mut out = self.stream.clone_dtoh(&d_x)?;
        out.truncate(x.len());
        Ok(out)
    }

    /// [`Self::norm_rope_rows`] on device buffers for `rows` rows; `w` is read only for
    /// [`RowNorm::Weighted`] (its values on the device; the spec's slice only gives the mode).
    pub fn launch_norm_rope_rows(
        &self,
        x: &mut CudaSlice<f32>,
        spec: &NormRope<'_>,
        w: &CudaSlice<f32>,
        sin_cos: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        let norm: i32 = match spec.norm {
            RowNorm::None => 0,
            RowNorm::Unweighted => 1,
            RowNorm::Weighted(_) => 2,
        };
        if x.len() < rows * spec.heads * spec.head_dim
            || sin_cos.len() < rows * spec.rope
            || (norm == 2 && w.len() < spec.head_dim)
            || spec.rope > spec.head_dim
        {
            return Err(KernelError::Shape("norm_rope_rows buffers".into()));
        }
        if rows == 0 {
            return Ok(());
        }
        let (heads, head_dim, rope) = (spec.heads as i32, spec.head_dim as i32, spec.rope as i32);
        let inverse = i32::from(spec.inverse);
        let f = self.rows.load_function(kernel::norm_rope_rows::NAME)?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::norm_rope_rows::args(
            &mut launch,
            x,
            &heads,
            &head_dim,
            w,
            &norm,
            &spec.eps,
            sin_cos,
            &rope,
            &inverse,
        );
        // SAFETY: `norm_rope_rows`' parameters in order; buffers checked above.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(rows * spec.heads, "row heads")?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// [`crate::rows::fp8_kv_encode`] on the device: returns `pool` with every row written at
    /// its offset (negative: skipped). Checked first: whole rows inside the pool, no overlap.
    pub fn fp8_kv_encode(
        &self,
        rows: &[f32],
        (nope, rope): (usize, usize),
        pool: &[u8],
        offsets: &[i64],
    ) -> Result<Vec<u8>, KernelError> {
        check_encode(rows.len(), (nope, rope), offsets, pool.len())?;
        let d_rows = self.stream.clone_htod(&non_empty(rows))?;
        let mut d_pool = self.stream.clone_htod(&non_empty(pool))?;
        let d_offsets = self.stream.clone_htod(&non_empty(offsets))?;
        self.launch_fp8_kv_encode(
            &d_rows,
            (nope, rope),
            &mut d_pool,
            &d_offsets,
            offsets.len(),
        )?;
        let mut out = self.stream.clone_dtoh(&d_pool)?;
        out.truncate(pool.len());
        Ok(out)
    }

    /// [`crate::rows::fp8_kv_round`] on the first `count` rows of `rows`, in place.
    pub fn launch_fp8_kv_round(
        &self,
        rows: &mut CudaSlice<f32>,
        (nope, rope): (usize, usize),
        count: usize,
    ) -> Result<(), KernelError> {
        if rows.len() < count * (nope + rope) {
            return Err(KernelError::Shape("fp8_kv_round rows".into()));
        }
        if count == 0 || nope + rope == 0 {
            return Ok(());
        }
        let (nope_i, rope_i) = (nope as i32, rope as i32);
        let f = self.rows.load_function(kernel::fp8_kv_round::NAME)?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::fp8_kv_round::args(&mut launch, rows, &nope_i, &rope_i);
        // SAFETY: `fp8_kv_round`'s parameters in order; 64 threads per row as it expects, the
        // rows checked above.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(count, "fp8_kv_round rows")?, 1, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// [`Self::fp8_kv_encode`] on device buffers for `count` rows; offsets are the caller's
    /// contract here (inside the pool, not overlapping).
    pub fn launch_fp8_kv_encode<P: cudarc::driver::DeviceRepr>(
        &self,
        rows: &CudaSlice<f32>,
        (nope, rope): (usize, usize),
        pool: &mut CudaSlice<P>,
        offsets: &CudaSlice<i64>,
        count: usize,
    ) -> Result<(), KernelError> {
        if rows.len() < count * (nope + rope) || offsets.len() < count {
            return Err(KernelError::Shape("fp8_kv_encode buffers".into()));
        }
        if count == 0 {
            return Ok(());
        }
        let (nope_i, rope_i) = (nope as i32, rope as i32);
        let f = self.rows.load_function(kernel::fp8_kv_encode::NAME)?;
        let mut pool_bytes = RawMut(pool);
        let mut launch = self.stream.launch_builder(&f);
        kernel::fp8_kv_encode::args(
            &mut launch,
            rows,
            &nope_i,
            &rope_i,
            &mut pool_bytes,
            offsets,
        );
        // SAFETY: `fp8_kv_encode`'s parameters in order; 64 threads per row as it expects.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(count, "rows")?, 1, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}

impl Gpu {
    /// Every value of `x` NaN (`fill_nan`, on the device).
    pub fn launch_fill_nan(&self, x: &mut CudaSlice<f32>) -> Result<(), KernelError> {
        let n = x.len();
        self.launch_fill_nan_first(x, n)
    }

    /// The first `n` values of `x` NaN (at most its length).
    pub fn launch_fill_nan_first(
        &self,
        x: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        let n = n.min(x.len());
        let f = self.moe_align.load_function(kernel::fill_nan::NAME)?;
        let grid = grid_dim(n.div_ceil(256).max(1), "values")?;
        let n_arg = n as i64;
        let mut launch = self.stream.launch_builder(&f);
        kernel::fill_nan::args(&mut launch, x, &n_arg);
        // SAFETY: `fill_nan(float*, long long)` over the first `n` values, `n` within `x`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// `argmax_rows` (step.cu) on device buffers: for each of `rows` rows of `width` values,
    /// `out[2r]` the index of its largest finite value (ties to the lowest) and `out[2r + 1]`
    /// that of its first value that is not finite, or -1.
    pub fn launch_argmax_rows(
        &self,
        x: &CudaSlice<f32>,
        (rows, width): (usize, usize),
        out: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        if x.len() < rows * width || out.len() < 2 * rows || width > i32::MAX as usize {
            return Err(KernelError::Shape("argmax_rows buffers".into()));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.step.load_function(kernel::argmax_rows::NAME)?;
        let width_l = width as i64;
        let mut launch = self.stream.launch_builder(&f);
        kernel::argmax_rows::args(&mut launch, x, &width_l, out);
        // SAFETY: `argmax_rows(const float*, long long, int*)`: a block of 256 threads per row
        // (its shared arrays are 256 long), `x` holds `rows * width` values, `out` `2 * rows`.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(rows, "rows")?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}
