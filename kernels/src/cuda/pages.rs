//! The device page pool: a device mirror of an engine page pool (`engine::pool::PagePool`)
//! with the same geometry, addressed by 64-bit byte offsets (`page * page_bytes` passes 4 GiB
//! in a real pool), so the offsets `PagedStore::attention_row_offsets` computes are valid on
//! both sides. Pages are copied up after the host writes them; a page never written reads as
//! NaN (0xFF bytes), so a kernel reading it cannot produce a plausible result.

use crate::cuda::kernel;
use cudarc::driver::CudaSlice;
use engine::pool::{PageId, PagePool};

use super::{Gpu, KernelError};

/// Bytes per poisoning copy.
const POISON_CHUNK: usize = 64 << 20;

/// Pages of state on the device.
#[derive(Debug)]
pub struct DevicePages {
    data: CudaSlice<u8>,
    page_bytes: usize,
    count: u64,
}

impl Gpu {
    /// A device pool of `count` pages of `page_bytes`, every byte 0xFF.
    pub fn device_pages(&self, count: u64, page_bytes: usize) -> Result<DevicePages, KernelError> {
        let total = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(page_bytes))
            .filter(|&t| t > 0)
            .ok_or_else(|| KernelError::Shape(format!("{count} pages of {page_bytes} bytes")))?;
        let mut data = self.stream.alloc_zeros::<u8>(total)?;
        let poison = vec![0xFFu8; POISON_CHUNK.min(total)];
        let mut at = 0;
        while at < total {
            let n = POISON_CHUNK.min(total - at);
            self.stream
                .memcpy_htod(&poison[..n], &mut data.slice_mut(at..at + n))?;
            at += n;
        }
        Ok(DevicePages {
            data,
            page_bytes,
            count,
        })
    }

    /// Copies `pages` of the host pool into the same pages of `device`.
    pub fn upload_pages(
        &self,
        device: &mut DevicePages,
        host: &PagePool,
        pages: &[PageId],
    ) -> Result<(), KernelError> {
        if host.page_bytes() != device.page_bytes {
            return Err(KernelError::Shape(format!(
                "host pages of {} bytes, device pages of {}",
                host.page_bytes(),
                device.page_bytes
            )));
        }
        for &page in pages {
            let bytes = host
                .page(page)
                .map_err(|e| KernelError::Shape(e.to_string()))?;
            self.write_page(device, u64::from(page), bytes)?;
        }
        Ok(())
    }

    /// Writes one page (`bytes` is exactly a page).
    pub fn write_page(
        &self,
        device: &mut DevicePages,
        page: u64,
        bytes: &[u8],
    ) -> Result<(), KernelError> {
        let range = device.range(page)?;
        if bytes.len() != device.page_bytes {
            return Err(KernelError::Shape(format!(
                "{} bytes for a page of {}",
                bytes.len(),
                device.page_bytes
            )));
        }
        self.stream
            .memcpy_htod(bytes, &mut device.data.slice_mut(range))?;
        Ok(())
    }

    /// Reads one page back.
    pub fn read_page(&self, device: &DevicePages, page: u64) -> Result<Vec<u8>, KernelError> {
        let range = device.range(page)?;
        Ok(self.stream.clone_dtoh(&device.data.slice(range))?)
    }
}

impl DevicePages {
    /// The whole pool (what kernels read rows from).
    pub fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Byte offset of a page: 64-bit all the way.
    pub fn offset(&self, page: u64) -> Result<u64, KernelError> {
        if page >= self.count {
            return Err(KernelError::Shape(format!(
                "page {page} of a pool of {}",
                self.count
            )));
        }
        Ok(page * self.page_bytes as u64)
    }

    fn range(&self, page: u64) -> Result<std::ops::Range<usize>, KernelError> {
        let start = usize::try_from(self.offset(page)?)
            .map_err(|_| KernelError::Shape(format!("page {page} beyond the address space")))?;
        Ok(start..start + self.page_bytes)
    }
}

impl Gpu {
    /// Several ranges (each of its buffer) to the host with one wait: gathered on the device
    /// into one buffer by one launch (`gather_pieces`, its plan the pieces' addresses,
    /// lengths and places), then that buffer copied down. A state's many small pieces read
    /// back after a step cross once, with three transfers and a launch, not a copy each.
    pub fn read_ranges(
        &self,
        parts: &[(&CudaSlice<f32>, std::ops::Range<usize>)],
    ) -> Result<Vec<Vec<f32>>, KernelError> {
        let mut plan = Vec::with_capacity(3 * parts.len());
        let mut total = 0usize;
        for (b, r) in parts.iter().filter(|(_, r)| !r.is_empty()) {
            if r.end > b.len() {
                return Err(KernelError::Shape("read_ranges: past a buffer".into()));
            }
            let at = super::graph::addr(*b) + 4 * r.start;
            plan.extend([at as i64, r.len() as i64, total as i64]);
            total += r.len();
        }
        if total == 0 {
            return Ok(vec![Vec::new(); parts.len()]);
        }
        let pieces = plan.len() / 3;
        let d_plan = self.stream.clone_htod(&plan)?;
        let mut staging = self.stream.alloc_zeros::<f32>(total)?;
        let f = self.step.load_function(kernel::gather_pieces::NAME)?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::gather_pieces::args(&mut launch, &d_plan, &mut staging);
        let config = cudarc::driver::LaunchConfig {
            grid_dim: (super::grid_dim(pieces, "read_ranges pieces")?, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `gather_pieces(const long long*, float*)`; every piece lies inside its buffer
        // (checked above), which `parts` borrows until the copy down below has waited for the
        // launch on this stream; `staging` holds `total` values, each piece at its place.
        unsafe { launch.launch(config)? };
        let flat = self.stream.clone_dtoh(&staging)?;
        let mut at = 0;
        Ok(parts
            .iter()
            .map(|(_, r)| {
                let part = flat[at..at + r.len()].to_vec();
                at += r.len();
                part
            })
            .collect())
    }
}
