//! Hopper's warpgroup MMA as the PTX ISA documents it, for the emulation of the sm_90a kernels
//! built on `wgmma.cuh` (the kernels' own index math lives beside each kernel's emulation; this
//! is only the instruction):
//!
//! - a shared-memory matrix descriptor: start address, LBO and SBO in 16-byte units at bits
//!   [0, 14), [16, 30), [32, 46), base offset [49, 52), swizzle [62, 64); only the no-swizzle
//!   K-major form is modelled: byte `b` of row `r` is at
//!   `start + (r / 8) * SBO + (b / 16) * LBO + (r % 8) * 16 + b % 16`;
//! - `wgmma.mma_async.m64n64k16.f32.bf16.bf16` with both operands K-major in shared memory:
//!   `D[r][c] += Σ_{k < 16} A[r][k] · B[c][k]`, products exact, f32 sums;
//! - its f32 accumulator fragment: register `i` of lane `l` of warp `w` holds row
//!   `16 w + l / 4 + 8 ((i / 2) % 2)`, column `2 (l % 4) + i % 2 + 8 (i / 4)`;
//! - asynchrony: an MMA needs a `wgmma.fence` since the last commit, reads shared memory
//!   whenever it runs, which may be as late as the `wgmma.wait_group` that retires it, and
//!   writes the registers then. The model runs each committed group at the wait, so a kernel
//!   that stages into a buffer an MMA in flight still reads, or reads its registers before the
//!   wait, computes something else.
//!
//! The layout and fragment facts are the least certain part (CUTLASS issue #3254 reports a
//! wrong table for one wgmma atom); the GPU test on an sm_90 device is what confirms them.

/// f32 accumulator registers per thread of an m64n64 MMA.
pub(super) const ACC: usize = 32;
/// Threads of a warpgroup.
pub(super) const THREADS: usize = 128;
const M: usize = 64;
const N: usize = 64;
const K: usize = 16;

/// A descriptor's fields, as the tensor core reads them.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    start: usize,
    lbo: usize,
    sbo: usize,
}

fn decode(d: u64) -> Result<Matrix, String> {
    let bits = |at: u32, width: u32| (d >> at) & ((1 << width) - 1);
    if bits(49, 3) != 0 || bits(62, 2) != 0 {
        return Err(format!(
            "descriptor {d:#x}: only the no-swizzle form with base offset 0 is modelled"
        ));
    }
    Ok(Matrix {
        start: (bits(0, 14) << 4) as usize,
        lbo: (bits(16, 14) << 4) as usize,
        sbo: (bits(32, 14) << 4) as usize,
    })
}

/// bf16 element `kk` of row `r` of a K-major operand, as an f32.
fn element(smem: &[u8], m: Matrix, r: usize, kk: usize) -> Result<f32, String> {
    let b = 2 * kk;
    let at = m.start + (r / 8) * m.sbo + (b / 16) * m.lbo + (r % 8) * 16 + b % 16;
    let bytes = smem
        .get(at..at + 2)
        .ok_or_else(|| format!("operand byte {at} outside shared memory"))?;
    Ok(f32::from_bits(
        u32::from(u16::from_le_bytes([bytes[0], bytes[1]])) << 16,
    ))
}

/// Row and column of accumulator register `i` of thread `t` (the documented fragment).
fn fragment(t: usize, i: usize) -> (usize, usize) {
    let (warp, lane) = (t / 32, t % 32);
    (
        16 * warp + lane / 4 + 8 * ((i / 2) % 2),
        2 * (lane % 4) + i % 2 + 8 * (i / 4),
    )
}

/// One warpgroup's accumulators and its MMAs in flight.
pub(super) struct Warpgroup {
    /// `acc[t][i]`: register `i` of thread `t`.
    acc: Vec<[f32; ACC]>,
    fenced: bool,
    issued: Vec<(u64, u64)>,
    committed: Vec<Vec<(u64, u64)>>,
}

impl Warpgroup {
    /// Zeroed accumulators (the kernels' `d[i] = 0`).
    pub(super) fn new() -> Self {
        Self {
            acc: vec![[0.0; ACC]; THREADS],
            fenced: false,
            issued: Vec::new(),
            committed: Vec::new(),
        }
    }

    /// `wgmma.fence`.
    pub(super) fn fence(&mut self) {
        self.fenced = true;
    }

    /// `wgmma.mma_async.m64n64k16` with descriptors `a` and `b`, run at a later wait.
    pub(super) fn mma_k16(&mut self, a: u64, b: u64) -> Result<(), String> {
        if !self.fenced {
            return Err("wgmma.mma_async without a wgmma.fence since the last commit".into());
        }
        self.issued.push((a, b));
        Ok(())
    }

    /// `wgmma.commit_group`.
    pub(super) fn commit(&mut self) {
        self.committed.push(std::mem::take(&mut self.issued));
        self.fenced = false;
    }

    /// `wgmma.wait_group 0`: every committed group runs now, on `smem` as it is now.
    pub(super) fn wait_all(&mut self, smem: &[u8]) -> Result<(), String> {
        for group in std::mem::take(&mut self.committed) {
            for (a, b) in group {
                self.run(smem, decode(a)?, decode(b)?)?;
            }
        }
        Ok(())
    }

    fn run(&mut self, smem: &[u8], a: Matrix, b: Matrix) -> Result<(), String> {
        if !a.start.is_multiple_of(16) || !b.start.is_multiple_of(16) {
            return Err("an operand not aligned to 16 bytes".into());
        }
        let rows_a = (0..M)
            .map(|r| (0..K).map(|kk| element(smem, a, r, kk)).collect())
            .collect::<Result<Vec<Vec<f32>>, String>>()?;
        let rows_b = (0..N)
            .map(|c| (0..K).map(|kk| element(smem, b, c, kk)).collect())
            .collect::<Result<Vec<Vec<f32>>, String>>()?;
        for (t, regs) in self.acc.iter_mut().enumerate() {
            for (i, d) in regs.iter_mut().enumerate() {
                let (r, c) = fragment(t, i);
                *d += rows_a[r]
                    .iter()
                    .zip(&rows_b[c])
                    .fold(0.0f32, |s, (x, y)| s + x * y);
            }
        }
        Ok(())
    }

    /// Register `i` of thread `t` as the thread reads it now (MMAs not yet waited for have
    /// not written it).
    pub(super) fn register(&self, t: usize, i: usize) -> f32 {
        self.acc[t][i]
    }
}
