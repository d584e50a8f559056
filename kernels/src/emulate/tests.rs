use engine::{quant, synth::Rng};

use super::*;
use crate::cpu;

fn rows(rng: &mut Rng, n: usize, dim: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|_| (0..dim).map(|_| rng.normal()).collect())
        .collect()
}

#[test]
fn splits_cover_every_row_once_at_awkward_counts() {
    for count in [0i64, 1, 2, 5, 127, 128, 129, 1000] {
        for splits in [1i64, 2, 3, 7, 64, 200] {
            let mut next = 1_000_000_007;
            for split in 0..splits {
                let (lo, hi) = split_range(1_000_000_007, count, splits, split);
                if lo < hi {
                    assert_eq!(lo, next, "count {count} splits {splits}");
                    next = hi;
                }
            }
            assert_eq!(next, 1_000_000_007 + count, "count {count} splits {splits}");
        }
    }
    // Row indices past 2^31 (a large pool) stay exact.
    assert_eq!(
        split_range(3 << 31, 10, 3, 2),
        ((3 << 31) + 8, (3 << 31) + 10)
    );
}

#[test]
fn split_attention_matches_the_reference_at_awkward_shapes() {
    let mut rng = Rng::for_tensor(11, "emulate-attn");
    for (counts, heads, dim, splits) in [
        (vec![0usize, 1, 5, 37], 3usize, 16usize, 4usize),
        (vec![130, 2], 2, 129, 7),
        (vec![64], 4, 512, 1),
        (vec![9, 0, 300], 1, 64, 64),
    ] {
        let mut all = Vec::new();
        let mut starts = vec![0usize];
        for &n in &counts {
            all.extend(rows(&mut rng, n, dim));
            starts.push(all.len());
        }
        let batch = counts.len();
        let q: Vec<f32> = (0..batch * heads * dim)
            .map(|_| rng.normal() * 0.5)
            .collect();
        let sinks: Vec<f32> = (0..heads).map(|_| rng.normal()).collect();
        let scale = 1.0 / (dim as f32).sqrt();
        let want = cpu::attn_decode(&q, &all, &starts, &sinks, dim, scale);
        let got = attn_decode(&q, &all, &starts, &sinks, dim, scale, splits);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5,
                "{counts:?} splits {splits} at {i}: {g} vs {w}"
            );
        }
    }
}

/// NaN in, NaN out, wherever it enters: one score of a split, every score of a split (which
/// `fmaxf` alone would drop with the split), a sink. The other heads stay finite.
#[test]
fn a_nan_reaches_the_head_it_entered() {
    let mut rng = Rng::for_tensor(12, "emulate-nan");
    let (heads, dim, splits) = (2usize, 16usize, 4usize);
    let base = rows(&mut rng, 12, dim);
    let q: Vec<f32> = (0..heads * dim).map(|_| rng.normal()).collect();
    let sinks = vec![0.5f32, -0.5];
    let starts = [0usize, 12];
    let head = |out: &[f32], h: usize| out[h * dim..(h + 1) * dim].to_vec();
    let mut one = base.clone();
    one[4][3] = f32::NAN;
    let mut whole = base.clone();
    for r in &mut whole[3..6] {
        r[0] = f32::NAN;
    }
    for (what, rows) in [("one row of a split", one), ("every row of a split", whole)] {
        let want = cpu::attn_decode(&q, &rows, &starts, &sinks, dim, 0.25);
        let got = attn_decode(&q, &rows, &starts, &sinks, dim, 0.25, splits);
        for h in 0..heads {
            assert!(
                head(&want, h).iter().all(|v| v.is_nan()),
                "{what}: reference"
            );
            assert!(head(&got, h).iter().all(|v| v.is_nan()), "{what}: head {h}");
        }
    }
    // A NaN sink poisons its own head only.
    let got = attn_decode(&q, &base, &starts, &[f32::NAN, 0.0], dim, 0.25, splits);
    let want = cpu::attn_decode(&q, &base, &starts, &[f32::NAN, 0.0], dim, 0.25);
    assert!(head(&got, 0).iter().all(|v| v.is_nan()));
    assert!(head(&want, 0).iter().all(|v| v.is_nan()));
    assert!(head(&got, 1).iter().all(|v| v.is_finite()));
    // A NaN in one head's query leaves the other head finite.
    let mut q1 = q.clone();
    q1[dim + 2] = f32::NAN;
    let got = attn_decode(&q1, &base, &starts, &sinks, dim, 0.25, splits);
    assert!(head(&got, 0).iter().all(|v| v.is_finite()));
    assert!(head(&got, 1).iter().all(|v| v.is_nan()));
}

