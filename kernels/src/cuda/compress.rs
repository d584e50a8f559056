//! Launch wrapper of `compress.cu`: closed compressor windows' rows (before norm and rotation)
//! with the engine's bits (`engine::model::compressor::pool_window`).

use crate::cuda::kernel;
use cudarc::driver::LaunchConfig;

use super::{Gpu, KernelError, grid_dim, non_empty};

/// Closed windows of one compressor, on the host: each window's `ratio` slots of `width`
/// projected kv and gate scores (bias added), and with overlap the previous window's Ca slices
/// (`ratio * d` each; `None` before the first window).
#[derive(Debug, Clone, Copy)]
pub struct Windows<'a> {
    pub kv: &'a [f32],
    pub gate: &'a [f32],
    pub prev: &'a [Option<(&'a [f32], &'a [f32])>],
    pub ratio: usize,
    /// Row width (`head_dim`).
    pub d: usize,
    /// Slot width: `d`, or `2 * d` with overlap.
    pub width: usize,
    pub overlap: bool,
}

impl Gpu {
    /// Every window's row, `[windows, d]`.
    pub fn compress_pool(&self, w: &Windows<'_>) -> Result<Vec<f32>, KernelError> {
        let windows = w.prev.len();
        let per = w.ratio * w.width;
        let width_ok = if w.overlap {
            w.width == 2 * w.d
        } else {
            w.width == w.d
        };
        let prev_ok = w
            .prev
            .iter()
            .flatten()
            .all(|(k, g)| k.len() == w.ratio * w.d && g.len() == w.ratio * w.d);
        if w.ratio == 0
            || w.d == 0
            || !width_ok
            || !prev_ok
            || w.kv.len() != windows * per
            || w.gate.len() != windows * per
            || (!w.overlap && w.prev.iter().any(Option::is_some))
        {
            return Err(KernelError::Shape(format!(
                "compress_pool: {windows} windows of {} slots of {} (d {}, overlap {})",
                w.ratio, w.width, w.d, w.overlap
            )));
        }
        let mut prev_kv = vec![0f32; windows * w.ratio * w.d];
        let mut prev_gate = prev_kv.clone();
        let mut has_prev = vec![0i32; windows];
        for (r, p) in w.prev.iter().enumerate() {
            if let Some((k, g)) = p {
                let at = r * w.ratio * w.d;
                prev_kv[at..at + k.len()].copy_from_slice(k);
                prev_gate[at..at + g.len()].copy_from_slice(g);
                has_prev[r] = 1;
            }
        }
        let d_kv = self.stream.clone_htod(&non_empty(w.kv))?;
        let d_gate = self.stream.clone_htod(&non_empty(w.gate))?;
        let d_pk = self.stream.clone_htod(&non_empty(&prev_kv))?;
        let d_pg = self.stream.clone_htod(&non_empty(&prev_gate))?;
        let d_has = self.stream.clone_htod(&non_empty(&has_prev))?;
        let mut d_out = self
            .stream
            .clone_htod(&vec![f32::NAN; (windows * w.d).max(1)])?;
        if windows > 0 {
            let (windows_i, ratio_i, d_i) = (windows as i32, w.ratio as i32, w.d as i32);
            let (width_i, overlap_i) = (w.width as i64, i32::from(w.overlap));
            let f = self.compress.load_function(kernel::compress_pool::NAME)?;
            let mut launch = self.stream.launch_builder(&f);
            kernel::compress_pool::args(
                &mut launch,
                &d_kv,
                &d_gate,
                &d_pk,
                &d_pg,
                &d_has,
                &windows_i,
                &ratio_i,
                &d_i,
                &width_i,
                &overlap_i,
                &mut d_out,
            );
            // SAFETY: `compress_pool`'s parameters in order; every buffer sized above.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (grid_dim((windows * w.d).div_ceil(128), "channels")?, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let mut out = self.stream.clone_dtoh(&d_out)?;
        out.truncate(windows * w.d);
        Ok(out)
    }
}
