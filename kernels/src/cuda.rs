//! Launch wrappers. The driver library is loaded at run time; on a machine without it (or
//! without a device) [`Gpu::open`] returns `Ok(None)` instead of panicking. The host-slice
//! methods copy their inputs to the device, poison the outputs, launch and copy back (tests);
//! the `launch_*` methods work on device buffers (benchmarks, the engine).

mod attention;
mod attention_exact;
mod attention_fp8;
mod backend;
mod compress;
mod dense;
mod dense_gemm;
mod exact;
mod fp4;
mod graph;
mod hyper;
mod moe;
mod pages;
mod params;
mod rows;
mod sm100;
mod step_kernels;
mod wgmma_probe;

use std::sync::Arc;

/// A typed launcher per kernel (`kernel::NAME::args`), written by the build script from the
/// kernels' parameter lists (`build/signatures.rs`; the arguments' traits in [`params`]).
#[allow(
    clippy::too_many_arguments,
    clippy::trivially_copy_pass_by_ref,
    reason = "one launcher per kernel, each with the kernel's parameters; the launch keeps a \
              pointer to each scalar until it is made"
)]
pub(crate) mod kernel {
    include!(concat!(env!("OUT_DIR"), "/kernel_params.rs"));
}

use cudarc::driver::{CudaContext, CudaModule, CudaStream};

pub use attention::{AttnScratch, AttnShape, IndexerBatch};
pub use attention_fp8::{Fp8AttnScratch, KeptScratch};
pub use backend::CudaBackend;
pub use compress::Windows;
pub use dense::{DenseWeight, HostDense};
pub use dense_gemm::GemmWeight;
pub use exact::{DeviceRows, PairStackRef, Routing, StoredExperts, StoredRows};
pub use fp4::{DeviceExperts, GemvFormat};
pub use graph::StepGraph;
pub use hyper::{HyperPre, MAX_HC, Streams};
pub use moe::{DeviceStack, MoeGrouping};
pub use pages::DevicePages;
pub use step_kernels::{CudaKernels, CudaStepOps, DeviceTable, PairStack};

use crate::fatbins;

/// A failure talking to the GPU.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("the CUDA kernels were not compiled into this build (nvcc missing at build time)")]
    NotCompiled,
    #[error("bad shape: {0}")]
    Shape(String),
    /// The checkpoint could not be read for the device.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The kernel does not run on this device's architecture.
    #[error("unsupported here: {0}")]
    Unsupported(String),
}

/// One device with the kernels loaded.
#[derive(Debug)]
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    nvfp4: Arc<CudaModule>,
    gemv: Arc<CudaModule>,
    gemm: Arc<CudaModule>,
    gemm_sm120: Arc<CudaModule>,
    gemm_sm100: Arc<CudaModule>,
    attn: Arc<CudaModule>,
    attn_fp8: Arc<CudaModule>,
    attn_exact: Arc<CudaModule>,
    indexer: Arc<CudaModule>,
    moe_act: Arc<CudaModule>,
    moe_align: Arc<CudaModule>,
    dense: Arc<CudaModule>,
    dense_gemm: Arc<CudaModule>,
    /// Streaming multiprocessors (the dense GEMM's split plan).
    multiprocessors: usize,
    /// The instruction of the dense GEMM's tiles on this device.
    bf16_mma: crate::arch::Bf16Mma,
    /// Why the warpgroup-MMA tiles were set aside at start-up (`wgmma_probe`), if they were.
    wgmma_fault: Option<String>,
    rows: Arc<CudaModule>,
    hyper: Arc<CudaModule>,
    exact: Arc<CudaModule>,
    compress: Arc<CudaModule>,
    step: Arc<CudaModule>,
}

impl Gpu {
    /// Device 0, or `None` when no driver or no device is present.
    /// The GPU for test `test`, or `None` when this machine has no CUDA driver or device:
    /// the test then skips, or fails under `PDSERVE_REQUIRE_GPU=1` ([`crate::gpu_test`]).
    ///
    /// # Panics
    /// When the GPU is present but does not open, or is missing where one is required.
    pub fn for_test(test: &str) -> Option<Self> {
        match Self::open() {
            Ok(Some(gpu)) => Some(gpu),
            Ok(None) => {
                crate::gpu_test::skip(test, "no CUDA driver or device");
                None
            }
            Err(e) => panic!("{test}: the GPU does not open: {e}"),
        }
    }

    pub fn open() -> Result<Option<Self>, KernelError> {
        Self::open_on(0)
    }

    /// (free, total) bytes of this GPU's memory now.
    pub fn memory(&self) -> Result<(usize, usize), KernelError> {
        self.ctx.bind_to_thread()?;
        Ok(cudarc::driver::result::mem_get_info()?)
    }