#[test]
fn topk_radix_takes_the_highest_then_lowest_index_and_poisons_on_nan() {
    let scores = [1.0f32, 3.0, 3.0, f32::NEG_INFINITY, 2.0, 9.0];
    assert_eq!(topk_radix(&scores, 5, 3), vec![1, 2, 4]);
    assert_eq!(topk_radix(&scores, 5, 2), vec![1, 2]);
    assert_eq!(topk_radix(&scores, 5, 7), vec![0, 1, 2, 3, 4, -1, -1]);
    assert_eq!(topk_radix(&scores, 0, 2), vec![-1, -1]);
    // The engine's total order: +0 above -0, whatever their indices.
    assert_eq!(topk_radix(&[0.0, -0.0, -1.0], 3, 1), vec![0]);
    assert_eq!(topk_radix(&[-0.0, 0.0, -1.0], 3, 1), vec![1]);
    // A NaN past `visible` is not a key of this query; one inside poisons every slot.
    let mut nan = scores;
    nan[5] = f32::NAN;
    assert_eq!(topk_radix(&nan, 5, 2), vec![1, 2]);
    nan[0] = f32::NAN;
    assert_eq!(topk_radix(&nan, 5, 2), vec![TOPK_POISONED; 2]);
    assert_eq!(topk_radix(&[f32::NAN; 3], 3, 4), vec![TOPK_POISONED; 4]);
}

/// Random scores with many ties (a few values, signed zeros, infinities), rows longer than a
/// block: the radix select chooses what the CPU reference chooses.
fn tie_heavy(rng: &mut Rng, n: usize) -> Vec<f32> {
    const VALUES: [f32; 7] = [-2.0, -0.0, 0.0, 0.5, 1.0, f32::INFINITY, f32::NEG_INFINITY];
    (0..n)
        .map(|_| match rng.next_u64() % 3 {
            0 => VALUES[(rng.next_u64() % 7) as usize],
            _ => rng.normal(),
        })
        .collect()
}

#[test]
fn topk_radix_chooses_the_references_keys() {
    let mut rng = Rng::for_tensor(13, "emulate-topk");
    for round in 0..300 {
        let n = match round % 3 {
            0 => (rng.next_u64() % 40) as usize,
            1 => (rng.next_u64() % 600) as usize,
            _ => 2000 + (rng.next_u64() % 3000) as usize,
        };
        let k = 1 + (rng.next_u64() % 520) as usize;
        let scores = tie_heavy(&mut rng, n);
        let got = topk_radix(&scores, n, k);
        let want = cpu::topk_of_scores(&scores, k).unwrap();
        let chosen: Vec<usize> = got
            .iter()
            .take_while(|&&i| i >= 0)
            .map(|&i| i as usize)
            .collect();
        assert_eq!(chosen, want, "round {round}: n {n} k {k}");
        assert!(got[chosen.len()..].iter().all(|&i| i == TOPK_EMPTY));
    }
}

/// Planted errors in the kernel's math are caught by the same comparison.
#[test]
fn a_wrong_radix_select_is_caught() {
    use super::topk_radix::{Plant, topk_with};
    let mut rng = Rng::for_tensor(14, "emulate-topk-plants");
    for plant in [Plant::ZeroTie, Plant::TiesFromTop, Plant::BinOffByOne] {
        let caught = (0..100).any(|_| {
            let n = 300 + (rng.next_u64() % 700) as usize;
            let k = 1 + (rng.next_u64() % 200) as usize;
            let scores = tie_heavy(&mut rng, n);
            let got: Vec<usize> = topk_with(&scores, n, k, plant)
                .into_iter()
                .take_while(|&i| i >= 0)
                .map(|i| i as usize)
                .collect();
            Some(got) != cpu::topk_of_scores(&scores, k)
        });
        assert!(caught, "{plant:?} not caught");
    }
}

