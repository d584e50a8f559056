//! Prompt chunks run through the step and through the engine side by side: the schedule the
//! CPU tests (`step::tests::chunks`) and the GPU test run, three sequences taking chunks of
//! every size up to the layout's beside each other's chunks and decode tokens, and each side's
//! logits at every position and final states, to compare bit for bit.

use engine::model::{Logits, Model, SequenceState, Step};

use super::{
    StepOps,
    decode::{Seat, decode_step},
    layout::StateLayout,
};

/// Prompt lengths (one past the first HCA window of 128, one shorter than the window), and the
/// chunk sizes each step takes in turn (the largest is the layout's chunk).
pub const PROMPTS: [usize; 3] = [150, 9, 45];
pub const CHUNKS: [usize; 5] = [17, 5, 1, 13, 8];
pub const CHUNK: usize = 17;
pub const DECODE_STEPS: usize = 3;

/// Per step, each sequence's logits at every position it took; then the final states.
pub type Run = (Vec<Vec<Vec<Vec<f32>>>>, Vec<SequenceState>);

/// Per step, per sequence, the tokens it takes (empty once it is done).
pub type Schedule = Vec<Vec<Vec<u32>>>;

/// Random prompts of [`PROMPTS`] and [`DECODE_STEPS`] decode tokens per sequence from
/// `tokens(count, seed, vocab)`, scheduled: each sequence's prompt in chunks of [`CHUNKS`] in
/// turn (offset by the sequence), then its decode tokens one a step.
pub fn schedule(model: &Model, tokens: impl Fn(usize, u64, usize) -> Vec<u32>) -> Schedule {
    let v = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, 300 + i as u64, v))
        .collect();
    let extra: Vec<Vec<u32>> = (0..PROMPTS.len())
        .map(|i| tokens(DECODE_STEPS, 400 + i as u64, v))
        .collect();
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

/// The engine's forward over the schedule: every position's logits, the normalized states.
///
/// # Panics
/// When the engine refuses a chunk.
pub fn engine_run(model: &Model, steps: &Schedule) -> Run {
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
        #[expect(clippy::expect_used, reason = "a test schedule the engine takes")]
        out.push(
            model
                .forward_batch(&mut batch)
                .expect("the engine's forward"),
        );
    }
    let states = states.iter().map(|s| s.normalized(&model.config)).collect();
    (out, states)
}

/// The layout of the schedule's sequences: a slot each, chunks of [`CHUNK`].
pub fn layout(model: &Model) -> StateLayout {
    let most = PROMPTS.iter().max().copied().unwrap_or(0) + DECODE_STEPS + 1;
    StateLayout::chunked(&model.config, (PROMPTS.len(), most), model.kv_rows(), CHUNK)
}

/// The step over `ops` in `layout` (sequence `s` in slot `s`) over the schedule: every
/// position's logits and the states read back.
pub fn step_run<O: StepOps>(
    model: &Model,
    ops: &O,
    steps: &Schedule,
    layout: &StateLayout,
) -> Result<Run, super::decode::StepError<O::Error>> {
    let c = &model.config;
    let mut arenas = layout.arenas(ops)?;
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
        let mut logits = decode_step(ops, c, layout, &mut arenas, &mut seats, &ids)?.into_iter();
        out.push(
            takes
                .iter()
                .filter(|t| !t.is_empty())
                .map(|t| logits.by_ref().take(t.len()).collect())
                .collect(),
        );
    }
    let states = (0..PROMPTS.len())
        .map(|slot| layout.read(ops, &arenas, slot, lens[slot]))
        .collect::<Result<_, _>>()?;
    Ok((out, states))
}

/// Where the two runs differ first (NaN equal to NaN), or `None` where they agree bit for bit.
pub fn first_difference(engine: &Run, device: &Run) -> Option<String> {
    let same = |x: &[f32], y: &[f32]| {
        x.len() == y.len()
            && x.iter()
                .zip(y)
                .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
    };
    if engine.0.len() != device.0.len() {
        return Some(format!("{} steps and {}", engine.0.len(), device.0.len()));
    }
    for (step, (e, d)) in engine.0.iter().zip(&device.0).enumerate() {
        if e.len() != d.len() {
            return Some(format!(
                "step {step}: {} sequences and {}",
                e.len(),
                d.len()
            ));
        }
        for (s, (a, b)) in e.iter().zip(d).enumerate() {
            if a.len() != b.len() {
                return Some(format!(
                    "step {step}, sequence {s}: {} positions and {}",
                    a.len(),
                    b.len()
                ));
            }
            if let Some(p) = a.iter().zip(b).position(|(x, y)| !same(x, y)) {
                return Some(format!("step {step}, sequence {s}, position {p}"));
            }
        }
    }
    (engine.1 != device.1).then(|| "the states".to_owned())
}

