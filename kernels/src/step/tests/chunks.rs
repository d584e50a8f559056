//! Prompt chunks through the step: several consecutive tokens of a sequence in one step (the
//! window ring and the pending windows sized for them, a chunk's windows closed in order) give
//! the engine's logits at every position and its state, bit for bit, over the engine's ops and
//! over the device ops on the kernels' references (`step::chunk_runs`: chunks of every size up
//! to the layout's, next to other sequences' chunks and decode tokens in the same step).

use engine::{config::ExpertFormat, paged::layout::KvStorage};

use super::{model, tokens};
use crate::step::{
    StepOps,
    chunk_runs::{CHUNK, engine_run, first_difference, layout, schedule, step_run},
    cpu_ops::CpuStepOps,
    decode::{Seat, decode_step},
    device_ops::DeviceStepOps,
    emulated::EmulatedKernels,
};

#[test]
fn prompt_chunks_give_the_engines_logits_and_state_bit_for_bit() {
    for (format, kv) in [
        (ExpertFormat::Nvfp4, KvStorage::F32),
        (ExpertFormat::Mxfp4, KvStorage::Fp8),
        (ExpertFormat::Nvfp4, KvStorage::Bf16),
    ] {
        let (_dir, mut model) = model(format);
        model.set_kv_storage(kv);
        let steps = schedule(&model, tokens);
        assert!(steps.iter().any(|t| t.iter().any(|c| c.len() == CHUNK)));
        let engine = engine_run(&model, &steps);
        let layout = layout(&model);
        let cpu = CpuStepOps::new(&model);
        let run = step_run(&model, &cpu, &steps, &layout).unwrap();
        assert_eq!(
            first_difference(&engine, &run),
            None,
            "{format:?} {kv:?}, engine ops"
        );
        let device = DeviceStepOps::new(EmulatedKernels::new(&model.config), &model).unwrap();
        let run = step_run(&model, &device, &steps, &layout).unwrap();
        assert_eq!(
            first_difference(&engine, &run),
            None,
            "{format:?} {kv:?}, device ops"
        );
    }
}

