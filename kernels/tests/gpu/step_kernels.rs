//! `step.cu`'s kernels (embedding rows, row copies, position bias, scale, block sums, held
//! expert ids and the others' rows cleared, the indexer choice's key offsets) on the GPU
//! against their CPU references (`EmulatedKernels`), on random inputs at awkward shapes,
//! through the one `Kernels` interface the decode step launches them by: equal bits, NaN rows
//! for ids outside the table, skipped rows, poisoned choices. Skips without a GPU (fails under
//! `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, reason = "test code")]

use engine::{
    config::ExpertFormat,
    model::Model,
    synth::{GenerateOptions, Preset, Rng, generate},
};
use kernels::{
    cuda::{CudaKernels, Gpu},
    step::{emulated::EmulatedKernels, kernels::Kernels},
};

/// Every kernel's outputs on `k`, read back, for the same inputs: the f32 outputs and the key
/// offsets.
fn outputs<K: Kernels>(k: &K, model: &Model, seed: u64) -> (Vec<Vec<f32>>, Vec<i64>)
where
    K::Error: std::fmt::Debug,
{
    let mut rng = Rng::for_tensor(seed, "gpu-step-kernels");
    let mut values = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal()).collect() };
    let mut out = Vec::new();
    let read = |b: &K::F| k.read(b, 0..K::f_len(b)).unwrap();
    // Embedding rows: 5 ids (one past the table, one negative), 3 streams.
    let table = k.upload_table(&model.weights.embed).unwrap();
    let vocab = model.config.vocab_size as i32;
    let ids = k.upload_i(&[3, vocab, 17, -1, vocab - 1]).unwrap();
    let mut rows = k.zeros(5 * 3 * model.config.hidden_size).unwrap();
    k.embed_rows(&table, &ids, (5, 3), &mut rows).unwrap();
    out.push(read(&rows));
    // Row copies of width 37, one skipped, overlapping sources.
    let src = k.upload(&values(1000)).unwrap();
    let mut dst = k.upload(&values(400)).unwrap();
    let from = k.upload_l(&[0, 5, 900, 300, 301]).unwrap();
    let to = k.upload_l(&[0, 37, -1, 363, 100]).unwrap();
    k.copy_rows(&src, &from, &mut dst, &to, 37, 5).unwrap();
    out.push(read(&dst));
    // Position bias of period 24 over 7 windows and a tail, then a scale.
    let mut x = k.upload(&values(7 * 24 + 5)).unwrap();
    let bias = k.upload(&values(24)).unwrap();
    k.add_periodic(&mut x, &bias, 24, 7 * 24 + 3).unwrap();
    k.scale_values(&mut x, 0.353_553_4, 7 * 24 + 1).unwrap();
    out.push(read(&x));
    // Three blocks of 37 summed in block order, a NaN in one, -0 in every block of a column,
    // two values out of the sum's reach past the blocks.
    let mut parts = values(3 * 37 + 2);
    parts[40] = f32::NAN;
    for b in 0..3 {
        parts[b * 37 + 9] = -0.0;
    }
    let parts = k.upload(&parts).unwrap();
    let mut sum = k.upload(&values(40)).unwrap();
    k.sum_blocks(&parts, (3, 37), &mut sum).unwrap();
    out.push(read(&sum));
    // A rank's held ids of 300 pairs (experts 40..52 of 64 held; others', negative and past
    // the model's among them), then the others' rows of 13 cleared to -0 (a NaN row of no
    // expert kept); the ids as f32 for the comparison.
    let experts: Vec<i32> = (0..300).map(|p: i32| p * 37 % 70 - 3).collect();
    let experts = k.upload_i(&experts).unwrap();
    let mut ids = k.upload_i(&[7; 301]).unwrap();
    k.held_ids(&experts, (40, 12), 64, 300, &mut ids).unwrap();
    let held = k.read_i(&ids, 0..301).unwrap();
    out.push(held.iter().map(|&i| i as f32).collect());
    let mut ys = values(300 * 13 + 4);
    ys[13 * 2] = f32::NAN;
    let mut ys = k.upload(&ys).unwrap();
    k.clear_unheld_rows(&mut ys, &ids, 13, 300).unwrap();
    out.push(read(&ys));
    // FP8 K=V rounding of 3 of 4 rows of 100 + 28 (a partial scale block): values over a wide
    // range of magnitudes, a NaN, an infinity, a huge and a subnormal value; the fourth row
    // stays as it was.
    let mut kv = values(4 * 128);
    for (i, v) in kv.iter_mut().enumerate() {
        *v *= 2f32.powi((i % 41) as i32 - 20);
    }
    kv[5] = f32::NAN;
    kv[130] = f32::INFINITY;
    kv[200] = 1e30;
    kv[260] = 1e-40;
    kv[110] = f32::NAN;
    let mut kv = k.upload(&kv).unwrap();
    k.fp8_kv_round(&mut kv, (100, 28), 3).unwrap();
    out.push(read(&kv));
    // FP8 K=V rows of 24 + 8 values (12 f32s each) stored into an arena at byte offsets (one
    // skipped), then exact attention of 2 tokens x 2 heads over them, read as FP8 rows.
    let fp8 = engine::paged::layout::RowFormat::Fp8Kv { nope: 24, rope: 8 };
    let rows = k.upload(&values(5 * 32)).unwrap();
    let mut arena = k.upload(&values(64)).unwrap();
    let at = k.upload_l(&[0, 48, -1, 96, 192]).unwrap();
    k.fp8_kv_store(&rows, (24, 8), &mut arena, &at, 5).unwrap();
    out.push(read(&arena));
    let q = k.upload(&values(2 * 2 * 32)).unwrap();
    let sinks = k.upload(&values(2)).unwrap();
    let offsets = k.upload_l(&[0, 48, 96, 192, 192, 0]).unwrap();
    let starts = k.upload_l(&[0, 4, 6]).unwrap();
    let mut attended = k.zeros(2 * 2 * 32).unwrap();
    k.attn_exact(
        &q,
        (&arena, fp8),
        (&offsets, &starts),
        &sinks,
        (2, 2, 32, 4),
        0.176_776_7,
        &mut attended,
    )
    .unwrap();
    out.push(read(&attended));
    // Argmaxes of 6 rows of 1000 (not a multiple of the block): random; all equal (ties to
    // the first); the largest twice (the first); an infinity then a NaN (the first bad index
    // is the infinity's); none finite; signed zeros only (equal: the first). Then 3 rows of 3.
    let mut logits = values(6 * 1000);
    logits[1000..2000].fill(0.25);
    logits[2000 + 417] = 50.0;
    logits[2000 + 999] = 50.0;
    logits[3000 + 300] = f32::INFINITY;
    logits[3000 + 500] = f32::NAN;
    logits[4000..5000].fill(f32::NEG_INFINITY);
    logits[5000..6000].fill(0.0);
    logits[5000 + 3] = -0.0;
    let logits = k.upload(&logits).unwrap();
    let mut picks = k.zeros_i(12).unwrap();
    k.argmax_rows(&logits, (6, 1000), &mut picks).unwrap();
    let small = k
        .upload(&[1.0, 3.0, 3.0, f32::NAN, 2.0, 2.0, -1.0, -1.0, -0.5])
        .unwrap();
    let mut small_picks = k.zeros_i(6).unwrap();
    k.argmax_rows(&small, (3, 3), &mut small_picks).unwrap();
    for (b, n) in [(&picks, 12), (&small_picks, 6)] {
        out.push(
            k.read_i(b, 0..n)
                .unwrap()
                .iter()
                .map(|&v| v as f32)
                .collect(),
        );
    }
    // Chosen key offsets: three tokens of k = 4, the middle one poisoned, the last short.
    let chosen = k
        .upload_i(&[0, 2, 5, 9, -2, -2, -2, -2, 1, 3, -1, -1])
        .unwrap();
    let tokens = k.upload_i(&[0, 1, 2]).unwrap();
    let starts = k.upload_l(&[2, 7, 11]).unwrap();
    let counts = k.upload_i(&[4, 3, 2]).unwrap();
    let bases = k.upload_l(&[4096, 0, 131_072]).unwrap();
    let mut offsets = k.upload_l(&[77; 14]).unwrap();
    k.chosen_offsets(
        &chosen,
        4,
        (&tokens, &starts, &counts, &bases),
        2048,
        3,
        &mut offsets,
    )
    .unwrap();
    (out, k.read_l(&offsets).unwrap())
}

