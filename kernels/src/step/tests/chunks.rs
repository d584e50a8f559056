//! Prompt chunks through the step: several consecutive tokens of a sequence in one step (the
//! window ring and the pending windows sized for them, a chunk's windows closed in order) give
//! the engine's logits at every position and its state, bit for bit, over the engine's ops and
//! over the device ops on the kernels' references; chunks of every size up to the layout's, next
//! to other sequences' chunks and decode tokens in the same step.

use engine::{
    config::ExpertFormat,
    model::{Logits, Model, SequenceState, Step},
    paged::layout::KvStorage,
};

use super::{model, same, tokens};
use crate::step::{
    StepOps,
    cpu_ops::CpuStepOps,
    decode::{Seat, decode_step},
    device_ops::DeviceStepOps,
    emulated::EmulatedKernels,
    layout::StateLayout,
};

/// Prompt lengths (one past the first HCA window of 128, one shorter than the window), and the
/// chunk sizes each step takes in turn (the largest is the layout's chunk).
const PROMPTS: [usize; 3] = [150, 9, 45];
const CHUNKS: [usize; 5] = [17, 5, 1, 13, 8];
const CHUNK: usize = 17;
const DECODE_STEPS: usize = 3;

/// Per step, each sequence's logits at every position it took; then the final states.
type Run = (Vec<Vec<Vec<Vec<f32>>>>, Vec<SequenceState>);

/// The schedule: per step, per sequence, the tokens it takes (empty once it is done).
fn schedule(prompts: &[Vec<u32>], extra: &[Vec<u32>]) -> Vec<Vec<Vec<u32>>> {
    let mut at = vec![0usize; prompts.len()];
    let mut decoded = vec![0usize; prompts.len()];
    let mut steps = Vec::new();
    for step in 0.. {
        let mut takes = Vec::new();
        for (s, prompt) in prompts.iter().enumerate() {
            if at[s] < prompt.len() {
                let size = CHUNKS[(step + s) % CHUNKS.len()].min(prompt.len() - at[s]);
                takes.push(prompt[at[s]..at[s] + size].to_vec());
                at[s] += size;
            } else if decoded[s] < extra[s].len() {
                takes.push(vec![extra[s][decoded[s]]]);
                decoded[s] += 1;
            } else {
                takes.push(Vec::new());
            }
        }
        if takes.iter().all(Vec::is_empty) {
            break;
        }
        steps.push(takes);
    }
    steps
}

fn engine_run(model: &Model, steps: &[Vec<Vec<u32>>]) -> Run {
    let mut states: Vec<SequenceState> = PROMPTS.iter().map(|_| model.new_state()).collect();
    let mut out = Vec::new();
    for takes in steps {
        let mut batch: Vec<Step<'_>> = states
            .iter_mut()
            .zip(takes)
            .filter(|(_, t)| !t.is_empty())
            .map(|(state, t)| Step {
                state,
                tokens: t,
                logits: Logits::All,
            })
            .collect();
        out.push(model.forward_batch(&mut batch).unwrap());
    }
    let states = states.iter().map(|s| s.normalized(&model.config)).collect();
    (out, states)
}

fn step_run<O: StepOps>(model: &Model, ops: &O, steps: &[Vec<Vec<u32>>]) -> Run
where
    O::Error: std::fmt::Debug,
{
    step_run_in(model, ops, steps, &layout(model))
}

fn layout(model: &Model) -> StateLayout {
    let most = PROMPTS.iter().max().unwrap() + DECODE_STEPS + 1;
    StateLayout::chunked(&model.config, (PROMPTS.len(), most), model.kv_rows(), CHUNK)
}

fn step_run_in<O: StepOps>(
    model: &Model,
    ops: &O,
    steps: &[Vec<Vec<u32>>],
    layout: &StateLayout,
) -> Run
where
    O::Error: std::fmt::Debug,
{
    let c = &model.config;
    let mut arenas = layout.arenas(ops).unwrap();
    let mut lens = vec![0usize; PROMPTS.len()];
    let mut out = Vec::new();
    for takes in steps {
        let mut seats = Vec::new();
        let mut ids = Vec::new();
        for (slot, t) in takes.iter().enumerate() {
            for (i, &token) in t.iter().enumerate() {
                seats.push(Seat {
                    slot,
                    len: lens[slot] + i,
                });
                ids.push(token);
            }
            lens[slot] += t.len();
        }
        let mut logits = decode_step(ops, c, layout, &mut arenas, &mut seats, &ids)
            .unwrap()
            .into_iter();
        out.push(
            takes
                .iter()
                .filter(|t| !t.is_empty())
                .map(|t| logits.by_ref().take(t.len()).collect())
                .collect(),
        );
    }
    let states = (0..PROMPTS.len())
        .map(|slot| layout.read(ops, &arenas, slot, lens[slot]).unwrap())
        .collect();
    (out, states)
}

fn assert_same(engine: &Run, device: &Run, what: &str) {
    assert_eq!(engine.0.len(), device.0.len(), "{what}: steps");
    for (step, (e, d)) in engine.0.iter().zip(&device.0).enumerate() {
        assert_eq!(e.len(), d.len(), "{what}: step {step}");
        for (s, (a, b)) in e.iter().zip(d).enumerate() {
            assert_eq!(a.len(), b.len(), "{what}: step {step}, sequence {s}");
            for (p, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    same(x, y),
                    "{what}: step {step}, sequence {s}, position {p}"
                );
            }
        }
    }
    assert!(engine.1 == device.1, "{what}: the states");
}

