//! `nvfp4_gemm_sm100.cu` on the CPU: the kernel's own index math (how its threads lay the code
//! and scale bytes out in shared memory, the descriptors and instruction descriptor it builds,
//! the Tensor Memory columns it names, how its epilogue reads the accumulator) around a model of
//! the 5th-generation tensor core that reads all of it the way the kernel's header documents:
//!
//! - a shared-memory descriptor: start address, LBO and SBO in 16-byte units at bits [0,14),
//!   [16,30), [32,46), the fixed `0b01` at [46,48), base offset [49,52), LBO mode [52], layout
//!   [61,64) (0: no swizzle); byte `b` of row `r` of a K-major no-swizzle operand is at
//!   `start + (r / 8) * SBO + (b / 16) * LBO + (r % 8) * 16 + b % 16`;
//! - the instruction descriptor of `kind::mxf4nvf4` (types at [7,10) and [10,13), N >> 3 at
//!   [17,23), M >> 4 at [24,29), majors at [15], [16], scale type at [23]);
//! - `tcgen05.cp.32x128b.warpx4`: row `i` (16 bytes at `start + (i / 8) * SBO + (i % 8) * 16`) of
//!   a 32-row matrix goes to lane `i` of each 32-lane sub-partition, 4 columns of 32 bits;
//! - the MMA reads row `r`'s 4 scale bytes (K blocks in byte order) from lane `r`, column
//!   `sf + r / 32`, and accumulates row `r`, column `c` of the tile in lane `r`, column `d + c`;
//! - `tcgen05.ld.32x32b.x16`: lane `l` of warp `w` gets lane `32 w + l`, 16 consecutive columns.
//!
//! The emulation refuses descriptors it does not model (a swizzle, another type or shape). If
//! the kernel stored a byte in the wrong place, encoded a field wrongly or named the wrong
//! column, the emulated product is not [`crate::cpu::nvfp4_gemm_w4a4`]'s; the tests plant such
//! errors and see them caught. Whether the hardware reads as documented is what the GPU test
//! establishes on an sm_100 device (the header says which fact is least certain: the scales'
//! Tensor Memory layout).

use engine::formats::{e2m1_to_f32, e4m3_to_f32};

const THREADS: usize = crate::cuda_constants::nvfp4_gemm_sm100::THREADS;
const TILE_M: usize = crate::cuda_constants::nvfp4_gemm_sm100::TILE_M;
const TILE_N: usize = crate::cuda_constants::nvfp4_gemm_sm100::TILE_N;
const MMA_K: usize = crate::cuda_constants::nvfp4_gemm_sm100::MMA_K;
const STAGE_MMAS: usize = crate::cuda_constants::nvfp4_gemm_sm100::STAGE_MMAS;
const STAGE_K: usize = crate::cuda_constants::nvfp4_gemm_sm100::STAGE_K;
const OP_BLOCK_BYTES: usize = crate::cuda_constants::nvfp4_gemm_sm100::OP_BLOCK_BYTES;
const SF_BLOCK_BYTES: usize = crate::cuda_constants::nvfp4_gemm_sm100::SF_BLOCK_BYTES;
const TMEM_LANES: usize = 128;
const TMEM_COLS: usize = crate::cuda_constants::nvfp4_gemm_sm100::TMEM_COLS;
const TMEM_ACC_COL: usize = crate::cuda_constants::nvfp4_gemm_sm100::TMEM_ACC_COL;
const TMEM_SFA_COL: usize = crate::cuda_constants::nvfp4_gemm_sm100::TMEM_SFA_COL;
const TMEM_SFW_COL: usize = crate::cuda_constants::nvfp4_gemm_sm100::TMEM_SFW_COL;

/// Where the emulated CTA's shared arrays sit (aligned as the kernel declares them).
const S_A: usize = 0x0000;
const S_W: usize = 0x4000;
const S_SFA: usize = 0x8000;
const S_SFW: usize = 0x8800;
const SMEM_BYTES: usize = 0x9000;

