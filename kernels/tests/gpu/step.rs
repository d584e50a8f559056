//! The whole decode step on the GPU (`CudaStepOps`: state in device arenas, nothing read back
//! but the logits) against the engine's forward pass, bit for bit: logits of every step and the
//! state afterwards, for sequences of awkward lengths in shuffled slots, in both FP4 expert
//! formats, on the tiny and the small model; with the fast attention or the fast linears,
//! within the bounds the emulated step is held to in CI; prompt chunks of several tokens of a
//! sequence in one step, bit for bit. The same composition over the kernels' CPU
//! references (`EmulatedKernels`) is held to the same equality in CI, so a failure here is a
//! kernel that differs from its reference. Skips without a GPU (fails under
//! `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use std::sync::Arc;

use engine::{
    config::ExpertFormat,
    model::{Logits, Model, SequenceState},
    synth::{FlashShape, GenerateOptions, Preset, Rng, generate},
};
use kernels::{
    cuda::{CudaKernels, CudaStepOps, Gpu},
    step::{
        decode::{Seat, decode_step, engine_decode},
        layout::StateLayout,
    },
};

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = Rng::for_tensor(seed, "gpu-step");
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// A model of `preset` generated into a temporary folder named by `tag` (removed by the caller).
fn generated(preset: Preset, format: ExpertFormat, tag: &str) -> (std::path::PathBuf, Model) {
    let dir = std::env::temp_dir().join(format!(
        "pdserve-gpu-{tag}-{}-{preset:?}-{format:?}",
        std::process::id()
    ));
    let options = GenerateOptions::new(preset, 31, format, dir.clone());
    generate(&options).unwrap();
    let model = Model::load(&dir).unwrap();
    (dir, model)
}

fn check(gpu: &Arc<Gpu>, preset: Preset, format: ExpertFormat, lengths: &[usize], steps: usize) {
    let (dir, mut model) = generated(preset, format, "step");
    let what = format!("{preset:?} {format:?}");
    check_model(gpu, &model, (&what, Held::Bits), lengths, steps);
    // bf16 K=V rows: the FP8 row ops without e4m3 values (`RowFormat::e4m3_bf16_split`).
    model.set_kv_storage(engine::paged::layout::KvStorage::Bf16);
    let what = format!("{preset:?} {format:?}, bf16 K=V rows");
    check_model(gpu, &model, (&what, Held::Bits), lengths, steps);
    let what = format!("{preset:?} {format:?}, bf16 K=V rows, fast attention");
    check_model(gpu, &model, (&what, Held::Greedy(0.02)), lengths, steps);
    // FP8 K=V rows: rounded as computed (`fp8_kv_round`), stored as the engine's FP8 rows in
    // the arenas (`fp8_kv_encode`) and read by `attn_exact` as the values they stand for.
    model.set_kv_storage(engine::paged::layout::KvStorage::Fp8);
    let what = format!("{preset:?} {format:?}, FP8 K=V rows");
    check_model(gpu, &model, (&what, Held::Bits), lengths, steps);
    // The fast attention over them: the bound the emulated step is held to in CI.
    let what = format!("{preset:?} {format:?}, FP8 K=V rows, fast attention");
    check_model(gpu, &model, (&what, Held::Greedy(0.02)), lengths, steps);
    // The fast linears (the dense GEMM on bf16 tensor cores) over them: the typical gap the
    // emulated step is held to in CI.
    let what = format!("{preset:?} {format:?}, FP8 K=V rows, fast linears");
    check_model(gpu, &model, (&what, Held::Typical), lengths, steps);
    let _ = std::fs::remove_dir_all(&dir);
}

/// How a step's logits are held to the engine's.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Held {
    /// Bit for bit (the exact kernels), the state too.
    Bits,
    /// The fast attention (`attn_decode_fp8`): the same greedy tokens, every logit within this
    /// fraction of the largest.
    Greedy(f32),
    /// The fast linears (`dense_gemm`, bf16 activations): the largest logit difference of a
    /// step and sequence within 1e-2 of the largest logit for the median one, 2e-2 for 3 in 4;
    /// the greedy token for 3 in 4 (a rounding can flip a near tie or a discrete choice).
    Typical,
}

