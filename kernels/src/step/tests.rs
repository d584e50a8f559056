//! The decode step over the engine's ops against the engine's forward pass: the same logits and
//! the same state, bit for bit, for sequences of every awkward length in any slot order; a step
//! reads nothing back but its logits; planted errors are caught.

use engine::{
    config::ExpertFormat,
    model::{Logits, Model, SequenceState},
    synth::{GenerateOptions, Preset, Rng, generate},
};

mod chunks;
mod fast;
mod group;
mod layers;

use super::{
    StepOps,
    cpu_ops::{CpuStepOps, Plant},
    decode::{Seat, StepError, decode_step, engine_decode},
    device_ops::{DBuf, DeviceStepOps},
    emulated::{EmulatedKernels, KernelPlant},
    layout::StateLayout,
};

fn model(format: ExpertFormat) -> (tempfile::TempDir, Model) {
    model_of(Preset::Tiny, format)
}

pub(super) fn model_of(preset: Preset, format: ExpertFormat) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(preset, 29, format, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

pub(super) fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = Rng::for_tensor(seed, "prompt");
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// The engine's state after `prompt`, fed in two chunks (so the window holds a chunk's rows
/// beyond what decode needs, as after a real prefill).
fn prefilled(model: &Model, prompt: &[u32]) -> SequenceState {
    let mut state = model.new_state();
    let cut = prompt.len() / 3;
    for chunk in [&prompt[..cut], &prompt[cut..]] {
        if !chunk.is_empty() {
            model.forward(&mut state, chunk, Logits::None).unwrap();
        }
    }
    state
}

/// Sequences of these lengths in these slots: empty, shorter than the window, past the CSA
/// indexer's top-k, and one whose decode closes the first HCA window (ratio 128).
const LENGTHS: [usize; 4] = [0, 3, 23, 126];
const SLOTS: [usize; 4] = [2, 0, 3, 1];
const STEPS: usize = 4;

/// The engine's and the device step's logits of every step, and the final states.
struct Runs {
    engine: Vec<Vec<Vec<f32>>>,
    device: Vec<Vec<Vec<f32>>>,
    engine_states: Vec<SequenceState>,
    device_states: Vec<SequenceState>,
    reads: Vec<(usize, usize)>,
}

/// Runs [`STEPS`] steps of the sequences of [`LENGTHS`] on the engine and on the device step
/// (with `plant` in its ops); `poison` puts a NaN into the first indexer row of the third
/// sequence's first CSA layer before it is loaded.
fn run(model: &Model, plant: Option<Plant>, poison: bool) -> Runs {
    run_sequences(model, (&LENGTHS, &SLOTS, STEPS), plant, poison)
}

/// [`run`] for sequences of `lengths` in `slots`, `steps` steps.
fn run_sequences(
    model: &Model,
    sequences: (&[usize], &[usize], usize),
    plant: Option<Plant>,
    poison: bool,
) -> Runs {
    let ops = CpuStepOps::new(model);
    ops.plant(plant);
    run_on(model, &ops, &|| ops.take_reads(), sequences, poison)
}

/// The device ops over the kernels' CPU references.
fn run_emulated(model: &Model, sequences: (&[usize], &[usize], usize), poison: bool) -> Runs {
    run_emulated_with(model, sequences, poison, None)
}

fn run_emulated_with(
    model: &Model,
    sequences: (&[usize], &[usize], usize),
    poison: bool,
    plant: Option<KernelPlant>,
) -> Runs {
    let mut kernels = EmulatedKernels::new(&model.config);
    if let Some(plant) = plant {
        kernels = kernels.planted(plant);
    }
    let ops = DeviceStepOps::new(kernels, model).unwrap();
    run_on(
        model,
        &ops,
        &|| ops.kernels().take_reads(),
        sequences,
        poison,
    )
}

/// [`run_sequences`] over `ops`, whose reads back to the host `reads` counts.
fn run_on<O: StepOps>(
    model: &Model,
    ops: &O,
    reads: &dyn Fn() -> (usize, usize),
    (lengths, slots, steps): (&[usize], &[usize], usize),
    poison: bool,
) -> Runs
where
    O::Error: std::fmt::Debug,
{
    let c = &model.config;
    let most = lengths.iter().max().copied().unwrap_or(0) + steps + 1;
    let layout = StateLayout::stored(c, slots.iter().max().unwrap() + 1, most, model.kv_rows());
    let mut arenas = layout.arenas(ops).unwrap();
    let mut states: Vec<SequenceState> = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| prefilled(model, &tokens(len, i as u64, c.vocab_size)))
        .collect();
    if poison {
        let csa = c
            .layers
            .iter()
            .position(|l| matches!(l.attention, engine::config::Attention::Csa { .. }))
            .unwrap();
        states[2].layers[csa].indexer.as_mut().unwrap().rows[0] = f32::NAN;
    }
    let mut seats: Vec<Seat> = Vec::new();
    for (state, &slot) in states.iter().zip(slots) {
        layout.load(ops, &mut arenas, slot, state).unwrap();
        seats.push(Seat {
            slot,
            len: state.len,
        });
    }
    reads();
    let mut runs = Runs {
        engine: Vec::new(),
        device: Vec::new(),
        engine_states: Vec::new(),
        device_states: Vec::new(),
        reads: Vec::new(),
    };
    for step in 0..steps {
        let next = tokens(states.len(), 100 + step as u64, c.vocab_size);
        let engine = engine_decode(model, &mut states, &next).unwrap();
        let device = decode_step(ops, c, &layout, &mut arenas, &mut seats, &next).unwrap();
        runs.reads.push(reads());
        runs.engine.push(engine);
        runs.device.push(device);
    }
    for (state, seat) in states.iter().zip(&seats) {
        assert_eq!(state.len, seat.len);
        runs.engine_states.push(state.normalized(c));
        runs.device_states
            .push(layout.read(ops, &arenas, seat.slot, seat.len).unwrap());
    }
    runs
}

