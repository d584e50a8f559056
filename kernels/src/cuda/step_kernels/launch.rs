//! Launch shapes and kernel lookup for [`super::CudaKernels`]' launches.

use cudarc::driver::LaunchConfig;

use crate::cuda::{KernelError, grid_dim};

pub(super) fn blocks(n: usize, per: u32, what: &str) -> Result<LaunchConfig, KernelError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(n.div_ceil(per as usize).max(1), what)?, 1, 1),
        block_dim: (per, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(super) fn per_item(n: usize, threads: u32, what: &str) -> Result<LaunchConfig, KernelError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(n, what)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(super) fn function(
    module: &std::sync::Arc<cudarc::driver::CudaModule>,
    name: &str,
) -> Result<cudarc::driver::CudaFunction, KernelError> {
    Ok(module.load_function(name)?)
}
