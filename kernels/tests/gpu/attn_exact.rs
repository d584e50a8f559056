//! `attn_exact.cu` on the GPU gives the engine's bits (`engine::model::attention::attend`):
//! tokens with no key, one, a few and many (rows at scattered offsets), 3 and 64 heads, rows of
//! 32 and 512, a large sink; a token with an undefined index choice (a negative offset) is NaN
//! in every head, the others untouched. Skips without a GPU (fails under
//! `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{model::attention::attend, synth::Rng};
use kernels::cuda::Gpu;

#[test]
fn gpu_exact_attention_gives_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_exact_attention_gives_the_engines_bits") else {
        return;
    };
    let mut rng = Rng::for_tensor(101, "gpu-attn-exact");
    for (heads, dim, counts) in [
        (3usize, 32usize, vec![0usize, 1, 9, 300]),
        (64, 512, vec![128, 1000, 5]),
    ] {
        let total: usize = counts.iter().sum();
        let rows: Vec<Vec<f32>> = (0..total + 7)
            .map(|_| (0..dim).map(|_| rng.normal()).collect())
            .collect();
        let pool: Vec<u8> = rows
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        // Each token's keys: a scattered pick of the pool's rows.
        let mut offsets = Vec::new();
        let mut starts = vec![0i64];
        let mut keys: Vec<Vec<usize>> = Vec::new();
        for &n in &counts {
            let mine: Vec<usize> = (0..n)
                .map(|_| (rng.next_u64() % rows.len() as u64) as usize)
                .collect();
            offsets.extend(mine.iter().map(|&r| (r * dim * 4) as i64));
            starts.push(offsets.len() as i64);
            keys.push(mine);
        }
        let tokens = counts.len();
        let q: Vec<f32> = (0..tokens * heads * dim).map(|_| rng.normal()).collect();
        let mut sinks: Vec<f32> = (0..heads).map(|_| rng.normal()).collect();
        sinks[0] = 40.0;
        let scale = 1.0 / (dim as f32).sqrt();
        let got = gpu
            .attn_exact(&q, &pool, &offsets, &starts, &sinks, scale)
            .unwrap();
        for (t, mine) in keys.iter().enumerate() {
            let key_rows: Vec<&[f32]> = mine.iter().map(|&r| rows[r].as_slice()).collect();
            let want = attend(
                &q[t * heads * dim..(t + 1) * heads * dim],
                &key_rows,
                &sinks,
                scale,
                dim,
            );
            let got_t = &got[t * heads * dim..(t + 1) * heads * dim];
            if let Some(i) = (0..want.len()).find(|&i| got_t[i].to_bits() != want[i].to_bits()) {
                panic!(
                    "{heads} heads of {dim}, token {t} ({} keys): [{i}] {} vs the engine's {}",
                    mine.len(),
                    got_t[i],
                    want[i]
                );
            }
        }
        // An undefined choice in token 1's list: token 1 NaN, the others as before.
        let mut poisoned = offsets.clone();
        poisoned[starts[1] as usize] = -2;
        let again = gpu
            .attn_exact(&q, &pool, &poisoned, &starts, &sinks, scale)
            .unwrap();
        let per = heads * dim;
        assert!(again[per..2 * per].iter().all(|v| v.is_nan()));
        assert_eq!(&again[..per], &got[..per]);
        assert_eq!(&again[2 * per..], &got[2 * per..]);
    }
}
