//! The indexer choice's launches: its top-k (`indexer_topk` in `indexer.cu`) and the chosen
//! rows' key offsets (`chosen_offsets` in `step.cu`).

use crate::cuda::kernel;
use cudarc::driver::CudaSlice;

use super::{CudaKernels, KernelError, blocks, function, per_item};

impl CudaKernels {
    pub(super) fn launch_indexer_topk(
        &self,
        scores: &CudaSlice<f32>,
        visible: &CudaSlice<i32>,
        (tokens, max_keys, k): (usize, usize, usize),
        out: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.indexer, kernel::indexer_topk::NAME)?;
        let (max_keys, k) = (max_keys as i64, k as i32);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::indexer_topk::args(&mut launch, scores, visible, &max_keys, &k, out);
        // SAFETY: `indexer_topk`'s parameters in order; one block per token, `k` slots each.
        unsafe { launch.launch(per_item(tokens, 256, "tokens")?)? };
        Ok(())
    }

    pub(super) fn launch_chosen_offsets(
        &self,
        (chosen, k): (&CudaSlice<i32>, usize),
        (tokens, starts, counts, bases): (
            &CudaSlice<i32>,
            &CudaSlice<i64>,
            &CudaSlice<i32>,
            &CudaSlice<i64>,
        ),
        (row_bytes, entries): (usize, usize),
        offsets: &mut CudaSlice<i64>,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.step, kernel::chosen_offsets::NAME)?;
        let (k, row_bytes, n) = (k as i32, row_bytes as i64, entries as i32);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::chosen_offsets::args(
            &mut launch,
            chosen,
            &k,
            tokens,
            starts,
            counts,
            bases,
            &row_bytes,
            &n,
            offsets,
        );
        // SAFETY: `chosen_offsets`' parameters in order; each entry's slots lie inside
        // `offsets` (reserved by the caller's plan), its chosen rows below the rows the token
        // sees.
        unsafe { launch.launch(blocks(entries, 128, "tokens")?)? };
        Ok(())
    }
}
