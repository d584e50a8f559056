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

#[cfg(test)]
mod tests {
    use super::*;

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