/// Equal bits, any NaN equal to any NaN.
fn same_value(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_value(*x, *y))
}

fn logits_equal(runs: &Runs) -> bool {
    runs.engine
        .iter()
        .zip(&runs.device)
        .all(|(e, d)| e.len() == d.len() && e.iter().zip(d).all(|(a, b)| same(a, b)))
}

#[test]
fn decode_steps_give_the_engines_logits_and_state_bit_for_bit() {
    for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
        let (_dir, model) = model(format);
        let runs = run(&model, None, false);
        let vocab = model.config.vocab_size;
        for (step, (e, d)) in runs.engine.iter().zip(&runs.device).enumerate() {
            for (s, (a, b)) in e.iter().zip(d).enumerate() {
                assert!(a.iter().all(|v| v.is_finite()), "{format:?} step {step}");
                assert!(same(a, b), "{format:?}: step {step}, sequence {s}");
            }
        }
        for (s, (e, d)) in runs
            .engine_states
            .iter()
            .zip(&runs.device_states)
            .enumerate()
        {
            assert_eq!(e, d, "{format:?}: sequence {s}'s state");
        }
        // One read a step: the logits.
        assert!(
            runs.reads.iter().all(|&r| r == (1, LENGTHS.len() * vocab)),
            "{:?}",
            runs.reads
        );
    }
}

/// A model storing FP8 or bf16 K=V rows rounds each window, CSA and HCA row as it computes
/// it: the step does the same (`round_kv_rows`, the `fp8_kv_round` kernel on a device, which
/// rounds a bf16 row as an FP8 row without e4m3 values), through the engine's ops and through
/// the device's over the kernels' references, bit for bit; the rounding shows (the logits are
/// not the f32 model's).
#[test]
fn lossy_rows_are_rounded_in_the_step_as_the_engine_rounds_them() {
    use engine::paged::layout::KvStorage;
    let (_dir, mut model) = model(ExpertFormat::Nvfp4);
    let f32_runs = run(&model, None, false);
    for kv in [KvStorage::Fp8, KvStorage::Bf16] {
        model.set_kv_storage(kv);
        for runs in [
            run(&model, None, false),
            run_emulated(&model, (&LENGTHS, &SLOTS, STEPS), false),
        ] {
            assert!(logits_equal(&runs), "{kv:?}");
            assert_eq!(runs.engine_states, runs.device_states, "{kv:?}");
            assert!(
                !same(&runs.engine[1][3], &f32_runs.engine[1][3]),
                "{kv:?} rows round"
            );
        }
    }
}