#[test]
fn indexer_batches_that_would_read_outside_their_keys_are_refused() {
    let ok = |starts: &[i64], visible: &[i32], shape| {
        check_indexer_batch(
            visible.len() * 2 * 4,
            visible.len() * 2,
            40,
            starts,
            visible,
            shape,
        )
    };
    assert_eq!(ok(&[0, 3], &[3, 7], (2, 4, 5)), Ok(()));
    for (starts, visible, shape, what) in [
        (
            &[0i64, 4][..],
            &[3i32, 7][..],
            (2, 4, 5),
            "past the last key",
        ),
        (&[-1, 3], &[3, 7], (2, 4, 5), "negative start"),
        (&[0, 3], &[3, -1], (2, 4, 5), "negative count"),
        (&[0, 3], &[3, 7], (0, 4, 5), "no heads"),
        (&[0, 3], &[3, 7], (2, 0, 5), "no dims"),
        (&[0, 3], &[3, 7], (2, 4, 0), "k = 0"),
        (&[0], &[3, 7], (2, 4, 5), "starts short"),
    ] {
        assert!(ok(starts, visible, shape).is_err(), "{what}");
    }
    assert!(
        check_indexer_batch(16, 2, 41, &[0], &[3], (2, 4, 5)).is_err(),
        "ragged keys"
    );
}

/// Random NVFP4 operands `[m, k]` and `[n, k]` and the bound of an f32 accumulation over them.
#[expect(
    clippy::type_complexity,
    reason = "two quantized operands and their products' bound"
)]
fn w4a4_operands(
    rng: &mut Rng,
    (m, n, k): (usize, usize, usize),
) -> ((Vec<u8>, Vec<u8>, f32), (Vec<u8>, Vec<u8>, f32), Vec<f64>) {
    let a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 2.0).collect();
    let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
    let qa = quant::quant_nvfp4(&a, m, k).unwrap();
    let qw = quant::quant_nvfp4(&w, n, k).unwrap();
    let da = quant::dequant_nvfp4(&qa.0, &qa.1, qa.2, m, k).unwrap();
    let dw = quant::dequant_nvfp4(&qw.0, &qw.1, qw.2, n, k).unwrap();
    let mut bound = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let mag: f64 = (0..k)
                .map(|x| f64::from((da[i * k + x] * dw[j * k + x]).abs()))
                .sum();
            bound.push(1e-5 * mag + 1e-30);
        }
    }
    (qa, qw, bound)
}

fn w4a4_mismatches(
    got: &[f32],
    a: &(Vec<u8>, Vec<u8>, f32),
    w: &(Vec<u8>, Vec<u8>, f32),
    bound: &[f64],
    shape: (usize, usize, usize),
) -> usize {
    let want = cpu::nvfp4_gemm_w4a4(
        (&a.0, &a.1, a.2),
        (&w.0, &w.1, w.2),
        shape.0,
        shape.1,
        shape.2,
    )
    .unwrap();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(&want)
        .zip(bound)
        .filter(|((g, w), b)| {
            // Within the bound; a NaN is never within it.
            let within = f64::from((*g - *w).abs()) <= **b;
            !within
        })
        .count()
}

/// The sm_120 kernel's loads and stores, through the documented fragment layout, compute the
/// reference product at shapes that are not tile multiples.
#[test]
fn the_sm120_kernels_fragments_compute_the_reference_product() {
    let mut rng = Rng::for_tensor(14, "emulate-sm120");
    for shape in [
        (1usize, 1usize, 64usize),
        (16, 8, 64),
        (17, 9, 128),
        (70, 130, 256),
        (64, 64, 64),
    ] {
        let (a, w, bound) = w4a4_operands(&mut rng, shape);
        let got = nvfp4_gemm_w4a4_sm120((&a.0, &a.1, a.2), (&w.0, &w.1, w.2), shape);
        assert_eq!(w4a4_mismatches(&got, &a, &w, &bound, shape), 0, "{shape:?}");
    }
}