#[test]
fn gpu_step_kernels_equal_their_references() {
    let Some(gpu) = Gpu::for_test("gpu_step_kernels_equal_their_references") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("pdserve-step-kernels-{}", std::process::id()));
    let options = GenerateOptions::new(Preset::Tiny, 8, ExpertFormat::Nvfp4, dir.clone());
    generate(&options).unwrap();
    let model = Model::load(&dir).unwrap();
    let cuda = CudaKernels::new(std::sync::Arc::new(gpu));
    let reference = EmulatedKernels::new(&model.config);
    for seed in 0..3 {
        let (got, got_offsets) = outputs(&cuda, &model, seed);
        let (want, want_offsets) = outputs(&reference, &model, seed);
        assert_eq!(got_offsets, want_offsets, "chosen_offsets, seed {seed}");
        assert_eq!(
            want_offsets[..2],
            [77, 77],
            "slots before the first token are untouched"
        );
        assert_eq!(want_offsets[7..10], [-2, -2, -2], "a poisoned choice");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "kernel {i}");
            for (j, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "kernel {i} seed {seed} at {j}: {a} vs the reference's {b}"
                );
            }
        }
    }
    // The fast routed experts: the grouped GEMV against its f64 reference, within 1e-5 of the
    // largest output (its own tests hold it to a per-row bound), an expert outside the stack
    // a NaN row in both.
    let layer = &model.weights.layers[0].moe.experts;
    let mut rng = Rng::for_tensor(4, "gpu-fast-pairs");
    let x: Vec<f32> = (0..3 * model.config.hidden_size)
        .map(|_| rng.normal())
        .collect();
    let experts = layer.len() as i32;
    let (tokens, which) = ([0, 1, 2, 1, 0], [0, experts - 1, 3, experts, 2]);
    let got = cuda.pairs(layer, &tokens, &which, &x);
    let want = reference.pairs(layer, &tokens, &which, &x);
    let top = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let rows = want.len() / 5;
    for (j, (a, b)) in got.iter().zip(&want).enumerate() {
        if j / rows == 3 {
            assert!(
                a.is_nan() && b.is_nan(),
                "an expert outside the stack at {j}"
            );
        } else {
            assert!((a - b).abs() <= 1e-5 * top, "fast pairs at {j}: {a} vs {b}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fast_pairs` of a layer's gate projections, whatever the kernels.
trait KernelsForPairs {
    fn pairs(
        &self,
        experts: &[engine::weights::ExpertWeights],
        tokens: &[i32],
        which: &[i32],
        x: &[f32],
    ) -> Vec<f32>;
}

impl<K: Kernels> KernelsForPairs for K
where
    K::Error: std::fmt::Debug,
{
    fn pairs(
        &self,
        experts: &[engine::weights::ExpertWeights],
        tokens: &[i32],
        which: &[i32],
        x: &[f32],
    ) -> Vec<f32> {
        let stack = self
            .upload_stack(experts, kernels::step::Proj::Gate)
            .unwrap();
        let (_, rows, _) = K::stack_shape(&stack);
        let (t, e) = (
            self.upload_i(tokens).unwrap(),
            self.upload_i(which).unwrap(),
        );
        let x = self.upload(x).unwrap();
        let mut y = self.zeros(tokens.len() * rows).unwrap();
        self.fast_pairs(&stack, (&t, &e), &x, tokens.len(), &mut y)
            .unwrap();
        self.read(&y, 0..tokens.len() * rows).unwrap()
    }
}

/// The expert-parallel dispatch kernels' outputs on `k`: `ep_slots`' messages (rows put by
/// `copy_rows`), offsets and counts, then `ep_take_ids` over the messages' values.
fn dispatch_outputs<K: Kernels>(
    k: &K,
    (ranks, per_rank, width): (usize, usize, usize),
    ids: &[i32],
    seed: u64,
) -> Vec<Vec<f64>>
where
    K::Error: std::fmt::Debug,
{
    use kernels::step::kernels::SlotSpec;
    let mut rng = Rng::for_tensor(seed, "gpu-dispatch");
    let pairs = ids.len();
    let tokens = pairs.div_ceil(2).max(1);
    let x = k
        .upload(
            &(0..tokens * width)
                .map(|_| rng.normal())
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let experts = k.upload_i(if ids.is_empty() { &[0] } else { ids }).unwrap();
    let len = ranks + pairs * (1 + width);
    let mut send = k.upload(&vec![f32::NAN; len]).unwrap();
    let (mut pack_to, mut back_from) = (
        k.upload_l(&vec![7; pairs.max(1)]).unwrap(),
        k.upload_l(&vec![7; pairs.max(1)]).unwrap(),
    );
    let mut counts = k.upload_i(&vec![-5; ranks + 1]).unwrap();
    let spec = SlotSpec {
        ranks,
        per_rank,
        width,
        pairs,
    };
    k.ep_slots(
        &experts,
        spec,
        &mut send,
        (&mut pack_to, &mut back_from),
        &mut counts,
    )
    .unwrap();
    if pairs > 0 {
        let from: Vec<i64> = (0..pairs).map(|p| (p / 2 * width) as i64).collect();
        let from = k.upload_l(&from).unwrap();
        k.copy_rows(&x, &from, &mut send, &pack_to, width, pairs)
            .unwrap();
    }
    let values = k.read(&send, 0..len).unwrap();
    let at: Vec<i64> = (0..len as i64).collect();
    let mut taken = k.zeros_i(len).unwrap();
    k.ep_take_ids(
        &send,
        &k.upload_l(&at).unwrap(),
        (per_rank, per_rank),
        len,
        &mut taken,
    )
    .unwrap();
    let wide = |v: Vec<i64>| v.into_iter().map(|o| o as f64).collect();
    let ints = |v: Vec<i32>| v.into_iter().map(f64::from).collect();
    vec![
        values.into_iter().map(f64::from).collect(),
        wide(k.read_l(&pack_to).unwrap()),
        wide(k.read_l(&back_from).unwrap()),
        ints(k.read_i(&counts, 0..ranks + 1).unwrap()),
        ints(k.read_i(&taken, 0..len).unwrap()),
    ]
}

/// `ep_slots` and `ep_take_ids` on the GPU equal their references: no pairs, one, a pair per
/// thread and more than the block's threads, over 1, 3 and 8 ranks, with experts outside the
/// model among them.
#[test]
fn gpu_dispatch_kernels_equal_their_references() {
    let Some(gpu) = Gpu::for_test("gpu_dispatch_kernels_equal_their_references") else {
        return;
    };
    let cuda = CudaKernels::new(std::sync::Arc::new(gpu));
    let config = Preset::Tiny.config(ExpertFormat::Nvfp4);
    let reference = EmulatedKernels::new(&config);
    let mut rng = Rng::for_tensor(11, "gpu-dispatch-ids");
    for (ranks, per_rank, width, pairs) in [
        (1, 4, 37, 0),
        (3, 5, 37, 1),
        (8, 4, 5, 256),
        (3, 2, 3, 5000),
        (8, 32, 64, 777),
    ] {
        let total = (ranks * per_rank) as u64;
        let ids: Vec<i32> = (0..pairs)
            .map(|p| match p % 97 {
                13 => -1,
                50 => total as i32,
                _ => (rng.next_u64() % total) as i32,
            })
            .collect();
        let shape = (ranks, per_rank, width);
        let got = dispatch_outputs(&cuda, shape, &ids, 5);
        let want = dispatch_outputs(&reference, shape, &ids, 5);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "output {i}");
            for (j, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{ranks} ranks, {pairs} pairs, output {i} at {j}: {a} vs the reference's {b}"
                );
            }
        }
    }
}