/// The small model: a wider window (64), more indexer rows (top 16), eight layers; sequences
/// past the window, past the top-k, closing the first HCA window.
#[test]
fn decode_steps_of_the_small_model_give_the_engines_bits() {
    let (_dir, model) = model_of(Preset::Small, ExpertFormat::Nvfp4);
    let runs = run_sequences(&model, (&[1, 70, 127], &[1, 2, 0], 3), None, false);
    assert!(logits_equal(&runs));
    assert!(
        runs.engine
            .iter()
            .flatten()
            .flatten()
            .all(|v| v.is_finite())
    );
    assert_eq!(runs.engine_states, runs.device_states);
}

/// The device step's own composition (its plans, offsets, gathers and launches, as the GPU
/// runs them) over the kernels' CPU references: the engine's logits and state bit for bit,
/// one read a step; a NaN in the indexer rows poisons only its sequence, as in the engine.
#[test]
fn device_step_over_the_kernels_references_gives_the_engines_bits() {
    for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
        let (_dir, model) = model(format);
        let runs = run_emulated(&model, (&LENGTHS, &SLOTS, STEPS), false);
        assert!(logits_equal(&runs), "{format:?}");
        assert!(
            runs.engine
                .iter()
                .flatten()
                .flatten()
                .all(|v| v.is_finite())
        );
        assert_eq!(runs.engine_states, runs.device_states, "{format:?}");
        let vocab = model.config.vocab_size;
        assert!(runs.reads.iter().all(|&r| r == (1, LENGTHS.len() * vocab)));
        if format == ExpertFormat::Nvfp4 {
            assert_uploads_are_plans(&model);
            let poisoned = run_emulated(&model, (&LENGTHS, &SLOTS, STEPS), true);
            assert!(logits_equal(&poisoned));
            for step in &poisoned.device {
                for (s, l) in step.iter().enumerate() {
                    assert_eq!(s == 2, l.iter().all(|v| v.is_nan()), "sequence {s}");
                }
            }
        }
    }
    let (_dir, model) = model_of(Preset::Small, ExpertFormat::Nvfp4);
    let runs = run_emulated(&model, (&[1, 70, 127], &[1, 2, 0], 3), false);
    assert!(logits_equal(&runs));
    assert_eq!(runs.engine_states, runs.device_states);
}

/// The device ops over the kernels' references with the sequences of [`LENGTHS`] prefilled by
/// the engine and loaded into [`SLOTS`].
fn loaded_on_references(
    model: &Model,
) -> (
    DeviceStepOps<EmulatedKernels>,
    StateLayout,
    Vec<DBuf<EmulatedKernels>>,
    Vec<Seat>,
) {
    let c = &model.config;
    let ops = DeviceStepOps::new(EmulatedKernels::new(c), model).unwrap();
    let layout = StateLayout::new(c, 4, 140);
    let mut arenas = layout.arenas(&ops).unwrap();
    let mut seats = Vec::new();
    for (i, (&len, &slot)) in LENGTHS.iter().zip(&SLOTS).enumerate() {
        let state = prefilled(model, &tokens(len, i as u64, c.vocab_size));
        layout.load(&ops, &mut arenas, slot, &state).unwrap();
        seats.push(Seat { slot, len });
    }
    (ops, layout, arenas, seats)
}

