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
pub(super) const ACC: usize = crate::cuda_constants::wgmma::ACC;
/// Threads of a warpgroup.
pub(super) const THREADS: usize = crate::cuda_constants::wgmma::THREADS;
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

// `wgmma.cuh`'s own index math, shared by the sm_90a tiles of `dense_gemm.cu` and
// `nvfp4_gemm.cu`: the core-matrix layout, the descriptors, the double-buffered main loop and
// the fragment store.

/// Which tile function a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tiles {
    /// WMMA (`mma.sync`), every architecture.
    Wmma,
    /// The warpgroup MMA (`wgmma.cuh`), sm_90a.
    Wgmma,
}

/// A deliberate error in `wgmma.cuh`, to show the emulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TilePlant {
    None,
    /// The descriptors with LBO and SBO exchanged.
    StridesSwapped,
    /// The second k16 MMA of a slice reading the first one's chunks.
    SecondK16NotAdvanced,
    /// The store taking a register's row half from `i % 2`, its column from `i / 2`.
    FragmentHalvesSwapped,
    /// The next slice staged into the buffer the MMAs in flight read.
    StageIntoBusyBuffer,
    /// The store reading the registers before the last slice's MMAs are waited for.
    NoLastWait,
}

/// `wgmma::TILE`, `SLICE`, `CHUNK`: the tile's edge, k per staged slice, bf16 values per
/// core-matrix row; LBO and SBO the byte strides to the next core matrix along k and to the
/// next 8 rows; one staged operand's bytes.
pub(super) const TILE: usize = crate::cuda_constants::wgmma::TILE;
pub(super) const SLICE: usize = crate::cuda_constants::wgmma::SLICE;
pub(super) const CHUNK: usize = crate::cuda_constants::wgmma::CHUNK;
const LBO: usize = crate::cuda_constants::wgmma::LBO;
const SBO: usize = crate::cuda_constants::wgmma::SBO;
const OPERAND_BYTES: usize = crate::cuda_constants::wgmma::OPERAND_BYTES;
/// Where the emulated block's `operands[2][2][OPERAND_BYTES]` starts in shared memory.
const S_OPERANDS: usize = 0x400;

/// `wgmma::operand_offset`: byte of element (r, kk) of a staged 64 x 32 operand.
fn operand_offset(r: usize, kk: usize) -> usize {
    (r / 8) * SBO + (kk / CHUNK) * LBO + (r % 8) * 16 + (kk % CHUNK) * 2
}

/// `wgmma::descriptor`.
fn descriptor(addr: usize, plant: TilePlant) -> u64 {
    let (lbo, sbo) = if plant == TilePlant::StridesSwapped {
        (SBO, LBO)
    } else {
        (LBO, SBO)
    };
    (((addr & 0x3FFFF) >> 4) as u64) | (((lbo >> 4) as u64) << 16) | (((sbo >> 4) as u64) << 32)
}

/// `wgmma::acc_row` / `acc_col`: the tile row and column the store gives register `i` of
/// thread `t`.
fn acc_place(t: usize, i: usize, plant: TilePlant) -> (usize, usize) {
    let (warp, lane) = (t / 32, t % 32);
    let (row_half, col_pair) = if plant == TilePlant::FragmentHalvesSwapped {
        (i % 2, (i / 2) % 2)
    } else {
        ((i / 2) % 2, i % 2)
    };
    (
        16 * warp + lane / 4 + 8 * row_half,
        2 * (lane % 4) + col_pair + 8 * (i / 4),
    )
}

/// `wgmma::put_chunk`: 8 values (each already a bf16) as chunk `q` of row `r` of the operand
/// at shared byte `operand`.
pub(super) fn put_chunk(smem: &mut [u8], operand: usize, r: usize, q: usize, values: &[f32]) {
    let at = operand + operand_offset(r, q * CHUNK);
    for (x, v) in values.iter().take(CHUNK).enumerate() {
        let bits = (v.to_bits() >> 16) as u16;
        smem[at + 2 * x..at + 2 * x + 2].copy_from_slice(&bits.to_le_bytes());
    }
}

/// `wgmma::stage_rows`: A's slice from `k0` (64 rows x 32 k, rounded to bf16) into the
/// operand at shared byte `operand`; row `r` is `a[row(r) * k..]`, zeros for `None` and at and
/// past `k_end`.
pub(super) fn stage_rows(
    smem: &mut [u8],
    operand: usize,
    a: &[f32],
    (k, k0, k_end): (usize, usize, usize),
    row: impl Fn(usize) -> Option<usize>,
) {
    for e in 0..TILE * (SLICE / CHUNK) {
        let (r, q) = (e / (SLICE / CHUNK), e % (SLICE / CHUNK));
        let v: Vec<f32> = (0..CHUNK)
            .map(|i| {
                let gk = k0 + q * CHUNK + i;
                match row(r) {
                    Some(gr) if gk < k_end => crate::dense_gemm::bf16(a[gr * k + gk]),
                    _ => 0.0,
                }
            })
            .collect();
        put_chunk(smem, operand, r, q, &v);
    }
}

/// `wgmma::tile`: k over `[k_begin, k_end)` in slices; `stage(smem, k0, (a, b))` writes the
/// slice from `k0` on into the operands at shared bytes `a` and `b`; `store(row, col, value)`
/// for every register of every thread. An error where the model refuses what it is asked.
pub(super) fn tile(
    (k_begin, k_end): (usize, usize),
    mut stage: impl FnMut(&mut [u8], usize, (usize, usize)),
    mut store: impl FnMut(usize, usize, f32),
    plant: TilePlant,
) -> Result<(), String> {
    let operands = |buf: usize| {
        let a = S_OPERANDS + buf * 2 * OPERAND_BYTES;
        (a, a + OPERAND_BYTES)
    };
    let mut smem = vec![0u8; S_OPERANDS + 4 * OPERAND_BYTES];
    let mut wg = Warpgroup::new();
    let mut buf = 0;
    stage(&mut smem, k_begin, operands(0));
    let mut k0 = k_begin;
    while k0 < k_end {
        let (a, b) = operands(buf);
        wg.fence();
        for kk in (0..SLICE).step_by(16) {
            let step = if plant == TilePlant::SecondK16NotAdvanced {
                0
            } else {
                operand_offset(0, kk)
            };
            wg.mma_k16(descriptor(a + step, plant), descriptor(b + step, plant))?;
        }
        wg.commit();
        let last = k0 + SLICE >= k_end;
        if !last {
            let next = if plant == TilePlant::StageIntoBusyBuffer {
                buf
            } else {
                buf ^ 1
            };
            stage(&mut smem, k0 + SLICE, operands(next));
        }
        if !(last && plant == TilePlant::NoLastWait) {
            wg.wait_all(&smem)?;
        }
        buf ^= 1;
        k0 += SLICE;
    }
    for t in 0..THREADS {
        for i in 0..ACC {
            let (r, col) = acc_place(t, i, plant);
            store(r, col, wg.register(t, i));
        }
    }
    Ok(())
}
