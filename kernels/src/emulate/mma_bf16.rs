//! A model of bf16 `mma.sync.m16n8k16.row.col` (f32 accumulate) as the PTX ISA documents its
//! fragments (`mma_bf16.cuh`), for the emulations of the kernels that put a request's heads on
//! the M side:
//!
//! - A (16 x 16, row-major): register `i` of lane `4 g + t` holds row `g + 8 (i % 2)`, columns
//!   `2 t + 8 (i / 2)` and the next, the lower column in the low half;
//! - B (16 x 8): register `i` holds rows `2 t + 8 i` and the next of column `g`;
//! - D (16 x 8, f32): `d0, d1` row `g`, columns `2 t, 2 t + 1`; `d2, d3` row `g + 8`.

use engine::formats::bf16_to_f32;

/// The registers of one warp's MMA: per lane A and B.
pub(super) type Regs = ([[u32; 4]; 32], [[u32; 2]; 32]);

/// `ld_pair`: the bf16 pair at `at` (bits) as one register, the lower index in the low half.
pub(super) fn pair(s: &[u16], at: usize) -> u32 {
    u32::from(s[at]) | (u32::from(s[at + 1]) << 16)
}

fn half(reg: u32, i: usize) -> f64 {
    f64::from(bf16_to_f32((reg >> (16 * i)) as u16))
}

/// The MMA: `acc[lane]` += A · B, each sum exact then rounded once to f32.
pub(super) fn mma_16816(regs: &Regs, acc: &mut [[f32; 4]; 32]) {
    let (a, b) = regs;
    let a_at = |r: usize, k: usize| half(a[4 * (r % 8) + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2);
    let b_at = |k: usize, c: usize| half(b[4 * c + (k % 8) / 2][k / 8], k % 2);
    for r in 0..16 {
        for c in 0..8 {
            let sum: f64 = (0..16).map(|k| a_at(r, k) * b_at(k, c)).sum();
            acc[4 * (r % 8) + c / 2][2 * (r / 8) + c % 2] += sum as f32;
        }
    }
}