fn prompts_and_extra(model: &Model) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let v = model.config.vocab_size;
    let prompts = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, 300 + i as u64, v))
        .collect();
    let extra = (0..PROMPTS.len())
        .map(|i| tokens(DECODE_STEPS, 400 + i as u64, v))
        .collect();
    (prompts, extra)
}

#[test]
fn prompt_chunks_give_the_engines_logits_and_state_bit_for_bit() {
    for (format, kv) in [
        (ExpertFormat::Nvfp4, KvStorage::F32),
        (ExpertFormat::Mxfp4, KvStorage::Fp8),
    ] {
        let (_dir, mut model) = model(format);
        model.set_kv_storage(kv);
        let (prompts, extra) = prompts_and_extra(&model);
        let steps = schedule(&prompts, &extra);
        assert!(steps.iter().any(|t| t.iter().any(|c| c.len() == CHUNK)));
        let engine = engine_run(&model, &steps);
        let what = format!("{format:?} {kv:?}");
        let cpu = CpuStepOps::new(&model);
        assert_same(
            &engine,
            &step_run(&model, &cpu, &steps),
            &format!("{what}, engine ops"),
        );
        let device = DeviceStepOps::new(EmulatedKernels::new(&model.config), &model).unwrap();
        let emulated = step_run(&model, &device, &steps);
        assert_same(&engine, &emulated, &format!("{what}, device ops"));
    }
}

/// The check is sharp: a window ring of fewer rows than `window + chunk - 1` (the chunk's
/// last tokens overwrite rows its first ones attend to) gives other logits; more consecutive
/// tokens of a slot than the layout's chunk, a gap or a repeat are refused before anything
/// runs.
#[test]
fn a_short_ring_is_caught_and_chunks_out_of_shape_refused() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let (prompts, extra) = prompts_and_extra(&model);
    let steps = schedule(&prompts, &extra);
    let engine = engine_run(&model, &steps);
    let ops = CpuStepOps::new(&model);
    let mut short = layout(&model);
    short.ring = short.window + 4;
    let run = step_run_in(&model, &ops, &steps, &short);
    assert!(
        engine.0 != run.0 || engine.1 != run.1,
        "a short ring went unnoticed"
    );
    let c = &model.config;
    let layout = layout(&model);
    let mut arenas = layout.arenas(&ops).unwrap();
    for lens in [
        (0..=CHUNK).collect::<Vec<_>>(),
        vec![0, 1, 3],
        vec![0, 1, 1],
        vec![2, 1],
    ] {
        let mut seats: Vec<Seat> = lens.iter().map(|&len| Seat { slot: 1, len }).collect();
        let ids = vec![1; seats.len()];
        let refused = decode_step(&ops, c, &layout, &mut arenas, &mut seats, &ids);
        assert!(
            matches!(refused, Err(crate::step::decode::StepError::Input(_))),
            "{lens:?}"
        );
    }
}

/// A chunk closing two windows of a sequence in one batch: the device ops take the second's
/// previous Ca slices from the first (`prev_in_batch`), as the engine's ops get them closing in
/// order; told nothing, the device ops read the arena's stale slices and pool other rows.
#[test]
fn a_window_closing_after_another_in_its_batch_reads_that_ones_slices() {
    use crate::step::Comp;
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let layout = layout(&model);
    let l = layout
        .layers
        .iter()
        .position(|r| r.indexer.is_some())
        .unwrap();
    let r = layout.layers[l].compressor.unwrap();
    assert!(r.overlap && r.windows >= 2);
    let cpu = CpuStepOps::new(&model);
    let device = DeviceStepOps::new(EmulatedKernels::new(&model.config), &model).unwrap();
    let mut rng = engine::synth::Rng::for_tensor(7, "chunk-close");
    let values: Vec<f32> = (0..layout.arena_len(l)).map(|_| rng.normal()).collect();
    let base = layout.base(l, 1);
    // Windows 1 and 2 of slot 1 (positions 4..12), both pending, closing in one batch.
    let mut closes: Vec<_> = [2 * r.ratio - 1, 3 * r.ratio - 1]
        .iter()
        .map(|&pos| layout.close_at(&r, base, pos).unwrap())
        .collect();
    closes[1].prev_in_batch = Some(0);
    closes[0].keeps_prev = false;
    let on_cpu = |closes: &[crate::step::WindowClose]| {
        let mut arena = cpu.alloc_state(values.len()).unwrap();
        cpu.put_at(&mut arena, 0, &values).unwrap();
        let rows = cpu
            .close_windows(l, Comp::Attn, &mut arena, closes)
            .unwrap();
        let n = closes.len() * r.d;
        (
            cpu.get(&rows, 0..n).unwrap(),
            cpu.get(&arena, 0..values.len()).unwrap(),
        )
    };
    let on_device = |closes: &[crate::step::WindowClose]| {
        let mut arena = device.alloc_state(values.len()).unwrap();
        device.put_at(&mut arena, 0, &values).unwrap();
        let rows = device
            .close_windows(l, Comp::Attn, &mut arena, closes)
            .unwrap();
        let n = closes.len() * r.d;
        (
            device.get(&rows, 0..n).unwrap(),
            device.get(&arena, 0..values.len()).unwrap(),
        )
    };
    let want = on_cpu(&closes);
    assert_eq!(on_device(&closes), want);
    let mut told_nothing = closes.clone();
    told_nothing[1].prev_in_batch = None;
    told_nothing[0].keeps_prev = true;
    assert_ne!(on_device(&told_nothing).0, want.0);
}