/// The step on the GPU against the engine for `model`; prints both step times.
fn check_model(
    gpu: &Arc<Gpu>,
    model: &Model,
    (what, held): (&str, Held),
    lengths: &[usize],
    steps: usize,
) {
    let c = &model.config;
    let mut ops = CudaStepOps::new(CudaKernels::new(Arc::clone(gpu)), model).unwrap();
    match held {
        Held::Bits => {}
        Held::Greedy(_) => ops = ops.with_fast_attention().unwrap(),
        Held::Typical => ops = ops.with_fast_linears(),
    }
    let (mut gaps, mut kept) = (Vec::new(), 0usize);
    let slots = lengths.len() + 1;
    let most = lengths.iter().max().unwrap() + steps + 1;
    let layout = StateLayout::stored(c, slots, most, model.kv_rows());
    let mut arenas = layout.arenas(&ops).unwrap();
    let mut states: Vec<SequenceState> = Vec::new();
    let mut seats = Vec::new();
    for (i, &len) in lengths.iter().enumerate() {
        let mut state = model.new_state();
        let prompt = tokens(len, i as u64, c.vocab_size);
        if !prompt.is_empty() {
            model.forward(&mut state, &prompt, Logits::None).unwrap();
        }
        // Slots in reverse order, one left free.
        let slot = slots - 1 - i;
        layout.load(&ops, &mut arenas, slot, &state).unwrap();
        seats.push(Seat { slot, len });
        states.push(state);
    }
    let (mut engine_time, mut device_time) = (0.0f64, 0.0f64);
    for step in 0..steps {
        let next = tokens(states.len(), 1000 + step as u64, c.vocab_size);
        let started = std::time::Instant::now();
        let want = engine_decode(model, &mut states, &next).unwrap();
        engine_time += started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        let got = decode_step(&ops, c, &layout, &mut arenas, &mut seats, &next).unwrap();
        device_time += started.elapsed().as_secs_f64();
        for (s, (w, g)) in want.iter().zip(&got).enumerate() {
            let argmax = |v: &[f32]| {
                v.iter()
                    .enumerate()
                    .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                    .0
            };
            match held {
                Held::Typical => {
                    kept += usize::from(argmax(w) == argmax(g));
                    let top = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let diff = w
                        .iter()
                        .zip(g)
                        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    gaps.push(diff / top);
                }
                Held::Bits => assert!(same(w, g), "{what}: step {step}, sequence {s}"),
                Held::Greedy(bound) => {
                    assert_eq!(argmax(w), argmax(g), "{what}: step {step}, sequence {s}");
                    let top = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let diff = w
                        .iter()
                        .zip(g)
                        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        diff <= bound * top,
                        "{what}: step {step}, sequence {s}: {diff}"
                    );
                }
            }
        }
    }
    if held == Held::Typical {
        gaps.sort_by(f32::total_cmp);
        let at = |share: f32| gaps[((gaps.len() - 1) as f32 * share) as usize];
        eprintln!(
            "{what}: logit differences of the largest logit: median {:.2e}, 3/4 {:.2e}, largest \
             {:.2e}; greedy token kept {kept} of {}",
            at(0.5),
            at(0.75),
            at(1.0),
            gaps.len()
        );
        assert!(at(0.5) < 1e-2 && at(0.75) < 2e-2, "{what}: {gaps:?}");
        assert!(4 * kept >= 3 * gaps.len(), "{what}: greedy kept {kept}");
    }
    if held == Held::Bits {
        for (s, (state, seat)) in states.iter().zip(&seats).enumerate() {
            let read = layout.read(&ops, &arenas, seat.slot, seat.len).unwrap();
            assert_eq!(read, state.normalized(c), "{what}: sequence {s}'s state");
        }
    }
    eprintln!(
        "{what}: {steps} decode steps of {} sequences as the engine ({held:?}); a step {:.2} ms \
         on the GPU (eager), {:.2} ms in the engine on the host",
        lengths.len(),
        1e3 * device_time / steps as f64,
        1e3 * engine_time / steps as f64
    );
}