/// Within a step the host sends the device nothing but its plan: f32 uploads are rows'
/// rotations (at most one rope width per token), never an activation or a weight row.
fn assert_uploads_are_plans(model: &Model) {
    let c = &model.config;
    let (ops, layout, mut arenas, mut seats) = loaded_on_references(model);
    ops.kernels().take_uploads();
    let next = tokens(LENGTHS.len(), 7, c.vocab_size);
    decode_step(&ops, c, &layout, &mut arenas, &mut seats, &next).unwrap();
    let (count, longest, indices, _) = ops.kernels().take_uploads();
    assert!(count > 0 && indices > 0);
    assert!(
        longest <= LENGTHS.len() * c.rope_dim,
        "an upload of {longest} f32 values within a step"
    );
    assert!(longest < c.hidden_size);
}

#[test]
fn planted_kernel_errors_are_caught() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    for plant in [KernelPlant::ChosenRowShifted, KernelPlant::OverlapIgnored] {
        let runs = run_emulated_with(&model, (&LENGTHS, &SLOTS, STEPS), false, Some(plant));
        assert!(!logits_equal(&runs), "{plant:?} went unnoticed");
    }
}

#[test]
fn planted_errors_are_caught() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    for plant in Plant::ALL {
        let runs = run(&model, Some(plant), false);
        let caught = !logits_equal(&runs) || runs.engine_states != runs.device_states;
        assert!(caught, "{plant:?} went unnoticed");
    }
}

/// A NaN in a sequence's indexer rows leaves its choice undefined: the engine makes that
/// token's attention NaN, and so does the step (every chosen slot poisoned), without touching
/// the other sequences of the batch.
#[test]
fn an_undefined_indexer_choice_is_nan_as_in_the_engine() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let runs = run(&model, None, true);
    assert!(logits_equal(&runs));
    for (e, d) in runs.engine.iter().zip(&runs.device) {
        for (s, (a, b)) in e.iter().zip(d).enumerate() {
            assert_eq!(s == 2, a.iter().all(|v| v.is_nan()), "engine, sequence {s}");
            assert_eq!(s == 2, b.iter().all(|v| v.is_nan()), "step, sequence {s}");
        }
    }
}

#[test]
fn bad_steps_are_refused_before_anything_runs() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let c = &model.config;
    let ops = CpuStepOps::new(&model);
    let layout = StateLayout::new(c, 2, 8);
    let mut arenas = layout.arenas(&ops).unwrap();
    let vocab = c.vocab_size as u32;
    let cases: [(&[Seat], &[u32], &str); 4] = [
        (
            &[Seat { slot: 0, len: 0 }],
            &[vocab],
            "outside the vocabulary",
        ),
        (
            &[Seat { slot: 1, len: 0 }, Seat { slot: 1, len: 3 }],
            &[1, 2],
            "consecutive",
        ),
        (&[Seat { slot: 2, len: 0 }], &[1], "2 slots"),
        (&[Seat { slot: 0, len: 8 }], &[1], "8 tokens"),
    ];
    for (seats, toks, words) in cases {
        let mut seats = seats.to_vec();
        let err = decode_step(&ops, c, &layout, &mut arenas, &mut seats, toks).unwrap_err();
        assert!(
            matches!(&err, StepError::Input(m) if m.contains(words)),
            "{err}"
        );
        assert_eq!(ops.take_reads(), (0, 0));
    }
    // A state longer than a slot holds is refused when loaded.
    let state = prefilled(&model, &tokens(9, 1, c.vocab_size));
    assert!(layout.load(&ops, &mut arenas, 0, &state).is_err());
}