/// The check is sharp: two lanes swapped, or a scale register's bytes in the wrong order, or
/// the two K halves of A exchanged, give a product that is not the reference.
#[test]
fn a_wrong_fragment_layout_is_caught() {
    type Tamper = fn(&mut [mma_sm120::LaneRegs; 32]);
    let mut rng = Rng::for_tensor(15, "emulate-sm120-tamper");
    let shape = (32, 16, 128);
    let (a, w, bound) = w4a4_operands(&mut rng, shape);
    let tampers: [(&str, Tamper); 5] = [
        ("lanes 1 and 2 (t0)", |l| l.swap(1, 2)),
        ("lanes 0 and 4 (t1)", |l| l.swap(0, 4)),
        ("sfa byte order", |l| {
            for r in l.iter_mut() {
                r.sfa = r.sfa.swap_bytes();
            }
        }),
        ("sfb byte order", |l| {
            for r in l.iter_mut() {
                r.sfb = r.sfb.swap_bytes();
            }
        }),
        ("a0 and a2", |l| {
            for r in l.iter_mut() {
                r.a.swap(0, 2);
            }
        }),
    ];
    for (what, tamper) in tampers {
        let got = mma_sm120::gemm_with(
            (&a.0, &a.1, a.2),
            (&w.0, &w.1, w.2),
            shape,
            &|lanes: &mut [mma_sm120::LaneRegs; 32]| tamper(lanes),
        );
        assert!(
            w4a4_mismatches(&got, &a, &w, &bound, shape) > 0,
            "{what} went unnoticed"
        );
    }
}

/// The sm_100 kernel's shared-memory layout, descriptors, Tensor Memory columns and epilogue,
/// read as the header documents, compute the reference product: across K stages (a last stage
/// of fewer than 4 MMAs), tiles cut by m and n, and k = 0.
#[test]
fn the_sm100_kernels_descriptors_compute_the_reference_product() {
    let mut rng = Rng::for_tensor(16, "emulate-sm100");
    for shape in [
        (1usize, 1usize, 64usize),
        (130, 129, 320),
        (128, 128, 256),
        (3, 200, 64),
    ] {
        let (a, w, bound) = w4a4_operands(&mut rng, shape);
        let got = nvfp4_gemm_w4a4_sm100((&a.0, &a.1, a.2), (&w.0, &w.1, w.2), shape).unwrap();
        assert_eq!(w4a4_mismatches(&got, &a, &w, &bound, shape), 0, "{shape:?}");
    }
    let (a, w, _) = w4a4_operands(&mut rng, (5, 7, 64));
    let empty = nvfp4_gemm_w4a4_sm100((&a.0, &a.1, a.2), (&w.0, &w.1, w.2), (5, 7, 0)).unwrap();
    assert!(empty.iter().all(|&v| v == 0.0));
}

/// The check is sharp: each planted error in the kernel's index math or encodings gives a
/// product that is not the reference (or a descriptor the model refuses).
#[test]
fn a_wrong_tcgen05_layout_is_caught() {
    use tcgen05_sm100::Plant;
    let mut rng = Rng::for_tensor(17, "emulate-sm100-plant");
    let shape = (40, 136, 128);
    let (a, w, bound) = w4a4_operands(&mut rng, shape);
    for plant in [
        Plant::StridesSwapped,
        Plant::CoreMatrixTransposed,
        Plant::ScaleWordsInRowOrder,
        Plant::ScaleColumnsMixed,
        Plant::InstrDescN,
    ] {
        let got = tcgen05_sm100::gemm_with((&a.0, &a.1, a.2), (&w.0, &w.1, w.2), shape, plant);
        let caught =
            got.is_err() || got.is_ok_and(|got| w4a4_mismatches(&got, &a, &w, &bound, shape) > 0);
        assert!(caught, "{plant:?} went unnoticed");
    }
}

/// Activations, an NVFP4 weight (codes, scales, scale_2) and each output's error bound.
type Bf16GemmCase = (Vec<f32>, (Vec<u8>, Vec<u8>, f32), Vec<f64>);