/// A deliberate error in the kernel's index math, to show the emulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plant {
    None,
    /// The operand descriptors with LBO and SBO exchanged.
    StridesSwapped,
    /// Codes stored with a core matrix's K halves and rows exchanged.
    CoreMatrixTransposed,
    /// Row `r`'s scale word at `r` instead of `(r % 32) * 4 + r / 32`.
    ScaleWordsInRowOrder,
    /// The W scales copied into the A scales' columns.
    ScaleColumnsMixed,
    /// The instruction descriptor's N field one step too small.
    InstrDescN,
}

/// The kernel's `kInstrDesc`.
fn instr_desc(plant: Plant) -> u32 {
    let n = if plant == Plant::InstrDescN {
        TILE_N - 8
    } else {
        TILE_N
    };
    (1 << 7) | (1 << 10) | (((n >> 3) as u32) << 17) | ((TILE_M >> 4) as u32) << 24
}

/// The kernel's `smem_desc`.
fn smem_desc(addr: usize, lbo: usize, sbo: usize) -> u64 {
    let field = |v: usize| ((v as u64) & 0x3FFFF) >> 4;
    field(addr) | (field(lbo) << 16) | (field(sbo) << 32) | (1 << 46)
}

/// A shared-memory descriptor's fields, as the tensor core reads them.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    start: usize,
    lbo: usize,
    sbo: usize,
}

fn decode_smem(d: u64) -> Result<Matrix, String> {
    let bits = |at: u32, width: u32| (d >> at) & ((1 << width) - 1);
    if bits(46, 2) != 1 || bits(49, 3) != 0 || bits(52, 1) != 0 || bits(61, 3) != 0 {
        return Err(format!(
            "descriptor {d:#x}: only the no-swizzle sm_100 form is modelled"
        ));
    }
    Ok(Matrix {
        start: (bits(0, 14) << 4) as usize,
        lbo: (bits(16, 14) << 4) as usize,
        sbo: (bits(32, 14) << 4) as usize,
    })
}

/// Byte `b` of row `r` of a K-major no-swizzle operand.
fn operand_byte(smem: &[u8], m: Matrix, r: usize, b: usize) -> u8 {
    smem[m.start + (r / 8) * m.sbo + (b / 16) * m.lbo + (r % 8) * 16 + b % 16]
}

/// The MMA's shape from its instruction descriptor; only E2M1 x E2M1, K-major, UE4M3 scales
/// are modelled.
fn decode_instr(d: u32) -> Result<(usize, usize), String> {
    let bits = |at: u32, width: u32| ((d >> at) & ((1 << width) - 1)) as usize;
    let modelled = bits(0, 3) == 0
        && bits(4, 2) == 0
        && bits(7, 3) == 1
        && bits(10, 3) == 1
        && bits(13, 4) == 0
        && bits(23, 1) == 0
        && bits(29, 3) == 0;
    if !modelled {
        return Err(format!("instruction descriptor {d:#x} is not modelled"));
    }
    Ok((bits(24, 5) << 4, bits(17, 6) << 3))
}

/// Tensor Memory: 128 lanes of 32-bit columns.
struct Tmem(Vec<u32>);

impl Tmem {
    fn at(&mut self, lane: usize, col: usize) -> &mut u32 {
        &mut self.0[lane * TMEM_COLS + col]
    }
}

/// `tcgen05.cp.cta_group::1.32x128b.warpx4 [col], desc`.
fn cp_32x128b_warpx4(tmem: &mut Tmem, col: usize, smem: &[u8], desc: u64) -> Result<(), String> {
    let m = decode_smem(desc)?;
    for i in 0..32 {
        let at = m.start + (i / 8) * m.sbo + (i % 8) * 16;
        for j in 0..4 {
            let word = u32::from_le_bytes([
                smem[at + 4 * j],
                smem[at + 4 * j + 1],
                smem[at + 4 * j + 2],
                smem[at + 4 * j + 3],
            ]);
            for q in 0..4 {
                *tmem.at(i + 32 * q, col + j) = word;
            }
        }
    }
    Ok(())
}

/// `tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16 [d], a, b, idesc, [sfa],
/// [sfb], accumulate`.
struct Mma {
    d: usize,
    a: u64,
    b: u64,
    idesc: u32,
    sfa: usize,
    sfb: usize,
    accumulate: bool,
}

