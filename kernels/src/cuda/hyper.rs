//! Launch wrappers of `hyper.cu`: the hyper-connections' mixing on the device, bit for bit as
//! `engine::model::hyper` computes it from the mixing projections' outputs, and `exact::exp`.

use crate::cuda::kernel;
use cudarc::driver::LaunchConfig;
use engine::weights::{HeadWeights, HyperWeights};

use super::{Gpu, KernelError, grid_dim, non_empty};

/// The most streams the kernels take (`MAX_HC`).
pub const MAX_HC: usize = crate::cuda_constants::hyper::MAX_HC;

/// The mixing weights and collapsed input of every token from [`Gpu::hyper_pre`].
#[derive(Debug, Clone, PartialEq)]
pub struct HyperPre {
    /// `[tokens, dim]`.
    pub collapsed: Vec<f32>,
    /// `[tokens, hc]`.
    pub post: Vec<f32>,
    /// `[tokens, hc * hc]`.
    pub comb: Vec<f32>,
}

/// Streams and model constants of a hyper-connection launch.
#[derive(Debug, Clone, Copy)]
pub struct Streams {
    pub hc: usize,
    pub dim: usize,
    pub eps: f32,
    pub sinkhorn_iters: usize,
}

impl Streams {
    fn check(&self, x: usize, per_token: usize, other: usize) -> Result<usize, KernelError> {
        let tokens = x / (self.hc * self.dim).max(1);
        if self.hc == 0
            || self.hc > MAX_HC
            || self.dim == 0
            || x != tokens * self.hc * self.dim
            || other != tokens * per_token
        {
            return Err(KernelError::Shape(format!(
                "hyper-connections: {x} stream values and {other} per-token values for hc {} \
                 (1..={MAX_HC}) and dim {}",
                self.hc, self.dim
            )));
        }
        Ok(tokens)
    }
}