/// Every slot's compressed rows start at a multiple of their width (the device's indexer
/// addresses them by row index), and regions of different slots and layers' parts never
/// overlap.
#[test]
fn arena_regions_are_aligned_and_apart() {
    use engine::paged::layout::{KvStorage, RowFormat};
    for (preset, kv) in [
        (Preset::Tiny, KvStorage::F32),
        (Preset::Small, KvStorage::F32),
        (Preset::Tiny, KvStorage::Fp8),
        (Preset::Small, KvStorage::Fp8),
        (Preset::Small, KvStorage::Bf16),
    ] {
        let c = preset.config(ExpertFormat::Nvfp4);
        for chunk in [1, 17] {
            let layout = StateLayout::chunked(&c, (3, 301), RowFormat::for_kv(&c, kv), chunk);
            assert_eq!(layout.ring, c.sliding_window + chunk - 1);
            // A stored K=V row: its values, or the FP8 or bf16 row's bytes in whole f32s.
            let stored = RowFormat::for_kv(&c, kv).row_bytes(c.head_dim);
            assert_eq!(
                4 * layout.kv_stride,
                stored.next_multiple_of(4),
                "{preset:?} {kv:?}"
            );
            for (l, region) in layout.layers.iter().enumerate() {
                let mut parts = vec![(0, layout.ring * layout.kv_stride)];
                for r in [region.compressor, region.indexer].into_iter().flatten() {
                    for slot in 0..3 {
                        assert_eq!(
                            (layout.base(l, slot) + r.rows) % r.stride,
                            0,
                            "{preset:?} {l}"
                        );
                    }
                    assert_eq!(r.capacity, 301 / r.ratio);
                    assert_eq!(r.windows, (chunk - 1).div_ceil(r.ratio) + 1);
                    let prev = if r.overlap { 2 * r.ratio * r.d } else { 0 };
                    parts.push((r.rows, r.capacity * r.stride));
                    parts.push((r.pending, r.windows * 2 * r.ratio * r.width));
                    parts.push((r.prev, prev));
                }
                parts.sort_unstable();
                for pair in parts.windows(2) {
                    assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{preset:?} layer {l}");
                }
                let (last, len) = parts[parts.len() - 1];
                assert!(last + len <= region.per_slot);
            }
        }
    }
}

/// The indexer choice's key offsets as `chosen_offsets` writes them: each token's rows from its
/// base, every slot of a poisoned choice -1, slots outside the entries untouched.
#[test]
fn chosen_offsets_reference() {
    use super::kernels::Kernels;
    let c = Preset::Tiny.config(ExpertFormat::Nvfp4);
    let k = EmulatedKernels::new(&c);
    let chosen = vec![0, 2, 5, 9, -2, -2, -2, -2, 1, 3, -1, -1];
    let mut offsets = vec![77i64; 14];
    k.chosen_offsets(
        &chosen,
        4,
        (
            &vec![0, 1, 2],
            &vec![2, 7, 11],
            &vec![4, 3, 2],
            &vec![4096, 0, 131_072],
        ),
        2048,
        3,
        &mut offsets,
    )
    .unwrap();
    let row = |base: i64, r: i64| base + r * 2048;
    assert_eq!(
        offsets,
        [
            77,
            77,
            row(4096, 0),
            row(4096, 2),
            row(4096, 5),
            row(4096, 9),
            77,
            -2,
            -2,
            -2,
            77,
            row(131_072, 1),
            row(131_072, 3),
            77
        ]
    );
}

