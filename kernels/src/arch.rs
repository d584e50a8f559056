//! Which compiled kernel a device may run. The fatbins (`build.rs`) carry arch-specific cubins
//! (sm_90a, sm_100a, sm_120a) and compute_90 PTX. Arch-specific ("a") code runs only on exactly
//! the compute capability it was built for: an sm_120a cubin does not load on an sm_121 (DGX
//! Spark), and an sm_100a one not on an sm_103 (B300); such a device would fall back to the PTX,
//! where the tensor-core kernels are trapping stubs. So the launch wrappers ask these pure
//! functions first and refuse with a clear error instead.

/// The block-scaled FP4 tensor-core GEMM a device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp4Mma {
    /// sm_100a: `tcgen05.mma` with accumulator and scales in Tensor Memory.
    Sm100Tcgen05,
    /// sm_120a: block-scaled `mma.sync`.
    Sm120MmaSync,
}

/// The FP4 MMA kernel built for compute capability `major.minor`, or why there is none.
pub fn fp4_mma(major: i32, minor: i32) -> Result<Fp4Mma, String> {
    match (major, minor) {
        (10, 0) => Ok(Fp4Mma::Sm100Tcgen05),
        (12, 0) => Ok(Fp4Mma::Sm120MmaSync),
        _ => Err(format!(
            "the block-scaled FP4 MMA kernels are built for sm_100a and sm_120a only; this \
             device is sm_{major}{minor}, where arch-specific code does not run"
        )),
    }
}

/// The tensor-core instruction a device's bf16 GEMM tiles (`dense_gemm.cu`) run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Mma {
    /// sm_90a: the warpgroup MMA (`wgmma.mma_async`, SASS `HGMMA`), Hopper's native path.
    Wgmma,
    /// Every other device: warp-level `mma.sync` through WMMA (SASS `HMMA`).
    MmaSync,
}

/// The bf16 GEMM tiles' instruction for compute capability `major.minor`: the warpgroup MMA
/// exactly where the sm_90a cubin runs (an sm_90 device), `mma.sync` elsewhere.
pub fn bf16_mma(major: i32, minor: i32) -> Bf16Mma {
    if (major, minor) == (9, 0) {
        Bf16Mma::Wgmma
    } else {
        Bf16Mma::MmaSync
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sm_90_gets_the_warpgroup_mma() {
        assert_eq!(bf16_mma(9, 0), Bf16Mma::Wgmma);
        for (major, minor) in [(8, 0), (8, 9), (9, 1), (10, 0), (12, 0), (12, 1)] {
            assert_eq!(
                bf16_mma(major, minor),
                Bf16Mma::MmaSync,
                "sm_{major}{minor}"
            );
        }
    }

    #[test]
    fn only_the_exact_architectures_get_their_fp4_mma() {
        assert_eq!(fp4_mma(12, 0), Ok(Fp4Mma::Sm120MmaSync));
        assert_eq!(fp4_mma(10, 0), Ok(Fp4Mma::Sm100Tcgen05));
        // Same major, other minor: the "a" cubin does not run there.
        for (major, minor) in [(12, 1), (10, 3), (10, 1), (9, 0), (8, 9), (11, 0), (13, 0)] {
            let e = fp4_mma(major, minor).unwrap_err();
            assert!(e.contains(&format!("sm_{major}{minor}")), "{e}");
        }
    }
}
