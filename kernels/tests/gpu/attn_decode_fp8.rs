//! Heads-batched decode attention over FP8 rows on the GPU (`attn_decode_fp8.cu`) against the
//! f64 CPU reference (`cpu::attn_decode_fp8`, within `2^-8 · max |row value|`) and against its
//! emulation (`emulate::attn_decode_fp8`, same bound): awkward head counts and row widths,
//! empty requests, empty slots, rows at odd byte offsets, more parts than rows, V4-Flash's shape
//! at 8K rows; NaN in, NaN out; bad inputs refused before any launch. Skips without a GPU
//! (fails under `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::synth::Rng;
use kernels::{
    attn_fp8::{Fp8AttnShape, Synthetic, synthetic},
    cpu,
    cuda::Gpu,
    emulate,
};

fn shape(heads: usize, nope: usize, rope: usize, parts: usize) -> Fp8AttnShape {
    Fp8AttnShape {
        heads,
        nope,
        rope,
        scale: 1.0 / ((nope + rope) as f32).sqrt(),
        parts,
    }
}

fn on_gpu(gpu: &Gpu, c: &Synthetic) -> Vec<f32> {
    gpu.attn_decode_fp8(&c.q, &c.pool, &c.offsets, &c.starts, &c.sinks, c.shape)
        .unwrap()
}

fn check(gpu: &Gpu, c: &Synthetic, with_emulation: bool) {
    let got = on_gpu(gpu, c);
    let want = cpu::attn_decode_fp8(&c.q, &c.pool, &c.offsets, &c.starts, &c.sinks, &c.shape);
    let w = c.worst(&got, &want);
    eprintln!("{:?}: {w:.3} of the bound", c.shape);
    assert!(
        w <= 1.0,
        "{:?}: {w} of the bound from the reference",
        c.shape
    );
    if with_emulation {
        let emulated =
            emulate::attn_decode_fp8(&c.q, &c.pool, &c.offsets, &c.starts, &c.sinks, &c.shape);
        let w = c.worst(&got, &emulated);
        assert!(
            w <= 1.0,
            "{:?}: {w} of the bound from the emulation",
            c.shape
        );
    }
}

#[test]
fn gpu_fp8_attention_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_fp8_attention_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(31, "gpu-attn-fp8");
    for (heads, nope, rope, counts, parts) in [
        (1, 24, 8, vec![0, 1, 17], 1),
        (3, 48, 16, vec![15, 16, 33, 100], 3),
        (4, 0, 32, vec![9, 40], 2),
        (16, 40, 24, vec![31, 2], 5),
        (17, 448, 64, vec![40, 5], 7),
        (33, 104, 16, vec![64, 1, 18], 132),
        (64, 448, 64, vec![70, 0, 300], 4),
    ] {
        let c = synthetic(&mut rng, shape(heads, nope, rope, parts), &counts, 7);
        check(&gpu, &c, true);
    }
    // V4-Flash: 64 heads (16 per GPU at TP 4) over 8K rows, one part per SM of an H100.
    for heads in [64, 16] {
        let c = synthetic(&mut rng, shape(heads, 448, 64, 132), &[8192, 8192, 100], 0);
        check(&gpu, &c, false);
    }
}

/// NaN in, NaN out: an undefined index choice (offset -2) poisons its request, a NaN sink its
/// head; the rest stays finite.
#[test]
fn gpu_fp8_attention_propagates_nan() {
    let Some(gpu) = Gpu::for_test("gpu_fp8_attention_propagates_nan") else {
        return;
    };
    let mut rng = Rng::for_tensor(32, "gpu-attn-fp8-nan");
    let mut c = synthetic(&mut rng, shape(18, 48, 16, 4), &[40, 33], 7);
    c.offsets[45] = -2;
    c.sinks[7] = f32::NAN;
    let got = on_gpu(&gpu, &c);
    let (heads, dim) = (18, 64);
    for b in 0..2 {
        for h in 0..heads {
            let at = (b * heads + h) * dim;
            let head = &got[at..at + dim];
            if b == 1 || h == 7 {
                assert!(head.iter().all(|v| v.is_nan()), "request {b} head {h}");
            } else {
                assert!(head.iter().all(|v| v.is_finite()), "request {b} head {h}");
            }
        }
    }
}

#[test]
fn gpu_fp8_attention_refuses_bad_inputs() {
    let Some(gpu) = Gpu::for_test("gpu_fp8_attention_refuses_bad_inputs") else {
        return;
    };
    let mut rng = Rng::for_tensor(33, "gpu-attn-fp8-bad");
    let c = synthetic(&mut rng, shape(2, 24, 8, 1), &[3], 0);
    let past_end = vec![c.pool.len() as i64 - 10, 3, 3];
    let err = gpu
        .attn_decode_fp8(&c.q, &c.pool, &past_end, &c.starts, &c.sinks, c.shape)
        .unwrap_err();
    assert!(err.to_string().contains("past the pool"), "{err}");
    let too_many = Fp8AttnShape {
        heads: 65,
        ..c.shape
    };
    assert!(
        gpu.attn_decode_fp8(&c.q, &c.pool, &c.offsets, &c.starts, &c.sinks, too_many)
            .is_err()
    );
}
