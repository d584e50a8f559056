//! Launch wrapper of `attn_exact.cu`: decode attention with the engine's bits
//! (`engine::model::attention::attend` per token) over f32 rows at byte offsets of the pool.

use crate::cuda::{kernel, params::Raw};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, grid_dim, non_empty};

/// A launch's device inputs: queries, pool (bytes, or the f32 rows themselves: the kernel
/// addresses it by byte offsets), row offsets, starts, sinks.
pub type ExactAttnInputs<'a, P = u8> = (
    &'a CudaSlice<f32>,
    &'a CudaSlice<P>,
    &'a CudaSlice<i64>,
    &'a CudaSlice<i64>,
    &'a CudaSlice<f32>,
);

impl Gpu {
    /// `attend` for every token: `q` `[tokens, heads, dim]`, token `t`'s keys the f32 rows at
    /// `row_offsets[starts[t]..starts[t + 1]]` (a negative offset makes the token NaN). Checked
    /// first: rising starts, whole rows inside the pool.
    pub fn attn_exact(
        &self,
        q: &[f32],
        pool: &[u8],
        row_offsets: &[i64],
        starts: &[i64],
        sinks: &[f32],
        scale: f32,
    ) -> Result<Vec<f32>, KernelError> {
        let heads = sinks.len();
        let tokens = starts.len().saturating_sub(1);
        let dim = q.len().checked_div(tokens * heads).unwrap_or(0);
        let row = 4 * dim as i64;
        if heads == 0
            || dim == 0
            || q.len() != tokens * heads * dim
            || starts.first() != Some(&0)
            || starts.windows(2).any(|w| w[1] < w[0])
            || starts.last().map(|&s| s as usize) != Some(row_offsets.len())
            || row_offsets
                .iter()
                .any(|&o| o >= 0 && (o % 4 != 0 || o + row > pool.len() as i64))
        {
            return Err(KernelError::Shape(format!(
                "attn_exact: {} query values for {tokens} tokens of {heads} heads; offsets must be \
                 whole aligned f32 rows inside the {}-byte pool",
                q.len(),
                pool.len()
            )));
        }
        let d_q = self.stream.clone_htod(q)?;
        let d_pool = self.stream.clone_htod(&non_empty(pool))?;
        let d_offsets = self.stream.clone_htod(&non_empty(row_offsets))?;
        let d_starts = self.stream.clone_htod(starts)?;
        let d_sinks = self.stream.clone_htod(sinks)?;
        let mut d_out = self.stream.clone_htod(&vec![f32::NAN; q.len()])?;
        let most = starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0) as usize;
        self.launch_attn_exact(
            (
                (&d_q, &d_pool, &d_offsets, &d_starts, &d_sinks),
                engine::paged::layout::RowFormat::F32,
            ),
            (tokens, heads, dim, most),
            scale,
            &mut d_out,
        )?;
        Ok(self.stream.clone_dtoh(&d_out)?)
    }

    /// [`Self::attn_exact`] on device buffers: (queries, pool, offsets, starts, sinks), and
    /// (tokens, heads, dim, the most keys a token has); the pool's rows stored as `rows` says
    /// (f32 values, or the engine's FP8 or bf16 K=V rows, read as the values they stand for).
    pub fn launch_attn_exact<P: cudarc::driver::DeviceRepr>(
        &self,
        ((q, pool, row_offsets, starts, sinks), rows): (
            ExactAttnInputs<'_, P>,
            engine::paged::layout::RowFormat,
        ),
        (tokens, heads, dim, most_keys): (usize, usize, usize, usize),
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if q.len() < tokens * heads * dim || starts.len() < tokens + 1 || sinks.len() < heads {
            return Err(KernelError::Shape("attn_exact buffers".into()));
        }
        // bf16 rows are FP8 rows without e4m3 values (`RowFormat::e4m3_bf16_split`).
        let fp8_nope: i32 = match rows.e4m3_bf16_split(dim) {
            None => -1,
            Some((nope, rope)) if nope + rope == dim => nope as i32,
            Some(_) => {
                return Err(KernelError::Shape(format!(
                    "attn_exact: {rows:?} rows of another width than {dim}"
                )));
            }
        };
        if tokens == 0 {
            return Ok(());
        }
        let smem = u32::try_from(4 * most_keys.max(1))
            .ok()
            .filter(|&b| b <= 96 * 1024)
            .ok_or_else(|| KernelError::Shape(format!("attn_exact: {most_keys} keys")))?;
        let f = self.attn_exact.load_function(kernel::attn_exact::NAME)?;
        if smem > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let (heads_i, dim_i) = (heads as i32, dim as i32);
        let pool_bytes = Raw(pool);
        let mut launch = self.stream.launch_builder(&f);
        kernel::attn_exact::args(
            &mut launch,
            q,
            &pool_bytes,
            row_offsets,
            starts,
            sinks,
            &heads_i,
            &dim_i,
            &scale,
            &fp8_nope,
            out,
        );
        // SAFETY: `attn_exact`'s parameters in order; one float of shared memory per key of
        // the longest token.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(tokens * heads, "token heads")?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: smem,
            })?;
        }
        Ok(())
    }
}