fn bf16_gemm_operands(rng: &mut Rng, (m, n, k): (usize, usize, usize)) -> Bf16GemmCase {
    let a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 3.0).collect();
    let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
    let (packed, scales, scale_2) = quant::quant_nvfp4(&w, n, k).unwrap();
    let deq = quant::dequant_nvfp4(&packed, &scales, scale_2, n, k).unwrap();
    let a16: Vec<f32> = a
        .iter()
        .map(|&v| engine::formats::bf16_to_f32(engine::formats::f32_to_bf16(v)))
        .collect();
    let mut bound = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let mag: f64 = (0..k)
                .map(|x| f64::from((a16[i * k + x] * deq[j * k + x]).abs()))
                .sum();
            bound.push(1e-5 * mag + 1e-30);
        }
    }
    (a, (packed, scales, scale_2), bound)
}

fn bf16_gemm_mismatches(
    got: &[f32],
    a: &[f32],
    w: &(Vec<u8>, Vec<u8>, f32),
    bound: &[f64],
    (m, n, k): (usize, usize, usize),
) -> usize {
    let want = cpu::nvfp4_gemm(a, &w.0, &w.1, w.2, m, n, k).unwrap();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(&want)
        .zip(bound)
        .filter(|((g, w), b)| f64::from((*g - *w).abs()) > **b || g.is_nan())
        .count()
}

/// The sm_90 path's staging, fragment origins and masked store, through the WMMA API's
/// documented semantics (and its sm_90a tiles through the warpgroup-MMA model), compute the
/// reference product at shapes that are not tile multiples.
#[test]
fn the_bf16_tensor_core_kernels_tiles_compute_the_reference_product() {
    let mut rng = Rng::for_tensor(18, "emulate-wmma");
    for shape in [
        (1usize, 1usize, 16usize),
        (3, 5, 48),
        (65, 130, 96),
        (64, 64, 64),
        (0, 8, 32),
    ] {
        let (a, w, bound) = bf16_gemm_operands(&mut rng, shape);
        let wmma = nvfp4_gemm_bf16(&a, (&w.0, &w.1, w.2), shape);
        let wgmma = fp4_gemm_bf16_wgmma(&a, (&w.0, &w.1, Some(w.2)), shape).unwrap();
        for (tiles, got) in [("wmma", wmma), ("wgmma", wgmma)] {
            assert_eq!(
                bf16_gemm_mismatches(&got, &a, &w, &bound, shape),
                0,
                "{tiles} {shape:?}"
            );
        }
    }
}

/// The check is sharp: W's fragments of the wrong major-ness, two warps' origins exchanged, or
/// a W block staged at the wrong offset give a product that is not the reference.
#[test]
fn a_wrong_wmma_staging_is_caught() {
    use wmma_bf16::Plant;
    let mut rng = Rng::for_tensor(19, "emulate-wmma-plant");
    let shape = (70, 90, 64);
    let (a, w, bound) = bf16_gemm_operands(&mut rng, shape);
    for plant in [Plant::WRowMajor, Plant::WarpOrigin, Plant::WBlockOffset] {
        let got = wmma_bf16::gemm_with(&a, (&w.0, &w.1, Some(w.2)), shape, plant);
        assert!(
            bf16_gemm_mismatches(&got, &a, &w, &bound, shape) > 0,
            "{plant:?} went unnoticed"
        );
    }
}

/// A random dense weight of `rows x k` in `form` ("bf16", "fp8" with power-of-two scales,
/// "fp8-any" with scales that are not): its bytes and (FP8) scales.
fn dense_weight(rng: &mut Rng, form: &str, rows: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    if form == "bf16" {
        let bytes = (0..rows * k)
            .flat_map(|_| engine::formats::f32_to_bf16(rng.normal()).to_le_bytes())
            .collect();
        return (bytes, Vec::new());
    }
    // Any e4m3 code but the two NaNs.
    let codes = (0..rows * k)
        .map(|_| match (rng.next_u64() % 256) as u8 {
            0x7F | 0xFF => 0x38,
            code => code,
        })
        .collect();
    let scales = (0..rows.div_ceil(128) * k.div_ceil(128))
        .map(|_| {
            let power = 2f32.powi((rng.next_u64() % 9) as i32 - 4);
            if form == "fp8" {
                power
            } else {
                power * (1.0 + rng.uniform())
            }
        })
        .collect();
    (codes, scales)
}

fn dense_rows<'a>(form: &str, w: &'a (Vec<u8>, Vec<f32>)) -> crate::dense_gemm::DenseRows<'a> {
    if form == "bf16" {
        crate::dense_gemm::DenseRows::Bf16(&w.0)
    } else {
        crate::dense_gemm::DenseRows::Fp8Block {
            codes: &w.0,
            scales: &w.1,
        }
    }
}