/// `steps` steps of the sequences of `lengths` replayed as CUDA graphs (`graph_step`, padded to
/// a batch size with a shared slot) against eager steps, bit for bit; prints both step times
/// over the steps after the first 8 (when graphs were recorded).
pub(crate) fn graphs_against_eager(
    gpu: &Arc<Gpu>,
    model: &Model,
    what: &str,
    lengths: &[usize],
    steps: usize,
) -> kernels::step::replay::ReplayStats {
    use kernels::step::{
        decode::read_logits,
        device_ops::DeviceStepOps,
        replay::{Replays, graph_step},
        staged::Staged,
    };
    let c = &model.config;
    let most = lengths.iter().max().unwrap() + steps + 1;
    let layout = StateLayout::stored(c, lengths.len(), most, model.kv_rows()).with_shared_slot();
    let states: Vec<SequenceState> = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut state = model.new_state();
            let prompt = tokens(len, i as u64, c.vocab_size);
            if !prompt.is_empty() {
                model.forward(&mut state, &prompt, Logits::None).unwrap();
            }
            state
        })
        .collect();
    let open = || {
        let ops =
            DeviceStepOps::new(Staged::new(CudaKernels::new(Arc::clone(gpu))), model).unwrap();
        let mut arenas = layout.arenas(&ops).unwrap();
        for (slot, state) in states.iter().enumerate() {
            layout.load(&ops, &mut arenas, slot, state).unwrap();
        }
        let seats: Vec<Seat> = lengths
            .iter()
            .enumerate()
            .map(|(slot, &len)| Seat { slot, len })
            .collect();
        (ops, arenas, seats)
    };
    let (eager, mut eager_arenas, mut eager_seats) = open();
    let (graphs, mut graph_arenas, mut graph_seats) = open();
    let mut replays = Replays::default();
    let (mut eager_time, mut graph_time) = (0.0f64, 0.0f64);
    for step in 0..steps {
        let next = tokens(lengths.len(), 2000 + step as u64, c.vocab_size);
        let started = std::time::Instant::now();
        let want = decode_step(
            &eager,
            c,
            &layout,
            &mut eager_arenas,
            &mut eager_seats,
            &next,
        )
        .unwrap();
        let took = started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        let out = graph_step(
            &graphs,
            &mut replays,
            (c, &layout),
            &mut graph_arenas,
            &graph_seats,
            &next,
        )
        .unwrap()
        .unwrap();
        let got = read_logits(&graphs, c, &out, &mut graph_seats).unwrap();
        if step >= 8 {
            eager_time += took;
            graph_time += started.elapsed().as_secs_f64();
        }
        for (s, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(same(w, g), "{what}: graph step {step}, sequence {s}");
        }
    }
    let per = |t: f64| 1e3 * t / (steps - 8) as f64;
    eprintln!(
        "{what}: {:?}; a step of {} sequences {:.2} ms eager, {:.2} ms with graphs",
        replays.stats,
        lengths.len(),
        per(eager_time),
        per(graph_time)
    );
    assert_eq!(replays.stats.fell_back, 0, "{:?}", replays.stats);
    replays.stats
}

#[test]
fn gpu_decode_step_gives_the_engines_logits_and_state_bit_for_bit() {
    let Some(gpu) = Gpu::for_test("gpu_decode_step_gives_the_engines_logits_and_state_bit_for_bit")
    else {
        return;
    };
    let gpu = Arc::new(gpu);
    for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
        // Empty, short, past the indexer's top-k, closing the first HCA window (ratio 128).
        check(&gpu, Preset::Tiny, format, &[0, 3, 23, 126], 4);
    }
    // Past the small model's window (64) and its indexer's top-k (16 of ratio-4 rows).
    check(&gpu, Preset::Small, ExpertFormat::Nvfp4, &[1, 70, 127], 3);
}