/// How near a run with bf16 roundings (the fast kernels) is to the engine's, over every
/// position's logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nearness {
    /// The median, three-quarter and largest of each position's largest logit difference as
    /// a share of the engine's largest logit.
    pub median: f32,
    pub three_quarters: f32,
    pub largest: f32,
    /// Positions whose greedy token is the engine's, of `positions`.
    pub greedy_kept: usize,
    pub positions: usize,
}

impl std::fmt::Display for Nearness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "logit differences of the largest logit: median {:.2e}, 3/4 {:.2e}, largest {:.2e}; \
             greedy kept {} of {}",
            self.median, self.three_quarters, self.largest, self.greedy_kept, self.positions
        )
    }
}

/// A device's logits row against the engine's: the largest difference as a share of the
/// engine's largest logit, and whether both pick the same greedy token.
///
/// # Panics
/// When a row is empty or not finite (a run that failed).
pub fn logit_gap(engine: &[f32], device: &[f32]) -> (f32, bool) {
    #[expect(clippy::expect_used, reason = "rows of a run that succeeded")]
    let argmax = |v: &[f32]| engine::sampling::argmax(v).expect("finite logits");
    let top = engine.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = engine
        .iter()
        .zip(device)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    (diff / top, argmax(engine) == argmax(device))
}

/// `device`'s nearness to `engine` (runs of the same schedule).
///
/// # Panics
/// When a logits row is empty or not finite (runs that failed).
pub fn nearness(engine: &Run, device: &Run) -> Nearness {
    let (mut gaps, mut kept) = (Vec::new(), 0usize);
    for (e, d) in engine.0.iter().zip(&device.0) {
        for (a, b) in e.iter().flatten().zip(d.iter().flatten()) {
            let (gap, same) = logit_gap(a, b);
            kept += usize::from(same);
            gaps.push(gap);
        }
    }
    gaps.sort_by(f32::total_cmp);
    let at = |share: f32| gaps[((gaps.len().max(1) - 1) as f32 * share) as usize];
    Nearness {
        median: at(0.5),
        three_quarters: at(0.75),
        largest: at(1.0),
        greedy_kept: kept,
        positions: gaps.len(),
    }
}

/// The fast kernels a prompt step may run, each a prefill worker's setting, and the nearness
/// the chunk tests (CI over the kernels' references, and the GPU) hold them to: (fast
/// attention, the dense and grouped GEMMs, the most median difference). Measured over the
/// references on the tiny model: the median 8.1e-3 of the largest logit for the fast attention
/// alone, 9.4e-3 for the GEMMs alone, 2.4e-2 for all of them (the roundings compound and the
/// indexer's near-tied choices flip more often); the bounds leave a GPU's other summation
/// orders room.
pub const FAST_PROMPT_CASES: [(bool, bool, f32); 3] = [
    (true, false, 1.5e-2),
    (false, true, 1.5e-2),
    (true, true, 4e-2),
];

/// One of [`FAST_PROMPT_CASES`] over `kernels`: `model`'s K=V rows set as the fast attention
/// needs them (FP8) or f32, the schedule through the engine and through the device step with
/// the case's fast kernels, and how near the step's logits are.
///
/// # Errors
/// When the step refuses the options or fails.
pub fn fast_prompt_case<K: super::kernels::Kernels>(
    model: &mut Model,
    kernels: K,
    (attention, gemms): (bool, bool),
    tokens: impl Fn(usize, u64, usize) -> Vec<u32>,
) -> Result<Nearness, String> {
    let kv = if attention {
        engine::paged::layout::KvStorage::Fp8
    } else {
        engine::paged::layout::KvStorage::F32
    };
    model.set_kv_storage(kv);
    let steps = schedule(model, tokens);
    let engine = engine_run(model, &steps);
    let mut ops =
        super::device_ops::DeviceStepOps::new(kernels, model).map_err(|e| e.to_string())?;
    if attention {
        ops = ops.with_fast_attention().map_err(|e| e.to_string())?;
    }
    if gemms {
        ops = ops.with_gemm_experts().with_fast_linears();
    }
    let run = step_run(model, &ops, &steps, &layout(model)).map_err(|e| e.to_string())?;
    Ok(nearness(&engine, &run))
}