fn mma(tmem: &mut Tmem, smem: &[u8], op: &Mma) -> Result<(), String> {
    let (rows, cols) = decode_instr(op.idesc)?;
    let (a, b) = (decode_smem(op.a)?, decode_smem(op.b)?);
    let value = |tmem: &mut Tmem, m: Matrix, sf: usize, r: usize, k: usize| -> f64 {
        let byte = operand_byte(smem, m, r, k / 2);
        let code = if k.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        };
        let scale = tmem.at(r, sf + r / 32).to_le_bytes()[k / 16];
        f64::from(e2m1_to_f32(code)) * f64::from(e4m3_to_f32(scale))
    };
    let values = |tmem: &mut Tmem, m: Matrix, sf: usize, rows: usize| -> Vec<Vec<f64>> {
        (0..rows)
            .map(|r| (0..MMA_K).map(|k| value(tmem, m, sf, r, k)).collect())
            .collect()
    };
    let a_rows = values(tmem, a, op.sfa, rows);
    let b_rows = values(tmem, b, op.sfb, cols);
    for (r, a_row) in a_rows.iter().enumerate() {
        for (c, b_row) in b_rows.iter().enumerate() {
            let sum: f64 = a_row.iter().zip(b_row).map(|(x, y)| x * y).sum();
            let acc = tmem.at(r, op.d + c);
            let before = if op.accumulate {
                f32::from_bits(*acc)
            } else {
                0.0
            };
            *acc = (before + sum as f32).to_bits();
        }
    }
    Ok(())
}

/// The kernel's `load_codes`, all threads.
fn load_codes(smem: &mut [u8], at: usize, operand: &Operand<'_>, k_byte0: usize, mmas: usize) {
    let plant = operand.plant;
    for tid in 0..THREADS {
        for i in 0..(TILE_M * 8) / THREADS {
            let idx = i * THREADS + tid;
            let (r, chunk) = (idx / 8, idx % 8);
            let block = chunk / 2;
            if block >= mmas {
                continue;
            }
            let row = operand.row0 + r;
            let mut v = [0u8; 16];
            if row < operand.rows {
                let from = row * operand.row_bytes + k_byte0 + chunk * 16;
                v.copy_from_slice(&operand.codes[from..from + 16]);
            }
            let inner = if plant == Plant::CoreMatrixTransposed {
                (chunk % 2) * 16 + (r % 8) * 128
            } else {
                (chunk % 2) * 128 + (r % 8) * 16
            };
            let offset = block * OP_BLOCK_BYTES + (r / 8) * 256 + inner;
            smem[at + offset..at + offset + 16].copy_from_slice(&v);
        }
    }
}

/// The kernel's `load_scales`, all threads.
fn load_scales(smem: &mut [u8], at: usize, operand: &Operand<'_>, k_scale0: usize, mmas: usize) {
    for tid in 0..THREADS {
        for i in 0..(TILE_M * STAGE_MMAS) / THREADS {
            let idx = i * THREADS + tid;
            let (r, block) = (idx / STAGE_MMAS, idx % STAGE_MMAS);
            if block >= mmas {
                continue;
            }
            let row = operand.row0 + r;
            let mut v = [0u8; 4];
            if row < operand.rows {
                let from = row * operand.row_scales + k_scale0 + block * 4;
                v.copy_from_slice(&operand.scales[from..from + 4]);
            }
            let word = if operand.plant == Plant::ScaleWordsInRowOrder {
                r
            } else {
                (r % 32) * 4 + r / 32
            };
            let offset = block * SF_BLOCK_BYTES + 4 * word;
            smem[at + offset..at + offset + 4].copy_from_slice(&v);
        }
    }
}

/// One operand of a CTA: its rows from `row0`, of `rows` in all.
struct Operand<'a> {
    codes: &'a [u8],
    scales: &'a [u8],
    row0: usize,
    rows: usize,
    row_bytes: usize,
    row_scales: usize,
    plant: Plant,
}

