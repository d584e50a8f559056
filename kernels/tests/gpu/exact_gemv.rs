//! `exact_gemv.cu` on the GPU gives the engine's bits (`engine::tensor::dots_source`) in every
//! stored format: awkward shapes (tails of 1 to 7 values, rows past a block, an offset into the
//! weight, 1 to 33 vectors) and V4-sized rows. Skips without a GPU (fails under
//! `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{
    synth::Rng,
    tensor::rows::{Bf16Rows, F32Rows, Fp8BlockRows, Mxfp4Rows, Nvfp4Rows},
};
use kernels::{
    cpu::engine_dots,
    cuda::{Gpu, StoredRows},
};

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: [{i}] {:e} vs the engine's {:e}", got[i], want[i]);
    }
}

#[test]
fn gpu_exact_gemv_gives_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_exact_gemv_gives_the_engines_bits") else {
        return;
    };
    let mut rng = Rng::for_tensor(91, "gpu-exact-gemv");
    for (total, cols, (row0, rows), vectors) in [
        (40usize, 13usize, (0usize, 40usize), 1usize),
        (70, 64, (5, 60), 9),
        (130, 135, (128, 2), 4),
        (300, 1031, (17, 283), 33),
        (1024, 4096, (0, 1024), 8),
    ] {
        let what = format!("{total}x{cols} rows {row0}+{rows} vectors {vectors}");
        let x: Vec<f32> = (0..vectors * cols).map(|_| rng.normal()).collect();
        let shape = (total, cols);
        let range = (row0, rows);
        let w: Vec<f32> = (0..total * cols).map(|_| rng.normal()).collect();
        let src = F32Rows {
            rows: |r: usize| &w[r * cols..(r + 1) * cols],
            cols,
        };
        let got = gpu
            .exact_gemv(StoredRows::F32(&w), shape, range, &x, vectors)
            .unwrap();
        same_bits(
            &got,
            &engine_dots(&src, range, &x, vectors),
            &format!("f32 {what}"),
        );
        let bf16: Vec<u8> = w
            .iter()
            .flat_map(|&v| engine::formats::f32_to_bf16(v).to_le_bytes())
            .collect();
        let got = gpu
            .exact_gemv(StoredRows::Bf16(&bf16), shape, range, &x, vectors)
            .unwrap();
        let src = Bf16Rows { bytes: &bf16, cols };
        same_bits(
            &got,
            &engine_dots(&src, range, &x, vectors),
            &format!("bf16 {what}"),
        );
        let codes: Vec<u8> = (0..total * cols)
            .map(|_| (rng.next_u64() % 0xFE) as u8)
            .collect();
        let codes: Vec<u8> = codes
            .into_iter()
            .map(|c| if c & 0x7F == 0x7F { 0 } else { c })
            .collect();
        let scales: Vec<f32> = (0..total.div_ceil(128) * cols.div_ceil(128))
            .map(|i| 2f32.powi(i as i32 % 7 - 3))
            .collect();
        let got = gpu
            .exact_gemv(
                StoredRows::Fp8Block {
                    codes: &codes,
                    scales: &scales,
                },
                shape,
                range,
                &x,
                vectors,
            )
            .unwrap();
        let src = Fp8BlockRows {
            codes: &codes,
            scales: &scales,
            cols,
        };
        same_bits(
            &got,
            &engine_dots(&src, range, &x, vectors),
            &format!("fp8 {what}"),
        );
        let cols4 = cols.next_multiple_of(32);
        let x4: Vec<f32> = (0..vectors * cols4).map(|_| rng.normal()).collect();
        let packed: Vec<u8> = (0..total * cols4 / 2)
            .map(|_| rng.next_u64() as u8)
            .collect();
        let nv_scales: Vec<u8> = (0..total * cols4 / 16)
            .map(|_| (rng.next_u64() % 0x7E) as u8)
            .collect();
        let mx_scales: Vec<u8> = (0..total * cols4 / 32)
            .map(|_| 120 + (rng.next_u64() % 14) as u8)
            .collect();
        let shape4 = (total, cols4);
        let nv = StoredRows::Nvfp4 {
            packed: &packed,
            scales: &nv_scales,
            scale_2: 0.37,
        };
        let src = Nvfp4Rows {
            packed: &packed,
            scales: &nv_scales,
            scale_2: 0.37,
            cols: cols4,
        };
        let got = gpu.exact_gemv(nv, shape4, range, &x4, vectors).unwrap();
        same_bits(
            &got,
            &engine_dots(&src, range, &x4, vectors),
            &format!("nvfp4 {what}"),
        );
        let mx = StoredRows::Mxfp4 {
            packed: &packed,
            scales: &mx_scales,
        };
        let src = Mxfp4Rows {
            packed: &packed,
            scales: &mx_scales,
            cols: cols4,
        };
        let got = gpu.exact_gemv(mx, shape4, range, &x4, vectors).unwrap();
        same_bits(
            &got,
            &engine_dots(&src, range, &x4, vectors),
            &format!("mxfp4 {what}"),
        );
    }
}

#[test]
fn gpu_exact_gemv_refuses_a_weight_of_the_wrong_size() {
    let Some(gpu) = Gpu::for_test("gpu_exact_gemv_refuses_a_weight_of_the_wrong_size") else {
        return;
    };
    let w = vec![0f32; 10];
    assert!(
        gpu.exact_gemv(StoredRows::F32(&w), (3, 4), (0, 3), &[0.0; 4], 1)
            .is_err()
    );
    let packed = vec![0u8; 8];
    let nv = StoredRows::Nvfp4 {
        packed: &packed,
        scales: &[0; 2],
        scale_2: 1.0,
    };
    assert!(gpu.exact_gemv(nv, (1, 16), (0, 1), &[0.0; 16], 1).is_err());
}