/// Asserts `near` keeps what [`FAST_PROMPT_CASES`] asks of a case with median bound `median`:
/// the median below it, the rounding showing, the greedy token at 3 in 4 positions or more.
///
/// # Panics
/// When it does not.
pub fn assert_near(near: Nearness, median: f32, what: &str) {
    assert!(
        near.median > 0.0 || near.largest > 0.0,
        "{what}: the rounding shows"
    );
    assert!(near.median < median, "{what}: {near}");
    assert!(4 * near.greedy_kept >= 3 * near.positions, "{what}: {near}");
}

/// What [`delta_run`] saw: the first step whose read-back deltas differ from the engine's
/// (`None`: none did), and whether the schedule closed windows of both compressors in a step
/// and wrapped the window ring inside one (the cases the read-back must get right).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaRun {
    pub first_difference: Option<String>,
    pub closed: bool,
    pub wrapped: bool,
}

/// The schedule through the step over `ops` and through the engine side by side; after every
/// step each slot's delta read back (every slot's in one `read_deltas`, and slot 0's alone by
/// `read_delta`) against the engine's `StateDelta::of` of the same step.
///
/// # Errors
/// When the step, the engine or a read-back fails.
pub fn delta_run<O: StepOps>(model: &Model, ops: &O) -> Result<DeltaRun, String> {
    use engine::model::delta::StateDelta;
    let c = &model.config;
    let steps = schedule(model, |n, seed, v| {
        let mut rng = engine::synth::Rng::for_tensor(seed, "delta-run");
        (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect()
    });
    let layout = layout(model);
    let mut arenas = layout.arenas(ops).map_err(|e| e.to_string())?;
    let mut states: Vec<SequenceState> = PROMPTS.iter().map(|_| model.new_state()).collect();
    let mut run = DeltaRun {
        first_difference: None,
        closed: false,
        wrapped: false,
    };
    for (step, takes) in steps.iter().enumerate() {
        let before: Vec<usize> = states.iter().map(|s| s.len).collect();
        let (mut seats, mut ids) = (Vec::new(), Vec::new());
        for (slot, t) in takes.iter().enumerate() {
            seats.extend((0..t.len()).map(|i| Seat {
                slot,
                len: before[slot] + i,
            }));
            ids.extend_from_slice(t);
        }
        decode_step(ops, c, &layout, &mut arenas, &mut seats, &ids).map_err(|e| e.to_string())?;
        let mut batch: Vec<Step<'_>> = states
            .iter_mut()
            .zip(takes)
            .filter(|(_, t)| !t.is_empty())
            .map(|(state, tokens)| Step {
                state,
                tokens,
                logits: Logits::None,
            })
            .collect();
        model.forward_batch(&mut batch).map_err(|e| e.to_string())?;
        let spans: Vec<(usize, (usize, usize))> = states
            .iter()
            .enumerate()
            .map(|(slot, state)| (slot, (before[slot], state.len)))
            .collect();
        let all = layout
            .read_deltas(ops, &arenas, &spans)
            .map_err(|e| e.to_string())?;
        let alone = layout
            .read_delta(ops, &arenas, 0, spans[0].1)
            .map_err(|e| e.to_string())?;
        if alone != all[0] {
            run.first_difference
                .get_or_insert_with(|| format!("step {step}: slot 0 read alone and with others"));
        }
        for ((slot, state), got) in states.iter().enumerate().zip(all) {
            let span = (before[slot], state.len);
            let want = StateDelta::of(state, span.0, c)?;
            if got != want {
                run.first_difference
                    .get_or_insert_with(|| format!("step {step}, slot {slot}, {span:?}"));
            }
            run.closed |= want.layers.iter().any(|l| {
                l.compressor.as_ref().is_some_and(|c| !c.rows.is_empty())
                    && l.indexer.as_ref().is_some_and(|c| !c.rows.is_empty())
            });
            run.wrapped |= span.0 / layout.ring != span.1.saturating_sub(1) / layout.ring;
        }
    }
    Ok(run)
}