/// The dense GEMM's split of K, staging (both weight forms, rows from any `row0`, scales of
/// any value), masked store and split sum compute the reference product within its bound at
/// shapes that are not tile multiples, split or not, on both tile functions (WMMA with its
/// live bands; the warpgroup MMA with its core-matrix layout and double buffer); NaN in, NaN
/// out.
#[test]
fn the_dense_gemms_tiles_and_splits_compute_the_reference_product() {
    use crate::dense_gemm::{bound, mismatches, reference, splits};
    let mut rng = Rng::for_tensor(20, "emulate-dense-gemm");
    let mut split_runs = 0;
    for form in ["bf16", "fp8", "fp8-any"] {
        for (m, n, k, row0, sms) in [
            (1usize, 1usize, 16usize, 0usize, 132usize),
            (3, 5, 48, 7, 1),
            (65, 130, 600, 100, 1),
            (2, 70, 1100, 130, 132),
            (33, 40, 2000, 0, 132),
            (0, 8, 32, 0, 132),
            (5, 0, 32, 0, 132),
        ] {
            let w = dense_weight(&mut rng, form, row0 + n + 3, k);
            let rows = dense_rows(form, &w);
            let mut a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 3.0).collect();
            if m > 1 && k > 0 {
                a[k + k / 2] = f32::NAN;
            }
            let plan = splits(m, n, k, sms);
            split_runs += usize::from(plan.0 > 1);
            let want = reference(&a, rows, row0, (m, n, k)).unwrap();
            let limit = bound(&a, rows, row0, (m, n, k)).unwrap();
            let wmma = dense_gemm(&a, rows, row0, (m, n, k), plan);
            let wgmma = dense_gemm_wgmma(&a, rows, row0, (m, n, k), plan).unwrap();
            for (tiles, got) in [("wmma", wmma), ("wgmma", wgmma)] {
                assert_eq!(
                    mismatches(&got, &want, &limit),
                    0,
                    "{tiles} {form} {m}x{n}x{k} at row {row0}, plan {plan:?}"
                );
                if m > 1 && n > 0 {
                    assert!(
                        got[n..2 * n].iter().all(|v| v.is_nan()),
                        "{tiles}: a NaN row"
                    );
                }
            }
        }
    }
    assert!(split_runs >= 6, "{split_runs} runs split K");
}

/// The check is sharp: each planted error in the dense GEMM's index math gives a product that
/// is not the reference.
#[test]
fn a_wrong_dense_gemm_index_is_caught() {
    use crate::dense_gemm::{bound, mismatches, reference, splits};
    use dense_gemm::{Plant, Tiles};
    let mut rng = Rng::for_tensor(21, "emulate-dense-gemm-plant");
    let (m, n, k, row0) = (70, 150, 1100, 100);
    let w = dense_weight(&mut rng, "fp8-any", row0 + n, k);
    let rows = dense_rows("fp8-any", &w);
    let a: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
    let want = reference(&a, rows, row0, (m, n, k)).unwrap();
    let limit = bound(&a, rows, row0, (m, n, k)).unwrap();
    let plan = splits(m, n, k, 132);
    assert!(plan.0 > 1, "the plan splits K");
    assert_eq!(
        mismatches(
            &dense_gemm::dense_gemm_with(&a, rows, row0, (m, n, k), plan, Tiles::Wmma, Plant::None)
                .unwrap(),
            &want,
            &limit
        ),
        0
    );
    for plant in [
        Plant::WRowMajor,
        Plant::HalfOffset,
        Plant::ScaleRowWithoutRow0,
        Plant::LiveByColumn,
        Plant::SplitStartsLate,
        Plant::SumSkipsLast,
    ] {
        let got = dense_gemm::dense_gemm_with(&a, rows, row0, (m, n, k), plan, Tiles::Wmma, plant)
            .unwrap();
        assert!(
            mismatches(&got, &want, &limit) > 0,
            "{plant:?} went unnoticed"
        );
    }
}