/// `nvfp4_gemm_w4a4_sm100` over the whole grid with `plant` in its index math. Output poisoned
/// with NaN first, as the wrapper does.
pub(super) fn gemm_with(
    (a_codes, a_scales, a_scale_2): (&[u8], &[u8], f32),
    (w_codes, w_scales, w_scale_2): (&[u8], &[u8], f32),
    (m, n, k): (usize, usize, usize),
    plant: Plant,
) -> Result<Vec<f32>, String> {
    let mut c = vec![f32::NAN; m * n];
    let scale = a_scale_2 * w_scale_2;
    for block_y in 0..m.div_ceil(TILE_M) {
        for block_x in 0..n.div_ceil(TILE_N) {
            let (row_base, col_base) = (block_y * TILE_M, block_x * TILE_N);
            if k == 0 {
                for row in row_base..(row_base + TILE_M).min(m) {
                    for col in col_base..(col_base + TILE_N).min(n) {
                        c[row * n + col] = 0.0;
                    }
                }
                continue;
            }
            let operand = |codes, scales, row0, rows| Operand {
                codes,
                scales,
                row0,
                rows,
                row_bytes: k / 2,
                row_scales: k / 16,
                plant,
            };
            let a = operand(a_codes, a_scales, row_base, m);
            let w = operand(w_codes, w_scales, col_base, n);
            let mut smem = vec![0u8; SMEM_BYTES];
            let mut tmem = Tmem(vec![0u32; TMEM_LANES * TMEM_COLS]);
            for k0 in (0..k).step_by(STAGE_K) {
                let mmas = ((k - k0) / MMA_K).min(STAGE_MMAS);
                load_codes(&mut smem, S_A, &a, k0 / 2, mmas);
                load_codes(&mut smem, S_W, &w, k0 / 2, mmas);
                load_scales(&mut smem, S_SFA, &a, k0 / 16, mmas);
                load_scales(&mut smem, S_SFW, &w, k0 / 16, mmas);
                let sfw_col = if plant == Plant::ScaleColumnsMixed {
                    TMEM_SFA_COL
                } else {
                    TMEM_SFW_COL
                };
                for s in 0..mmas {
                    let sfa = smem_desc(S_SFA + s * SF_BLOCK_BYTES, 0, 128);
                    let sfw = smem_desc(S_SFW + s * SF_BLOCK_BYTES, 0, 128);
                    cp_32x128b_warpx4(&mut tmem, TMEM_SFA_COL + 4 * s, &smem, sfa)?;
                    cp_32x128b_warpx4(&mut tmem, sfw_col + 4 * s, &smem, sfw)?;
                }
                let (lbo, sbo) = if plant == Plant::StridesSwapped {
                    (256, 128)
                } else {
                    (128, 256)
                };
                for s in 0..mmas {
                    let op = Mma {
                        d: TMEM_ACC_COL,
                        a: smem_desc(S_A + s * OP_BLOCK_BYTES, lbo, sbo),
                        b: smem_desc(S_W + s * OP_BLOCK_BYTES, lbo, sbo),
                        idesc: instr_desc(plant),
                        sfa: TMEM_SFA_COL + 4 * s,
                        sfb: TMEM_SFW_COL + 4 * s,
                        accumulate: k0 > 0 || s > 0,
                    };
                    mma(&mut tmem, &smem, &op)?;
                }
            }
            // Epilogue: warp w reads lanes [32 w, 32 w + 32), 16 columns per load.
            for warp in 0..THREADS / 32 {
                for lane in 0..32 {
                    let row = row_base + warp * 32 + lane;
                    let mut c0 = 0;
                    while c0 < TILE_N && col_base + c0 < n {
                        let v: Vec<u32> = (0..16)
                            .map(|j| *tmem.at(warp * 32 + lane, TMEM_ACC_COL + c0 + j))
                            .collect();
                        if row < m {
                            for (j, bits) in v.iter().enumerate() {
                                let col = col_base + c0 + j;
                                if col < n {
                                    c[row * n + col] = f32::from_bits(*bits) * scale;
                                }
                            }
                        }
                        c0 += 16;
                    }
                }
            }
        }
    }
    Ok(c)
}

/// `nvfp4_gemm_w4a4_sm100` as the kernel computes it (arguments of
/// [`crate::cpu::nvfp4_gemm_w4a4`]); an error when the kernel builds a descriptor the model
/// does not cover.
pub fn nvfp4_gemm_w4a4_sm100(
    a: (&[u8], &[u8], f32),
    w: (&[u8], &[u8], f32),
    shape: (usize, usize, usize),
) -> Result<Vec<f32>, String> {
    gemm_with(a, w, shape, Plant::None)
}