    /// Device `ordinal` (as this process sees them: `CUDA_VISIBLE_DEVICES` names them), or
    /// `None` when no driver or no device is present; an error when the devices present do not
    /// include `ordinal`.
    pub fn open_on(ordinal: usize) -> Result<Option<Self>, KernelError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Ok(None);
        }
        let count = CudaContext::device_count()?;
        if count < 1 {
            return Ok(None);
        }
        if ordinal >= count as usize {
            return Err(KernelError::Unsupported(format!(
                "GPU {ordinal} is not visible: this process sees {count} (CUDA_VISIBLE_DEVICES); \
                 a group needs one GPU per rank"
            )));
        }
        if fatbins::NVFP4_QUANT.is_empty() {
            return Err(KernelError::NotCompiled);
        }
        let ctx = CudaContext::new(ordinal)?;
        // Its own stream, not the legacy default one: work of this Gpu orders only with itself
        // (state transfers and other libraries use their own streams).
        let stream = ctx.new_stream()?;
        let load = |bin: &[u8]| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin.to_vec()));
        let nvfp4 = load(fatbins::NVFP4_QUANT)?;
        let gemv = load(fatbins::FP4_GEMV)?;
        let gemm = load(fatbins::NVFP4_GEMM)?;
        let gemm_sm120 = load(fatbins::NVFP4_GEMM_SM120)?;
        let gemm_sm100 = load(fatbins::NVFP4_GEMM_SM100)?;
        let attn = load(fatbins::ATTN_DECODE)?;
        let attn_fp8 = load(fatbins::ATTN_DECODE_FP8)?;
        let attn_exact = load(fatbins::ATTN_EXACT)?;
        let indexer = load(fatbins::INDEXER)?;
        let moe_act = load(fatbins::MOE_ACT)?;
        let moe_align = load(fatbins::MOE_ALIGN)?;
        let dense = load(fatbins::DENSE_GEMV)?;
        let dense_gemm = load(fatbins::DENSE_GEMM)?;
        let multiprocessors = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let (major, minor) = ctx.compute_capability()?;
        let rows = load(fatbins::KV_ROWS)?;
        let hyper = load(fatbins::HYPER)?;
        let exact = load(fatbins::EXACT_GEMV)?;
        let compress = load(fatbins::COMPRESS)?;
        let step = load(fatbins::STEP)?;
        let mut gpu = Self {
            ctx,
            stream,
            nvfp4,
            gemv,
            gemm,
            gemm_sm120,
            gemm_sm100,
            attn,
            attn_fp8,
            attn_exact,
            indexer,
            moe_act,
            moe_align,
            dense,
            dense_gemm,
            multiprocessors: usize::try_from(multiprocessors).unwrap_or(1).max(1),
            bf16_mma: crate::arch::bf16_mma(major, minor),
            wgmma_fault: None,
            rows,
            hyper,
            exact,
            compress,
            step,
        };
        gpu.check_wgmma();
        Ok(Some(gpu))
    }
}

impl Gpu {
    /// The instruction the bf16 GEMM tiles (`dense_gemm.cu`, `nvfp4_gemm.cu`) run on: the
    /// device's own ([`crate::arch::bf16_mma`]) unless set.
    pub fn bf16_mma(&self) -> crate::arch::Bf16Mma {
        self.bf16_mma
    }

    /// Runs the bf16 GEMM tiles on `mma` from now on (the GPU tests and kernel-bench run both
    /// on an sm_90 device); the warpgroup MMA is refused where the device's own is not.
    pub fn set_bf16_mma(&mut self, mma: crate::arch::Bf16Mma) -> Result<(), KernelError> {
        let (major, minor) = self.ctx.compute_capability()?;
        if mma == crate::arch::Bf16Mma::Wgmma && crate::arch::bf16_mma(major, minor) != mma {
            return Err(KernelError::Unsupported(format!(
                "the warpgroup-MMA GEMM tiles are built for sm_90a only; this device is \
                 sm_{major}{minor}"
            )));
        }
        self.bf16_mma = mma;
        Ok(())
    }
}

/// A grid dimension from a count, or a shape error naming `what`.
fn grid_dim(count: usize, what: &str) -> Result<u32, KernelError> {
    u32::try_from(count).map_err(|_| KernelError::Shape(format!("{what}: {count} blocks")))
}

impl From<String> for KernelError {
    fn from(message: String) -> Self {
        Self::Shape(message)
    }
}

/// Device allocations of zero length are refused; empty inputs get one unused element.
fn non_empty<T: Clone + Default>(v: &[T]) -> Vec<T> {
    if v.is_empty() {
        vec![T::default()]
    } else {
        v.to_vec()
    }
}