/// Opt-in (`PDSERVE_STEP_CHECKPOINT=<dir>`, e.g. a flash-shape checkpoint from `pdctl gen-model
/// --preset flash-shape`): the device step over the kernels' references on that checkpoint
/// against the engine, bit for bit, with sequences past its window and its first HCA window.
#[test]
#[ignore = "needs a checkpoint named by PDSERVE_STEP_CHECKPOINT; minutes on a large one"]
fn device_step_on_a_given_checkpoint() {
    let dir = std::env::var("PDSERVE_STEP_CHECKPOINT").expect("PDSERVE_STEP_CHECKPOINT");
    let model = Model::load(std::path::Path::new(&dir)).unwrap();
    let w = model.config.sliding_window;
    let lengths = [0, 5, w + 72, 5 * w + 60];
    let started = std::time::Instant::now();
    let runs = run_emulated(&model, (&lengths, &[3, 1, 0, 2], 3), false);
    assert!(logits_equal(&runs), "logits");
    assert!(
        runs.engine
            .iter()
            .flatten()
            .flatten()
            .all(|v| v.is_finite())
    );
    assert_eq!(runs.engine_states, runs.device_states, "states");
    eprintln!(
        "{dir}: 3 decode steps of sequences of {lengths:?} bit for bit in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Rotation tables are uploaded once per step and table, not once per op: a step's f32
/// uploads are a handful however many layers rotate rows. Plans (row offsets, counts) go up
/// once per step and content: the layers of a kind share them (on this 6-layer model, 127 to
/// 201 index uploads a step when each op uploaded its own, 31 to 53 shared).
#[test]
fn a_step_uploads_each_rotation_table_and_plan_once() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let c = &model.config;
    let (ops, layout, mut arenas, mut seats) = loaded_on_references(&model);
    for step in 0..3 {
        ops.kernels().take_uploads();
        let next = tokens(LENGTHS.len(), 40 + step, c.vocab_size);
        decode_step(&ops, c, &layout, &mut arenas, &mut seats, &next).unwrap();
        let (f32_uploads, _, index_values, index_uploads) = ops.kernels().take_uploads();
        eprintln!(
            "step {step}: {f32_uploads} f32 uploads, {index_uploads} index uploads of \
             {index_values} values"
        );
        assert!(f32_uploads <= 4, "step {step}: {f32_uploads} f32 uploads");
        assert!(
            index_uploads <= 60,
            "step {step}: {index_uploads} index uploads"
        );
    }
}

/// Once a batch size has run a step or two, a step makes no device buffer: activations go
/// back to the ops' pool when dropped and plans are written into kept buffers, so the same
/// step takes the same buffers (measured on this model: 315 buffers made every step when each
/// op made its own; now 82, then 7, then none). What a CUDA graph needs, and no allocator in
/// the step.
#[test]
fn steps_after_the_first_make_no_device_buffer() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let c = &model.config;
    let (ops, layout, mut arenas, mut seats) = loaded_on_references(&model);
    let (mut made, mut pooled) = (Vec::new(), Vec::new());
    for step in 0..5 {
        ops.kernels().take_allocations();
        let next = tokens(LENGTHS.len(), 40 + step, c.vocab_size);
        decode_step(&ops, c, &layout, &mut arenas, &mut seats, &next).unwrap();
        made.push(ops.kernels().take_allocations());
        pooled.push(ops.pooled());
    }
    eprintln!("device buffers made by each step: {made:?}; pooled after each: {pooled:?}");
    assert!(made[0] > 0);
    assert_eq!(made[2..], [0, 0, 0], "{made:?}");
}

/// Sequences that live on the device from their first token (no prefill handed over): 140
/// steps, past the window's wrap, 35 CSA windows and the first HCA window closed one token at a
/// time, every step's logits the engine's.
#[test]
fn sequences_live_on_the_device_from_their_first_token() {
    let (_dir, model) = model(ExpertFormat::Mxfp4);
    let c = &model.config;
    let ops = DeviceStepOps::new(EmulatedKernels::new(c), &model).unwrap();
    let layout = StateLayout::new(c, 2, 141);
    let mut arenas = layout.arenas(&ops).unwrap();
    let mut seats = [Seat { slot: 1, len: 0 }, Seat { slot: 0, len: 0 }];
    let mut states = [model.new_state(), model.new_state()];
    for step in 0..140u64 {
        let next = tokens(2, 500 + step, c.vocab_size);
        let want = engine_decode(&model, &mut states, &next).unwrap();
        let got = decode_step(&ops, c, &layout, &mut arenas, &mut seats, &next).unwrap();
        for (s, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(same(w, g), "step {step}, sequence {s}");
        }
    }
    for (state, seat) in states.iter().zip(&seats) {
        let read = layout.read(&ops, &arenas, seat.slot, seat.len).unwrap();
        assert_eq!(read, state.normalized(c));
    }
}
