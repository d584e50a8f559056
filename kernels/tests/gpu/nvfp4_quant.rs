//! The NVFP4 activation quantizer on the GPU equals its CPU reference byte for byte, at
//! awkward shapes, with outputs poisoned before every run. Skips (with a message) without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::synth::Rng;
use kernels::{cpu, cuda::Gpu};

#[test]
fn gpu_matches_cpu_reference() {
    let Some(gpu) = Gpu::for_test("gpu_matches_cpu_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(1, "nvfp4");
    for (rows, cols) in [(1usize, 16usize), (3, 48), (17, 1040), (129, 4096), (0, 32)] {
        for scale in [1.0f32, 0.003, 37.5] {
            let x: Vec<f32> = (0..rows * cols)
                .map(|i| {
                    if i % 97 == 0 {
                        0.0
                    } else {
                        rng.normal() * scale * 2.0
                    }
                })
                .collect();
            let global = scale * 2.0 * 4.0 / (6.0 * 448.0);
            let want = cpu::nvfp4_quantize_rows(&x, rows, cols, global).unwrap();
            for poison in [0x00, 0xFF] {
                let got = gpu
                    .nvfp4_quantize_rows(&x, rows, cols, global, poison)
                    .unwrap();
                assert_eq!(got, want, "{rows}x{cols} scale {scale} poison {poison:#x}");
            }
        }
    }
}
