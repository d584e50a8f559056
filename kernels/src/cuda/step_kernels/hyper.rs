//! The hyper-connections kernels' launches (`hyper_pre`, `hyper_post`, `hyper_head` in
//! `hyper.cu`).

use crate::cuda::kernel;
use cudarc::driver::CudaSlice;

use super::{CudaKernels, KernelError, function, per_item};
use crate::step::kernels::HyperSpec;

impl CudaKernels {
    pub(super) fn launch_hyper_pre(
        &self,
        x: &CudaSlice<f32>,
        mixes: &CudaSlice<f32>,
        (scale, base): (&CudaSlice<f32>, &CudaSlice<f32>),
        spec: HyperSpec,
        n: usize,
        (collapsed, post, comb): (
            &mut CudaSlice<f32>,
            &mut CudaSlice<f32>,
            &mut CudaSlice<f32>,
        ),
    ) -> Result<(), KernelError> {
        if spec.hc > crate::cuda::MAX_HC {
            return Err(KernelError::Shape(format!("{} streams", spec.hc)));
        }
        let f = function(&self.gpu.hyper, kernel::hyper_pre::NAME)?;
        let (hc, dim, iters) = (spec.hc as i32, spec.dim as i64, spec.iters as i32);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::hyper_pre::args(
            &mut launch,
            x,
            mixes,
            scale,
            base,
            &hc,
            &dim,
            &spec.eps,
            &iters,
            collapsed,
            post,
            comb,
        );
        // SAFETY: `hyper_pre`'s parameters in order; one block per token (shapes checked by
        // the caller).
        unsafe { launch.launch(per_item(n, 256, "tokens")?)? };
        Ok(())
    }

    pub(super) fn launch_hyper_post(
        &self,
        x: &CudaSlice<f32>,
        y: &CudaSlice<f32>,
        (post, comb): (&CudaSlice<f32>, &CudaSlice<f32>),
        spec: HyperSpec,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.hyper, kernel::hyper_post::NAME)?;
        let (hc, dim) = (spec.hc as i32, spec.dim as i64);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::hyper_post::args(&mut launch, x, y, post, comb, &hc, &dim, out);
        // SAFETY: `hyper_post`'s parameters in order; one block per token.
        unsafe { launch.launch(per_item(n, 256, "tokens")?)? };
        Ok(())
    }

    pub(super) fn launch_hyper_head(
        &self,
        x: &CudaSlice<f32>,
        mix: &CudaSlice<f32>,
        (scale, base): (f32, &CudaSlice<f32>),
        spec: HyperSpec,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.hyper, kernel::hyper_head::NAME)?;
        let (hc, dim) = (spec.hc as i32, spec.dim as i64);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::hyper_head::args(&mut launch, x, mix, &scale, base, &hc, &dim, &spec.eps, out);
        // SAFETY: `hyper_head`'s parameters in order; one block per token.
        unsafe { launch.launch(per_item(n, 256, "tokens")?)? };
        Ok(())
    }
}
