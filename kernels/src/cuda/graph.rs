//! A decode step recorded as a CUDA graph (`crate::step::replay`): stream capture on the GPU's
//! one stream, launched again after each later step's plans are written.

use cudarc::driver::{
    CudaGraph, CudaSlice, DevicePtr,
    sys::{CUgraphInstantiate_flags, CUstreamCaptureMode},
};

use super::{Gpu, KernelError};

/// A decode step recorded as a CUDA graph.
pub struct StepGraph(CudaGraph);

/// Why a GPU group's steps are not recorded: its NCCL collectives run on a stream of their
/// own, ordered by events that a capture does not follow, and wait on the host for their
/// completion (the group's timeout), which a capture cannot hold. A graph over a group needs
/// the collectives on the step's stream and one bounded wait at the step's end.
pub const NO_GROUP_GRAPHS: &str = "a GPU group's collectives are not recorded into graphs \
     (NCCL runs on its own stream and each call waits on the host for the group's timeout)";

// SAFETY: a graph is used by the decoder that recorded it, which one thread at a time owns
// (CUDA asks that calls on one graph be serialised, not that they come from one thread).
unsafe impl Send for StepGraph {}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

/// Where `b`'s values start on its device.
pub(super) fn addr<T>(b: &CudaSlice<T>) -> usize {
    let (ptr, _sync) = b.device_ptr(b.stream());
    ptr as usize
}

impl StepGraph {
    /// Runs the recorded launches again on their stream.
    pub fn launch(&self) -> Result<(), KernelError> {
        Ok(self.0.launch()?)
    }
}

/// Starts recording `gpu`'s launches.
pub(super) fn begin_capture(gpu: &Gpu) -> Result<bool, KernelError> {
    // SAFETY: the decode step's buffers live on this one stream, so cudarc's events between
    // streams order nothing; and a capture may not wait on an event recorded before it.
    unsafe { gpu.stream.context().disable_event_tracking() };
    gpu.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    Ok(true)
}

/// The launches recorded since [`begin_capture`], ready to launch.
pub(super) fn end_capture(gpu: &Gpu) -> Result<Option<StepGraph>, KernelError> {
    let graph = gpu.stream.end_capture(CUgraphInstantiate_flags(0))?;
    Ok(graph.map(StepGraph))
}