/// The check is sharp: a window ring of fewer rows than `window + chunk - 1` (the chunk's
/// last tokens overwrite rows its first ones attend to) gives other logits; more consecutive
/// tokens of a slot than the layout's chunk, a gap or a repeat are refused before anything
/// runs.
#[test]
fn a_short_ring_is_caught_and_chunks_out_of_shape_refused() {
    let (_dir, model) = model(ExpertFormat::Nvfp4);
    let steps = schedule(&model, tokens);
    let engine = engine_run(&model, &steps);
    let ops = CpuStepOps::new(&model);
    let mut short = layout(&model);
    short.ring = short.window + 4;
    let run = step_run(&model, &ops, &steps, &short).unwrap();
    assert!(
        first_difference(&engine, &run).is_some(),
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

/// A prompt step that wants the logits of some rows only (each chunk's last, none for a chunk
/// inside a prompt) gives those rows of the full step, bit for bit, over both sets of ops;
/// rows out of order or past the step are refused.
#[test]
fn a_prompt_step_gives_the_wanted_rows_of_the_full_step() {
    use crate::step::decode::prompt_step;
    let (_dir, model) = model(ExpertFormat::Mxfp4);
    let c = &model.config;
    let steps = schedule(&model, tokens);
    let layout = layout(&model);
    let cpu = CpuStepOps::new(&model);
    let full = step_run(&model, &cpu, &steps, &layout).unwrap();
    let device = DeviceStepOps::new(EmulatedKernels::new(&model.config), &model).unwrap();
    let ops: [&dyn Fn() -> Vec<Vec<Vec<f32>>>; 2] =
        [&|| last_rows(&model, &cpu, &steps, &layout), &|| {
            last_rows(&model, &device, &steps, &layout)
        }];
    for (which, run) in ops.iter().enumerate() {
        let got = run();
        for (step, (rows, full)) in got.iter().zip(&full.0).enumerate() {
            // Each sequence that took tokens this step: its last row, where it is wanted.
            let want: Vec<&Vec<f32>> = full
                .iter()
                .zip(steps[step].iter().filter(|t| !t.is_empty()))
                .filter(|(_, t)| t.len() < CHUNK_WITHOUT_LOGITS)
                .map(|(rows, _)| rows.last().unwrap())
                .collect();
            assert_eq!(rows.len(), want.len(), "ops {which}, step {step}");
            for (a, b) in rows.iter().zip(want) {
                assert!(super::same(a, b), "ops {which}, step {step}");
            }
        }
    }
    let mut arenas = layout.arenas(&cpu).unwrap();
    for wanted in [&[1usize, 0][..], &[0, 0], &[3]] {
        let mut seats: Vec<Seat> = (0..3).map(|len| Seat { slot: 0, len }).collect();
        let refused = prompt_step(
            &cpu,
            c,
            &layout,
            &mut arenas,
            &mut seats,
            (&[1, 2, 3], wanted),
        );
        assert!(refused.is_err(), "{wanted:?}");
    }
}

/// Chunks of this many tokens or more are taken as inside a prompt in
/// [`a_prompt_step_gives_the_wanted_rows_of_the_full_step`]: no logits wanted.
const CHUNK_WITHOUT_LOGITS: usize = 13;

/// The schedule through `prompt_step`, wanting each sequence's last row where its chunk is
/// shorter than [`CHUNK_WITHOUT_LOGITS`].
fn last_rows<O: StepOps>(
    model: &engine::model::Model,
    ops: &O,
    steps: &crate::step::chunk_runs::Schedule,
    layout: &crate::step::layout::StateLayout,
) -> Vec<Vec<Vec<f32>>>
where
    O::Error: std::fmt::Debug,
{
    use crate::step::decode::prompt_step;
    let c = &model.config;
    let mut arenas = layout.arenas(ops).unwrap();
    let mut lens = vec![0usize; steps[0].len()];
    let mut out = Vec::new();
    for takes in steps {
        let (mut seats, mut ids, mut wanted) = (Vec::new(), Vec::new(), Vec::new());
        for (slot, t) in takes.iter().enumerate() {
            for (i, &token) in t.iter().enumerate() {
                seats.push(Seat {
                    slot,
                    len: lens[slot] + i,
                });
                ids.push(token);
            }
            if !t.is_empty() && t.len() < CHUNK_WITHOUT_LOGITS {
                wanted.push(ids.len() - 1);
            }
            lens[slot] += t.len();
        }
        out.push(prompt_step(ops, c, layout, &mut arenas, &mut seats, (&ids, &wanted)).unwrap());
    }
    out
}

/// What a step added, read back from a slot (`StateLayout::read_delta`: the chunk's K=V rows,
/// the rows of the windows it closed, the compressors' slot part) is the engine's
/// `StateDelta` of the same step, after every step of the chunk schedule (a ring that wrapped,
/// windows of both ratios closed), f32, FP8 and bf16 rows; a span longer than the ring is refused.
#[test]
fn a_steps_delta_read_back_is_the_engines() {
    use crate::step::chunk_runs::delta_run;
    for (format, kv) in [
        (ExpertFormat::Nvfp4, KvStorage::F32),
        (ExpertFormat::Mxfp4, KvStorage::Fp8),
        (ExpertFormat::Nvfp4, KvStorage::Bf16),
    ] {
        let (_dir, mut model) = model(format);
        model.set_kv_storage(kv);
        let ops = DeviceStepOps::new(EmulatedKernels::new(&model.config), &model).unwrap();
        let run = delta_run(&model, &ops).unwrap();
        assert_eq!(run.first_difference, None, "{kv:?}");
        assert!(run.closed && run.wrapped);
        let layout = layout(&model);
        let arenas = layout.arenas(&ops).unwrap();
        let refused = layout.read_delta(&ops, &arenas, 0, (0, layout.ring + 1));
        assert!(refused.is_err());
    }
}

/// Prompt chunks through the fast kernels a prefill worker may choose (`prefill_attention`:
/// `attn_decode_fp8` for each token of a chunk and the indexer's scores on tensor cores, over
/// FP8 rows; `prefill_linears` and `prefill_experts`: the dense and grouped GEMMs), alone and
/// together: over 213 positions every case within `chunk_runs::FAST_PROMPT_CASES`' median and
/// the greedy token at 3 in 4 positions (measured medians: fast attention 8.1e-3, 207 of 213
/// greedy tokens kept; the GEMMs 9.4e-3, 203 kept; all of them 2.4e-2, 197 kept; a rounding
/// flips some of the indexer's near-tied choices, so the largest difference is large).
#[test]
fn prompt_chunks_through_the_fast_kernels_stay_near_the_engines_logits() {
    use crate::step::chunk_runs::{FAST_PROMPT_CASES, assert_near, fast_prompt_case};
    let (_dir, mut model) = model(ExpertFormat::Nvfp4);
    for (attention, gemms, median) in FAST_PROMPT_CASES {
        let kernels = EmulatedKernels::new(&model.config);
        let near = fast_prompt_case(&mut model, kernels, (attention, gemms), tokens).unwrap();
        let what = format!("prompt chunks, fast attention {attention}, GEMMs {gemms}");
        eprintln!("{what}: {near}");
        assert_near(near, median, &what);
    }
}
