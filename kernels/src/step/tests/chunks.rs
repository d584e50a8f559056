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
