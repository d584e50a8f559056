//! The warpgroup-MMA tiles' check at start-up. An sm_90 device runs the bf16 GEMM tiles on
//! `wgmma` (`wgmma.cuh`), whose shared-memory layout, descriptors and fragments CI checks only
//! against a model of the instruction. So the first thing a `Gpu` on sm_90 does is run them
//! once on small random operands against their CPU references; where they disagree (or fail to
//! launch) it says so in an error log and keeps `mma.sync`, whose results are right, rather
//! than serve plausible-looking numbers. The GPU tests fail on such a device
//! ([`Gpu::wgmma_fault`]).

use engine::{formats, quant, synth::Rng};

use super::{Gpu, KernelError};
use crate::{
    arch::Bf16Mma,
    cpu,
    dense_gemm::{DenseRows, bound, mismatches, reference},
};

impl Gpu {
    /// Why the warpgroup-MMA tiles were set aside at start-up on this sm_90 device, if they
    /// were.
    pub fn wgmma_fault(&self) -> Option<&str> {
        self.wgmma_fault.as_deref()
    }

    /// Runs the check where the device would use the warpgroup MMA; on a disagreement falls
    /// back to `mma.sync` and keeps the reason.
    pub(super) fn check_wgmma(&mut self) {
        if self.bf16_mma != Bf16Mma::Wgmma {
            return;
        }
        if let Err(why) = self.probe_wgmma() {
            tracing::error!(
                %why,
                "the warpgroup-MMA GEMM tiles disagree with their reference on this GPU: the \
                 GEMMs run on mma.sync instead"
            );
            self.bf16_mma = Bf16Mma::MmaSync;
            self.wgmma_fault = Some(why);
        }
    }

    /// A bf16 dense GEMM of 70 x 100 x 200 and an NVFP4 GEMM of 70 x 100 x 96 (rows and
    /// columns past one tile, k past one slice and one buffer pair) on the warpgroup MMA,
    /// against their references within their bounds.
    fn probe_wgmma(&self) -> Result<(), String> {
        let fault = |e: KernelError| e.to_string();
        let mut rng = Rng::for_tensor(90, "wgmma-probe");
        let (m, n, k) = (70, 100, 200);
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
        let w: Vec<u8> = (0..n * k)
            .flat_map(|_| formats::f32_to_bf16(rng.normal()).to_le_bytes())
            .collect();
        let rows = DenseRows::Bf16(&w);
        let got = self.dense_gemm(rows, 0, &a, (m, n, k)).map_err(fault)?;
        let want = reference(&a, rows, 0, (m, n, k))?;
        let bad = mismatches(&got, &want, &bound(&a, rows, 0, (m, n, k))?);
        if bad > 0 {
            return Err(format!(
                "dense GEMM {m}x{n}x{k}: {bad} values outside the bound"
            ));
        }
        let k = 96;
        let a = &a[..m * k];
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        let (packed, scales, scale_2) = quant::quant_nvfp4(&w, n, k).map_err(|e| e.to_string())?;
        let got = self
            .nvfp4_gemm(a, &packed, &scales, scale_2, m, n, k)
            .map_err(fault)?;
        let want =
            cpu::nvfp4_gemm(a, &packed, &scales, scale_2, m, n, k).map_err(|e| e.to_string())?;
        let deq =
            quant::dequant_nvfp4(&packed, &scales, scale_2, n, k).map_err(|e| e.to_string())?;
        let bad = (0..m * n)
            .filter(|&o| {
                let (i, j) = (o / n, o % n);
                let mag: f32 = (0..k)
                    .map(|x| (crate::dense_gemm::bf16(a[i * k + x]) * deq[j * k + x]).abs())
                    .sum();
                let (g, r) = (got[o], want[o]);
                g.is_nan() || (g - r).abs() > 1e-4 * mag + 1e-30
            })
            .count();
        if bad > 0 {
            return Err(format!(
                "NVFP4 GEMM {m}x{n}x{k}: {bad} values outside the bound"
            ));
        }
        Ok(())
    }
}