/// Opt-in (`PDSERVE_GPU_FLASH=1`, as `gpu-check.sh` sets it): V4-Flash's dimensions, its first
/// four layers (sliding, sliding, CSA, HCA) with 16 NVFP4 routed experts, generated here (about
/// 3.6 GB), sequences past its window of 128 and its first HCA window; then prompt chunks.
#[test]
fn gpu_decode_step_of_flash_shape() {
    if std::env::var("PDSERVE_GPU_FLASH").as_deref() != Ok("1") {
        eprintln!("gpu_decode_step_of_flash_shape: skipped (set PDSERVE_GPU_FLASH=1)");
        return;
    }
    let Some(gpu) = Gpu::for_test("gpu_decode_step_of_flash_shape") else {
        return;
    };
    let gpu = Arc::new(gpu);
    let dir = std::env::temp_dir().join(format!("pdserve-gpu-flash-{}", std::process::id()));
    let preset = Preset::FlashShape(FlashShape::new(4, 16).unwrap());
    let options = GenerateOptions::new(preset, 31, ExpertFormat::Nvfp4, dir.clone());
    generate(&options).unwrap();
    let mut model = Model::load(&dir).unwrap();
    let lengths = [0, 5, 200, 700];
    check_model(
        &gpu,
        &model,
        ("flash-shape, 4 layers", Held::Bits),
        &lengths,
        3,
    );
    // DeepSeek's 584-byte FP8 rows in the arenas, exact and fast attention (step times side by
    // side).
    model.set_kv_storage(engine::paged::layout::KvStorage::Fp8);
    let what = "flash-shape, 4 layers, FP8 K=V rows";
    check_model(&gpu, &model, (what, Held::Bits), &lengths, 3);
    let what = "flash-shape, 4 layers, FP8 K=V rows, fast attention";
    check_model(&gpu, &model, (what, Held::Greedy(0.02)), &lengths, 3);
    let what = "flash-shape, 4 layers, FP8 K=V rows";
    let stats = graphs_against_eager(&gpu, &model, what, &lengths, 24);
    assert!(stats.replayed > stats.captured, "{stats:?}");
    // Prompt chunks at V4-Flash's dimensions (window 128, 584-byte rows): the engine's bits.
    {
        use kernels::step::chunk_runs::{engine_run, first_difference, layout, schedule, step_run};
        let steps = schedule(&model, tokens);
        let engine = engine_run(&model, &steps);
        let ops = CudaStepOps::new(CudaKernels::new(Arc::clone(&gpu)), &model).unwrap();
        let run = step_run(&model, &ops, &steps, &layout(&model)).unwrap();
        assert_eq!(
            first_difference(&engine, &run),
            None,
            "{what}: prompt chunks"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prompt chunks through the whole step on the GPU (`step::chunk_runs`: chunks of 1 to 17
/// tokens of a sequence beside other sequences' chunks and decode tokens): every position's
/// logits and the states afterwards bit for bit the engine's, in both FP4 formats, with f32
/// and FP8 K=V rows, as the same composition over the kernels' references is in CI.
#[test]
fn gpu_prompt_chunks_give_the_engines_bits() {
    use engine::paged::layout::KvStorage;
    use kernels::step::chunk_runs::{engine_run, first_difference, layout, schedule, step_run};
    let Some(gpu) = Gpu::for_test("gpu_prompt_chunks_give_the_engines_bits") else {
        return;
    };
    let gpu = Arc::new(gpu);
    for (format, kv) in [
        (ExpertFormat::Nvfp4, KvStorage::F32),
        (ExpertFormat::Mxfp4, KvStorage::Fp8),
        (ExpertFormat::Nvfp4, KvStorage::Bf16),
    ] {
        let (dir, mut model) = generated(Preset::Tiny, format, "chunks");
        model.set_kv_storage(kv);
        let steps = schedule(&model, tokens);
        let engine = engine_run(&model, &steps);
        let ops = CudaStepOps::new(CudaKernels::new(Arc::clone(&gpu)), &model).unwrap();
        let run = step_run(&model, &ops, &steps, &layout(&model)).unwrap();
        assert_eq!(first_difference(&engine, &run), None, "{format:?} {kv:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Prompt chunks through the whole step on the GPU with the fast kernels a prefill worker may
/// choose (`prefill_attention`, `prefill_linears`, `prefill_experts` = "fast": the fast
/// attention over FP8 rows, the dense and grouped GEMMs), alone and together: every case as
/// near the engine's logits as the same composition over the kernels' references is held to in
/// CI (`chunk_runs::FAST_PROMPT_CASES`: its median, the greedy token at 3 in 4 positions).
#[test]
fn gpu_prompt_chunks_through_the_fast_kernels_stay_near_the_engines_logits() {
    use kernels::step::chunk_runs::{FAST_PROMPT_CASES, assert_near, fast_prompt_case};
    let Some(gpu) =
        Gpu::for_test("gpu_prompt_chunks_through_the_fast_kernels_stay_near_the_engines_logits")
    else {
        return;
    };
    let gpu = Arc::new(gpu);
    let (dir, mut model) = generated(Preset::Tiny, ExpertFormat::Nvfp4, "chunk-fast");
    for (attention, gemms, median) in FAST_PROMPT_CASES {
        let kernels = CudaKernels::new(Arc::clone(&gpu));
        let near = fast_prompt_case(&mut model, kernels, (attention, gemms), tokens).unwrap();
        let what = format!("GPU prompt chunks, fast attention {attention}, GEMMs {gemms}");
        eprintln!("{what}: {near}");
        assert_near(near, median, &what);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What each step of prompt chunks added, read back from the GPU's arenas (`read_deltas`: the
/// pieces gathered by one launch, `Gpu::read_ranges`), is the engine's `StateDelta` of the same
/// step after every step of the chunk schedule, f32 and FP8 rows, as over the kernels'
/// references in CI (`a_steps_delta_read_back_is_the_engines`): what a prefill worker on cuda
/// stores into its pages and streams to the decode worker.
#[test]
fn gpu_prompt_chunks_deltas_read_back_are_the_engines() {
    use engine::paged::layout::KvStorage;
    use kernels::step::chunk_runs::delta_run;
    let Some(gpu) = Gpu::for_test("gpu_prompt_chunks_deltas_read_back_are_the_engines") else {
        return;
    };
    let gpu = Arc::new(gpu);
    for (format, kv) in [
        (ExpertFormat::Nvfp4, KvStorage::F32),
        (ExpertFormat::Mxfp4, KvStorage::Fp8),
        (ExpertFormat::Nvfp4, KvStorage::Bf16),
    ] {
        let (dir, mut model) = generated(Preset::Tiny, format, "deltas");
        model.set_kv_storage(kv);
        let ops = CudaStepOps::new(CudaKernels::new(Arc::clone(&gpu)), &model).unwrap();
        let run = delta_run(&model, &ops).unwrap();
        assert_eq!(run.first_difference, None, "{format:?} {kv:?}");
        assert!(run.closed && run.wrapped);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
