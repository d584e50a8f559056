//! [`EmulatedKernels`]' making and what it counts (reads back, uploads, buffers made), which
//! the tests hold a step's traffic to.

use std::cell::Cell;

use engine::config::ModelConfig;

use super::{EmulatedKernels, KernelPlant};

impl EmulatedKernels {
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            config: config.clone(),
            reads: Cell::new((0, 0)),
            uploads: Cell::new((0, 0, 0, 0)),
            allocations: Cell::new(0),
            plant: None,
        }
    }

    /// The same kernels with `plant` in them.
    #[must_use]
    pub fn planted(mut self, plant: KernelPlant) -> Self {
        self.plant = Some(plant);
        self
    }

    /// (calls, values) read back to the host since the last call.
    pub fn take_reads(&self) -> (usize, usize) {
        self.reads.replace((0, 0))
    }

    /// (f32 uploads, the longest of them, index values uploaded, index uploads) since the
    /// last call.
    pub fn take_uploads(&self) -> (usize, usize, usize, usize) {
        self.uploads.replace((0, 0, 0, 0))
    }

    /// Device buffers made since the last call.
    pub fn take_allocations(&self) -> usize {
        self.allocations.replace(0)
    }

    pub(super) fn allocated(&self) {
        self.allocations.set(self.allocations.get() + 1);
    }

    pub(super) fn uploaded(&self, f32s: usize, indices: usize) {
        let (count, longest, total, index_count) = self.uploads.get();
        let (f, i) = (usize::from(f32s > 0), usize::from(indices > 0));
        self.uploads.set((
            count + f,
            longest.max(f32s),
            total + indices,
            index_count + i,
        ));
    }
}