/// The check of the sm_90a tiles is sharp: each planted error in `wgmma.cuh`'s layout,
/// descriptors, fragment store or buffering, or in the tile's staging, gives a product that is
/// not the reference (or a request the warpgroup-MMA model refuses).
#[test]
fn a_wrong_wgmma_tile_is_caught() {
    use crate::dense_gemm::{bound, mismatches, reference, splits};
    use dense_gemm::{Plant, Tiles};
    use wgmma_sm90::TilePlant;
    let mut rng = Rng::for_tensor(24, "emulate-dense-wgmma-plant");
    // Seven slices through one pair of buffers; rows and columns past one tile, weight rows
    // across a scale tile.
    let (m, n, k, row0) = (70, 100, 200, 100);
    let w = dense_weight(&mut rng, "fp8-any", row0 + n, k);
    let rows = dense_rows("fp8-any", &w);
    let a: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
    let want = reference(&a, rows, row0, (m, n, k)).unwrap();
    let limit = bound(&a, rows, row0, (m, n, k)).unwrap();
    let plan = splits(m, n, k, 1);
    assert_eq!(
        plan.0, 1,
        "one split: every slice through one pair of buffers"
    );
    let run =
        |plant| dense_gemm::dense_gemm_with(&a, rows, row0, (m, n, k), plan, Tiles::Wgmma, plant);
    assert_eq!(mismatches(&run(Plant::None).unwrap(), &want, &limit), 0);
    for plant in [
        Plant::Tile(TilePlant::StridesSwapped),
        Plant::Tile(TilePlant::SecondK16NotAdvanced),
        Plant::WChunksSwapped,
        Plant::Tile(TilePlant::FragmentHalvesSwapped),
        Plant::Tile(TilePlant::StageIntoBusyBuffer),
        Plant::Tile(TilePlant::NoLastWait),
        Plant::ScaleRowWithoutRow0,
    ] {
        let caught = match run(plant) {
            Ok(got) => mismatches(&got, &want, &limit) > 0,
            Err(_) => true,
        };
        assert!(caught, "{plant:?} went unnoticed");
    }
}

/// The MXFP4 staging of the bf16 tensor-core tiles (what `mxfp4_grouped_gemm_bf16` runs for a
/// prompt chunk's MXFP4 experts) computes the reference product at awkward shapes; scales
/// indexed without the row's offset are caught.
#[test]
fn the_mxfp4_tiles_compute_the_reference_product() {
    let mut rng = Rng::for_tensor(23, "emulate-wmma-mxfp4");
    for (m, n, k) in [
        (1usize, 1usize, 32usize),
        (3, 5, 96),
        (65, 130, 160),
        (0, 8, 32),
    ] {
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 3.0).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        let (packed, scales) = quant::quant_mxfp4(&w, n, k).unwrap();
        let want = cpu::mxfp4_gemm(&a, &packed, &scales, (m, n, k)).unwrap();
        let deq = quant::dequant_mxfp4(&packed, &scales, n, k).unwrap();
        let bound: Vec<f64> = (0..m * n)
            .map(|o| {
                let (i, j) = (o / n.max(1), o % n.max(1));
                let mag: f64 = (0..k)
                    .map(|x| {
                        let a16 = crate::dense_gemm::bf16(a[i * k + x]);
                        f64::from((a16 * deq[j * k + x]).abs())
                    })
                    .sum();
                1e-5 * mag + 1e-30
            })
            .collect();
        let close = |got: &[f32]| {
            got.iter()
                .zip(&want)
                .zip(&bound)
                .all(|((g, w), b)| f64::from((g - w).abs()) <= *b)
        };
        assert!(
            close(&mxfp4_gemm_bf16(&a, (&packed, &scales), (m, n, k))),
            "{m}x{n}x{k}"
        );
        assert!(
            close(&fp4_gemm_bf16_wgmma(&a, (&packed, &scales, None), (m, n, k)).unwrap()),
            "wgmma {m}x{n}x{k}"
        );
        if m * n > 10 {
            let planted = wmma_bf16::gemm_with(
                &a,
                (&packed, &scales, None),
                (m, n, k),
                wmma_bf16::Plant::MxScaleWithoutRow,
            );
            assert!(
                !close(&planted),
                "{m}x{n}x{k}: scales without the row went unnoticed"
            );
        }
    }
}
