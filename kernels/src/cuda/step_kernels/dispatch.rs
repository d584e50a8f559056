//! The group kernels' launches (`ep_slots`, `ep_take_ids`, `held_ids`, `clear_unheld_rows`,
//! `sum_blocks` in `step.cu`) and the exchange of device buffers over NCCL where the group's
//! collective is NCCL's.

use crate::cuda::kernel;
use cudarc::driver::{CudaSlice, LaunchConfig};

use engine::parallel::collective::Collective;

use super::{CudaKernels, KernelError, blocks, function, per_item};
use crate::step::kernels::{
    SlotSpec, all_gather_through_host, all_owned_through_host, check_received,
    exchange_through_host, gather_counts_through_host,
};

/// `ep_slots`' block (`EP_SLOTS_THREADS` in `step.cu`).
const EP_SLOTS_THREADS: u32 = crate::cuda_constants::step::EP_SLOTS_THREADS as u32;

/// The group's NCCL rank, where its collective is NCCL's.
#[cfg(feature = "nccl")]
fn nccl(coll: &mut dyn Collective) -> Option<&mut crate::nccl::NcclRank> {
    coll.as_any_mut()?.downcast_mut::<crate::nccl::NcclRank>()
}

fn wide(v: usize, what: &str) -> Result<i64, KernelError> {
    i64::try_from(v).map_err(|_| KernelError::Shape(format!("{what}: {v}")))
}

