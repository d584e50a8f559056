//! The row ops of `kv_rows.cu` on the GPU: FP8 K=V rows (and bf16 rows, FP8 rows without e4m3
//! values) encoded into the pool exactly as the engine encodes them (bytes equal, special values included, skipped rows and the bytes
//! between rows untouched), and per-head norm + RoPE with the engine's bits (query heads, K=V rows,
//! inverse on outputs, a head of 19 values, positions up to 2^20). Skips without a GPU
//! (fails under `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{paged::layout::RowFormat, rope::Rope, synth::Rng};
use kernels::{
    cuda::Gpu,
    rows::{self, NormRope, RowNorm},
};

#[test]
fn gpu_fp8_kv_encode_writes_the_engines_bytes() {
    let Some(gpu) = Gpu::for_test("gpu_fp8_kv_encode_writes_the_engines_bytes") else {
        return;
    };
    let mut rng = Rng::for_tensor(61, "gpu-fp8-encode");
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e30,
        -1e-40,
        -0.0,
        448.0,
        464.0,
        f32::MIN_POSITIVE,
    ];
    for (nope, rope) in [
        (448usize, 64usize),
        (24, 8),
        (40, 24),
        (0, 32),
        (0, 512),
        (100, 12),
        (64, 0),
    ] {
        let dim = nope + rope;
        let bytes = RowFormat::Fp8Kv { nope, rope }.row_bytes(dim);
        let count = 37;
        let mut values: Vec<f32> = (0..count * dim)
            .map(|i| rng.normal() * 10f32.powi((i / 64 % 9) as i32 - 4))
            .collect();
        for (r, row) in values.chunks_exact_mut(dim).enumerate() {
            match r % 5 {
                0 => row.fill(0.0),
                1 => row[r % dim] = specials[r % specials.len()],
                _ => {}
            }
        }
        // Every other row at a gap of 3 bytes; row 5 skipped.
        let offsets: Vec<i64> = (0..count)
            .map(|r| {
                if r == 5 {
                    -1
                } else {
                    (r * (bytes + 3) + 1) as i64
                }
            })
            .collect();
        let pool = vec![0xAAu8; count * (bytes + 3) + 8];
        let mut want = pool.clone();
        rows::fp8_kv_encode(&values, (nope, rope), &mut want, &offsets);
        let got = gpu
            .fp8_kv_encode(&values, (nope, rope), &pool, &offsets)
            .unwrap();
        if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!(
                "nope {nope} rope {rope}: byte {at} (row {}) is {:#04x}, the engine writes {:#04x}",
                at / (bytes + 3),
                got[at],
                want[at]
            );
        }
    }
}

#[test]
fn gpu_norm_rope_rows_give_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_norm_rope_rows_give_the_engines_bits") else {
        return;
    };
    let mut rng = Rng::for_tensor(62, "gpu-norm-rope");
    let rope = Rope::plain(10_000.0, 64);
    let small = Rope::plain(160_000.0, 16);
    let weight: Vec<f32> = (0..512).map(|_| 1.0 + rng.normal() * 0.1).collect();
    for (heads, head_dim, table, norm, inverse) in [
        (64usize, 512usize, &rope, RowNorm::Unweighted, false),
        (1, 512, &rope, RowNorm::Weighted(&weight), false),
        (64, 512, &rope, RowNorm::None, true),
        (5, 64, &small, RowNorm::Unweighted, false),
        (3, 19, &small, RowNorm::Unweighted, false),
    ] {
        let spec = NormRope {
            heads,
            head_dim,
            rope: table.rope_dim(),
            norm,
            eps: 1e-6,
            inverse,
        };
        let positions = [0usize, 1, 7, 4095, 65_537, 1 << 20];
        let x: Vec<f32> = (0..positions.len() * heads * head_dim)
            .map(|_| rng.normal() * 3.0)
            .collect();
        let mut want = x.clone();
        rows::norm_rope_rows(&mut want, &spec, &positions, table);
        let sin_cos = rows::sin_cos_table(table, &positions);
        let got = gpu.norm_rope_rows(&x, &spec, &sin_cos).unwrap();
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!(
                "{heads}x{head_dim} {norm:?} inverse {inverse}: [{i}] {} vs the engine's {}",
                got[i], want[i]
            );
        }
    }
}
