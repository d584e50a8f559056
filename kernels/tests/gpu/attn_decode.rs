//! Split-KV decode attention with sinks on the GPU against the f64 CPU reference: ragged
//! requests (including one with no rows), more splits than rows (empty splits), rows scattered
//! at arbitrary pool offsets, long contexts. Outputs poisoned with NaN. Bound: relative error
//! <= 1e-4 of the largest |row value|. Skips without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::synth::Rng;
use kernels::{
    cpu,
    cuda::{AttnShape, Gpu},
};

fn case(gpu: &Gpu, rng: &mut Rng, counts: &[usize], heads: usize, dim: usize, splits: usize) {
    let total: usize = counts.iter().sum();
    // Rows live at shuffled, non-contiguous positions of a larger pool.
    let slots = total * 2 + 3;
    let mut pool = vec![0u8; slots * dim * 4];
    let mut order: Vec<usize> = (0..slots).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut rows = Vec::with_capacity(total);
    let mut offsets = Vec::with_capacity(total);
    for &slot in order.iter().take(total) {
        let row: Vec<f32> = (0..dim).map(|_| rng.normal()).collect();
        let at = slot * dim * 4;
        for (k, v) in row.iter().enumerate() {
            pool[at + 4 * k..at + 4 * k + 4].copy_from_slice(&v.to_le_bytes());
        }
        offsets.push(at as i64);
        rows.push(row);
    }
    let mut starts = vec![0usize];
    for c in counts {
        starts.push(starts.last().unwrap() + c);
    }
    let q: Vec<f32> = (0..counts.len() * heads * dim)
        .map(|_| rng.normal())
        .collect();
    let sinks: Vec<f32> = (0..heads).map(|_| rng.normal()).collect();
    let scale = 1.0 / (dim as f32).sqrt();
    let want = cpu::attn_decode(&q, &rows, &starts, &sinks, dim, scale);
    let starts_i: Vec<i64> = starts.iter().map(|&s| s as i64).collect();
    let got = gpu
        .attn_decode(
            &q,
            &pool,
            &offsets,
            &starts_i,
            &sinks,
            AttnShape {
                heads,
                dim,
                splits,
                scale,
            },
        )
        .unwrap();
    let bound = 1e-4 * rows.iter().flatten().fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= bound,
            "counts {counts:?} heads {heads} dim {dim} splits {splits}: [{i}] gpu {g} ref {w}"
        );
    }
}

#[test]
fn gpu_attention_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_attention_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(3, "attn");
    case(&gpu, &mut rng, &[1], 1, 32, 1);
    case(&gpu, &mut rng, &[5, 0, 130], 4, 512, 7);
    case(&gpu, &mut rng, &[3, 2], 8, 96, 64);
    case(&gpu, &mut rng, &[200, 17, 1], 3, 200, 4);
    case(&gpu, &mut rng, &[65_536], 1, 128, 32);
}

/// NaN in, NaN out on the device as in the reference: rows whose every score is NaN fill one
/// split of request 0 (a merge that skipped it would look finite); request 1 stays finite.
#[test]
fn gpu_attention_propagates_a_nan_split() {
    let Some(gpu) = Gpu::for_test("gpu_attention_propagates_a_nan_split") else {
        return;
    };
    let (heads, dim, splits) = (2usize, 32usize, 4usize);
    let mut rng = Rng::for_tensor(8, "attn-nan");
    let mut rows: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..dim).map(|_| rng.normal()).collect())
        .collect();
    for row in &mut rows[2..4] {
        row[5] = f32::NAN; // request 0 has rows 0..8: split 1 is rows 2..4
    }
    let pool: Vec<u8> = rows
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let offsets: Vec<i64> = (0..16).map(|r| (r * dim * 4) as i64).collect();
    let q: Vec<f32> = (0..2 * heads * dim).map(|_| rng.normal()).collect();
    let sinks = vec![0.1f32, -0.2];
    let scale = 1.0 / (dim as f32).sqrt();
    let shape = AttnShape {
        heads,
        dim,
        splits,
        scale,
    };
    let got = gpu
        .attn_decode(&q, &pool, &offsets, &[0, 8, 16], &sinks, shape)
        .unwrap();
    let want = cpu::attn_decode(&q, &rows, &[0, 8, 16], &sinks, dim, scale);
    let per_request = heads * dim;
    assert!(got[..per_request].iter().all(|v| v.is_nan()), "request 0");
    assert!(want[..per_request].iter().all(|v| v.is_nan()));
    assert!(
        got[per_request..].iter().all(|v| v.is_finite()),
        "request 1"
    );
}