impl CudaKernels {
    pub(super) fn launch_ep_slots(
        &self,
        experts: &CudaSlice<i32>,
        spec: SlotSpec,
        send: &mut CudaSlice<f32>,
        (pack_to, back_from): (&mut CudaSlice<i64>, &mut CudaSlice<i64>),
        counts: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        let SlotSpec {
            ranks,
            per_rank,
            width,
            pairs,
        } = spec;
        let fits = experts.len() >= pairs
            && send.len() >= ranks + pairs * (1 + width)
            && pack_to.len() >= pairs
            && back_from.len() >= pairs
            && counts.len() > ranks
            && i32::try_from(ranks * per_rank).is_ok();
        if !fits || ranks == 0 || per_rank == 0 {
            return Err(KernelError::Shape(format!(
                "ep_slots: {pairs} pairs over {ranks} ranks of {per_rank} experts, rows of \
                 {width}, outside their buffers"
            )));
        }
        let f = function(&self.gpu.step, kernel::ep_slots::NAME)?;
        let (p, r) = (wide(pairs, "pairs")?, wide(ranks, "ranks")?);
        let (e, w) = (wide(per_rank, "experts")?, wide(width, "width")?);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::ep_slots::args(
            &mut launch,
            experts,
            &p,
            &r,
            &e,
            &w,
            send,
            pack_to,
            back_from,
            counts,
        );
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (EP_SLOTS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `ep_slots`' parameters in order; every buffer as long as it writes (checked
        // above); one block of the kernel's thread count.
        unsafe { launch.launch(one)? };
        Ok(())
    }

    pub(super) fn launch_ep_take_ids(
        &self,
        recv: &CudaSlice<f32>,
        at: &CudaSlice<i64>,
        (first, held): (usize, usize),
        m: usize,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        if at.len() < m || ids.len() < m {
            return Err(KernelError::Shape(format!(
                "ep_take_ids: {m} rows outside their buffers"
            )));
        }
        if m == 0 {
            return Ok(());
        }
        let f = function(&self.gpu.step, kernel::ep_take_ids::NAME)?;
        let (first, held, n) = (wide(first, "first")?, wide(held, "held")?, wide(m, "m")?);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::ep_take_ids::args(&mut launch, recv, at, &first, &held, &n, ids);
        // SAFETY: `ep_take_ids`' parameters in order; `at` and `ids` hold `m` values (checked
        // above), every `at` inside `recv` (the caller's offsets); a thread per row.
        unsafe { launch.launch(per_item(m.div_ceil(128), 128, "ep_take_ids")?)? };
        Ok(())
    }

    pub(super) fn launch_held_ids(
        &self,
        experts: &CudaSlice<i32>,
        (first, held): (usize, usize),
        total: usize,
        pairs: usize,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        if experts.len() < pairs || ids.len() < pairs || i32::try_from(total).is_err() {
            return Err(KernelError::Shape(format!(
                "held_ids: {pairs} pairs of {total} experts outside their buffers"
            )));
        }
        if pairs == 0 {
            return Ok(());
        }
        let f = function(&self.gpu.step, kernel::held_ids::NAME)?;
        let (first, held) = (wide(first, "first")?, wide(held, "held")?);
        let (total, n) = (wide(total, "total")?, wide(pairs, "pairs")?);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::held_ids::args(&mut launch, experts, &first, &held, &total, &n, ids);
        // SAFETY: `held_ids`' parameters in order; `experts` and `ids` hold `pairs` values
        // (checked above); a thread per pair.
        unsafe { launch.launch(per_item(pairs.div_ceil(128), 128, "held_ids")?)? };
        Ok(())
    }

    pub(super) fn launch_clear_unheld_rows(
        &self,
        ys: &mut CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        width: usize,
        pairs: usize,
    ) -> Result<(), KernelError> {
        let values = pairs.checked_mul(width);
        if values.is_none_or(|n| ys.len() < n) || ids.len() < pairs {
            return Err(KernelError::Shape(format!(
                "clear_unheld_rows: {pairs} rows of {width} outside their buffers"
            )));
        }
        if pairs == 0 || width == 0 {
            return Ok(());
        }
        let f = function(&self.gpu.step, kernel::clear_unheld_rows::NAME)?;
        let (w, n) = (wide(width, "width")?, wide(pairs, "pairs")?);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::clear_unheld_rows::args(&mut launch, ys, ids, &w, &n);
        // SAFETY: `clear_unheld_rows`' parameters in order; `ys` holds `pairs * width` values
        // and `ids` `pairs` (checked above); a thread per value.
        unsafe { launch.launch(blocks(pairs * width, 256, "clear_unheld_rows")?)? };
        Ok(())
    }

    pub(super) fn launch_sum_blocks(
        &self,
        x: &CudaSlice<f32>,
        (count, part): (usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let whole = count.checked_mul(part);
        if count == 0 || whole.is_none_or(|n| x.len() < n) || out.len() < part {
            return Err(KernelError::Shape(format!(
                "sum_blocks: {count} blocks of {part} values outside their buffers"
            )));
        }
        if part == 0 {
            return Ok(());
        }
        let f = function(&self.gpu.step, kernel::sum_blocks::NAME)?;
        let (b, n) = (wide(count, "blocks")?, wide(part, "part")?);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::sum_blocks::args(&mut launch, x, &b, &n, out);
        // SAFETY: `sum_blocks`' parameters in order; `x` holds `count * part` values and `out`
        // `part` (checked above); a thread per value.
        unsafe { launch.launch(blocks(part, 256, "sum_blocks")?)? };
        Ok(())
    }

    /// [`crate::step::kernels::Kernels::exchange_known`]: over NCCL without gathering sizes
    /// where `coll` is an [`crate::nccl::NcclRank`], through the host otherwise.
    pub(super) fn exchange_rows_known(
        &self,
        coll: &mut dyn Collective,
        send: &CudaSlice<f32>,
        sizes: (&[usize], &[usize]),
    ) -> Result<CudaSlice<f32>, KernelError> {
        #[cfg(feature = "nccl")]
        if let Some(rank) = nccl(coll) {
            return rank
                .exchange_device_known(&self.gpu.stream, send, sizes)
                .map_err(|e| KernelError::Shape(format!("exchange: {e}")));
        }
        let (recv, got) = exchange_through_host(self, coll, send, sizes.0)?;
        check_received(&got, sizes.1)?;
        Ok(recv)
    }

    /// [`crate::step::kernels::Kernels::all_gather`]: one NCCL all-gather where `coll` is an
    /// [`crate::nccl::NcclRank`], through the host otherwise.
    pub(super) fn all_gather_of(
        &self,
        coll: &mut dyn Collective,
        send: &CudaSlice<f32>,
        part: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        #[cfg(feature = "nccl")]
        if let Some(rank) = nccl(coll) {
            return rank
                .all_gather_device(&self.gpu.stream, send, part, out)
                .map_err(|e| KernelError::Shape(format!("all-gather: {e}")));
        }
        all_gather_through_host(self, coll, send, part, out)
    }

    /// [`crate::step::kernels::Kernels::all_owned`]: one NCCL all-reduce where `coll` is an
    /// [`crate::nccl::NcclRank`], through the host otherwise (checked: a value two ranks hold
    /// is refused).
    pub(super) fn all_owned_of(
        &self,
        coll: &mut dyn Collective,
        send: &CudaSlice<f32>,
        len: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if send.len() < len || out.len() < len {
            return Err(KernelError::Shape(format!(
                "all-reduce: {len} values outside their buffers"
            )));
        }
        #[cfg(feature = "nccl")]
        if let Some(rank) = nccl(coll) {
            return rank
                .all_owned_device(&self.gpu.stream, send, len, out)
                .map_err(|e| KernelError::Shape(format!("all-reduce: {e}")));
        }
        all_owned_through_host(self, coll, send, len, out)
    }

    /// [`crate::step::kernels::Kernels::gather_counts`]: over NCCL where `coll` is an
    /// [`crate::nccl::NcclRank`], through the host otherwise.
    pub(super) fn gather_counts_of(
        &self,
        coll: &mut dyn Collective,
        counts: &CudaSlice<i32>,
        n: usize,
    ) -> Result<Vec<Vec<i32>>, KernelError> {
        #[cfg(feature = "nccl")]
        if let Some(rank) = nccl(coll) {
            return rank
                .gather_device_counts(&self.gpu.stream, counts, n)
                .map_err(|e| KernelError::Shape(format!("gather counts: {e}")));
        }
        gather_counts_through_host(self, coll, counts, n)
    }
}
