//! CUDA kernels and their CPU references. The CPU reference of every kernel is the oracle its
//! CUDA version is tested against. Kernels arrive with the "CUDA kernels" work.