fn per_token(tokens: usize) -> Result<LaunchConfig, KernelError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(tokens, "tokens")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl Gpu {
    /// `hyper::pre_from_mixes` for every token: `x` is `[tokens, hc * dim]`, `mixes`
    /// `[tokens, (2 + hc) * hc]`.
    pub fn hyper_pre(
        &self,
        x: &[f32],
        mixes: &[f32],
        w: &HyperWeights,
        s: Streams,
    ) -> Result<HyperPre, KernelError> {
        let width = (2 + s.hc) * s.hc;
        let tokens = s.check(x.len(), width, mixes.len())?;
        if w.base.len() != width {
            return Err(KernelError::Shape("hyper_pre: base".into()));
        }
        let nan = |n: usize| self.stream.clone_htod(&vec![f32::NAN; n.max(1)]);
        let (mut collapsed, mut post, mut comb) = (
            nan(tokens * s.dim)?,
            nan(tokens * s.hc)?,
            nan(tokens * s.hc * s.hc)?,
        );
        if tokens > 0 {
            let d_x = self.stream.clone_htod(x)?;
            let d_m = self.stream.clone_htod(mixes)?;
            let d_scale = self.stream.clone_htod(&w.scale)?;
            let d_base = self.stream.clone_htod(&w.base)?;
            let (hc, dim, iters) = (s.hc as i32, s.dim as i64, s.sinkhorn_iters as i32);
            let f = self.hyper.load_function(kernel::hyper_pre::NAME)?;
            let mut launch = self.stream.launch_builder(&f);
            kernel::hyper_pre::args(
                &mut launch,
                &d_x,
                &d_m,
                &d_scale,
                &d_base,
                &hc,
                &dim,
                &s.eps,
                &iters,
                &mut collapsed,
                &mut post,
                &mut comb,
            );
            // SAFETY: `hyper_pre`'s parameters in order; shapes checked above.
            unsafe { launch.launch(per_token(tokens)?)? };
        }
        let get = |buf, n| -> Result<Vec<f32>, KernelError> {
            let mut v = self.stream.clone_dtoh(buf)?;
            v.truncate(n);
            Ok(v)
        };
        Ok(HyperPre {
            collapsed: get(&collapsed, tokens * s.dim)?,
            post: get(&post, tokens * s.hc)?,
            comb: get(&comb, tokens * s.hc * s.hc)?,
        })
    }

    /// `hyper::post` for every token: `x` `[tokens, hc * dim]`, `y` `[tokens, dim]`, `post`
    /// and `comb` as [`Self::hyper_pre`] returns them.
    pub fn hyper_post(
        &self,
        x: &[f32],
        y: &[f32],
        post: &[f32],
        comb: &[f32],
        s: Streams,
    ) -> Result<Vec<f32>, KernelError> {
        let tokens = s.check(x.len(), s.dim, y.len())?;
        s.check(x.len(), s.hc, post.len())?;
        s.check(x.len(), s.hc * s.hc, comb.len())?;
        let mut out = self.stream.clone_htod(&vec![f32::NAN; x.len().max(1)])?;
        if tokens > 0 {
            let (d_x, d_y) = (self.stream.clone_htod(x)?, self.stream.clone_htod(y)?);
            let (d_p, d_c) = (self.stream.clone_htod(post)?, self.stream.clone_htod(comb)?);
            let (hc, dim) = (s.hc as i32, s.dim as i64);
            let f = self.hyper.load_function(kernel::hyper_post::NAME)?;
            let mut launch = self.stream.launch_builder(&f);
            kernel::hyper_post::args(&mut launch, &d_x, &d_y, &d_p, &d_c, &hc, &dim, &mut out);
            // SAFETY: `hyper_post`'s parameters in order; shapes checked above.
            unsafe { launch.launch(per_token(tokens)?)? };
        }
        let mut out = self.stream.clone_dtoh(&out)?;
        out.truncate(x.len());
        Ok(out)
    }

    /// `hyper::head` for every token from the head's mixing projections `mix` (`[tokens, hc]`,
    /// `dot(w.mix.row(i), rms_norm_unweighted(x))`).
    pub fn hyper_head(
        &self,
        x: &[f32],
        mix: &[f32],
        w: &HeadWeights,
        s: Streams,
    ) -> Result<Vec<f32>, KernelError> {
        let tokens = s.check(x.len(), s.hc, mix.len())?;
        if w.base.len() != s.hc {
            return Err(KernelError::Shape("hyper_head: base".into()));
        }
        let mut out = self
            .stream
            .clone_htod(&vec![f32::NAN; (tokens * s.dim).max(1)])?;
        if tokens > 0 {
            let (d_x, d_m) = (self.stream.clone_htod(x)?, self.stream.clone_htod(mix)?);
            let d_base = self.stream.clone_htod(&w.base)?;
            let (hc, dim) = (s.hc as i32, s.dim as i64);
            let f = self.hyper.load_function(kernel::hyper_head::NAME)?;
            let mut launch = self.stream.launch_builder(&f);
            kernel::hyper_head::args(
                &mut launch,
                &d_x,
                &d_m,
                &w.scale,
                &d_base,
                &hc,
                &dim,
                &s.eps,
                &mut out,
            );
            // SAFETY: `hyper_head`'s parameters in order; shapes checked above.
            unsafe { launch.launch(per_token(tokens)?)? };
        }
        let mut out = self.stream.clone_dtoh(&out)?;
        out.truncate(tokens * s.dim);
        Ok(out)
    }

    /// `exact::exp` of every value (the device port of `engine::tensor::exp`).
    pub fn exact_exp(&self, x: &[f32]) -> Result<Vec<f32>, KernelError> {
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let mut d_y = self.stream.clone_htod(&vec![f32::NAN; x.len().max(1)])?;
        if !x.is_empty() {
            let n = x.len() as i64;
            let f = self.hyper.load_function(kernel::exact_exp::NAME)?;
            let mut launch = self.stream.launch_builder(&f);
            kernel::exact_exp::args(&mut launch, &d_x, &n, &mut d_y);
            let blocks = grid_dim(x.len().div_ceil(256), "values")?;
            // SAFETY: `exact_exp(const float*, long long, float*)`; `n` values each.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            }
        }
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(x.len());
        Ok(y)
    }
}
