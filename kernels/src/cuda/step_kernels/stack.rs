//! The routed experts' weights of a layer as `exact_pairs` reads them ([`PairStack`]).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use engine::{
    tensor::{Weight, WeightForm},
    weights::ExpertWeights,
};

use super::{KernelError, PairStack, non_empty};
use crate::step::Proj;

fn proj_of(e: &ExpertWeights, proj: Proj) -> &Weight {
    match proj {
        Proj::Gate => &e.w1,
        Proj::Down => &e.w2,
        Proj::Up => &e.w3,
    }
}

pub(super) fn upload_stack(
    s: &Arc<CudaStream>,
    experts: &[ExpertWeights],
    proj: Proj,
) -> Result<PairStack, KernelError> {
    let first = experts
        .first()
        .map(|e| proj_of(e, proj))
        .ok_or_else(|| KernelError::Shape("a MoE layer without routed experts".into()))?;
    let (mut packed, mut scales, mut scale_2) = (Vec::new(), Vec::new(), Vec::new());
    let mut kernel = "";
    for e in experts {
        let w = proj_of(e, proj);
        let parts: Option<(&[u8], &[u8], f32, &'static str)> = match w.form() {
            WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => Some((
                packed.as_slice(),
                scales.as_slice(),
                *scale_2,
                crate::cuda::kernel::exact_pairs_nvfp4::NAME,
            )),
            WeightForm::Mxfp4 { packed, scales } => Some((
                packed.as_slice(),
                scales.as_slice(),
                1.0,
                crate::cuda::kernel::exact_pairs_mxfp4::NAME,
            )),
            _ => None,
        };
        let Some((p, s, s2, k)) = parts.filter(|_| (w.rows, w.cols) == (first.rows, first.cols))
        else {
            return Err(KernelError::Shape(
                "the device decode step runs routed experts stored as NVFP4 or MXFP4 only, \
                 one shape for all"
                    .into(),
            ));
        };
        kernel = k;
        packed.extend_from_slice(p);
        scales.extend_from_slice(s);
        scale_2.push(s2);
    }
    Ok(PairStack {
        kernel,
        packed: s.clone_htod(&non_empty(&packed))?,
        scales: s.clone_htod(&non_empty(&scales))?,
        scale_2: s.clone_htod(&non_empty(&scale_2))?,
        experts: experts.len(),
        rows: first.rows,
        cols: first.cols,
    })
}
