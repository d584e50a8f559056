//! Decode steps replayed as graphs ([`graph_step`]): each step's plan pass writes its plans
//! and folds its launches into a signature; a step whose signature a recorded graph has is
//! that graph's launch; one seen before without a graph runs its launch pass, recorded where
//! the device records (CUDA graphs) and run where it does not (the kernels' CPU references,
//! which is how CI checks that a step's launches need nothing but the plans written before
//! them). Other steps run as they come.

use engine::config::ModelConfig;

use super::{
    decode::{Seat, StepError, StepOutputs, batch_bucket, decode_launch},
    device_ops::{DBuf, DIdx, DeviceStepOps},
    kernels::Kernels,
    layout::StateLayout,
    staged::{Pass, Signature, Staged},
};

/// Signatures kept, with their graphs: a decode batch cycles through a few (windows close
/// every few tokens), and a graph costs the device little.
const KEPT: usize = 32;

/// How a decoder's steps ran.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayStats {
    pub steps: usize,
    /// Steps whose signature was kept (replayed, or run by their launch pass where the device
    /// records nothing).
    pub matched: usize,
    /// Steps that launched a recorded graph (the one they recorded included).
    pub replayed: usize,
    /// Graphs recorded.
    pub captured: usize,
    /// Captures that failed and ran as they come (nothing of them had run).
    pub fell_back: usize,
}

/// The signatures and graphs of a decoder's steps.
#[derive(Debug)]
pub struct Replays<G> {
    kept: Vec<(Signature, Option<G>)>,
    /// Signatures of recent steps that were not kept.
    seen: Vec<Signature>,
    /// Why recordings failed, each logged once.
    reasons: Vec<String>,
    /// Signatures whose recording failed once.
    failed: Vec<Signature>,
    pub stats: ReplayStats,
}

impl<G> Default for Replays<G> {
    fn default() -> Self {
        Self {
            kept: Vec::new(),
            seen: Vec::new(),
            reasons: Vec::new(),
            failed: Vec::new(),
            stats: ReplayStats::default(),
        }
    }
}

impl<G> Replays<G> {
    /// Recording `sig` failed (`why`): counted, and logged the first time for each reason, so
    /// an operator learns why steps are not replayed without a line per step. A signature
    /// that failed twice is kept without a graph: its steps run their launch pass and are not
    /// recorded again.
    fn fell_back(&mut self, sig: Signature, why: &str) {
        self.stats.fell_back += 1;
        if self.failed.contains(&sig) {
            self.keep(sig, None);
        } else {
            if self.failed.len() == KEPT {
                self.failed.remove(0);
            }
            self.failed.push(sig);
        }
        if !self.reasons.iter().any(|r| r == why) && self.reasons.len() < KEPT {
            self.reasons.push(why.to_owned());
            tracing::warn!(
                reason = why,
                "a decode step could not be recorded as a graph; it ran as it came"
            );
        }
    }

    fn keep(&mut self, sig: Signature, graph: Option<G>) {
        if self.kept.len() == KEPT {
            self.kept.remove(0);
        }
        self.seen.retain(|s| *s != sig);
        self.kept.push((sig, graph));
    }

    /// Whether `sig` was seen before (and now is).
    fn seen_again(&mut self, sig: Signature) -> bool {
        if self.seen.contains(&sig) {
            return true;
        }
        if self.seen.len() == KEPT {
            self.seen.remove(0);
        }
        self.seen.push(sig);
        false
    }
}

/// A step's outputs on the device.
pub type Outputs<K> = StepOutputs<DBuf<K>, DIdx<K>>;

/// The step run as it comes (also what a failed capture falls back to).
fn run_as_it_comes<K: Kernels>(
    ops: &DeviceStepOps<Staged<K>>,
    (c, layout): (&ModelConfig, &StateLayout),
    arenas: &mut [DBuf<Staged<K>>],
    seats: &[Seat],
    tokens: &[u32],
) -> Result<Option<Outputs<K>>, StepError<K::Error>> {
    ops.kernels().start(Pass::Run);
    decode_launch(ops, c, layout, arenas, seats, tokens)
}

/// `seats` and `tokens` padded to their [`batch_bucket`] with seats of the layout's shared
/// slot (at its start, token 0) where it has one: steps of nearby batch sizes then share
/// their launches. The padding rows of the outputs follow the sequences' and nobody reads
/// them.
fn padded(layout: &StateLayout, seats: &[Seat], tokens: &[u32]) -> (Vec<Seat>, Vec<u32>) {
    let (mut seats, mut tokens) = (seats.to_vec(), tokens.to_vec());
    if let Some(slot) = layout.shared {
        let n = batch_bucket(seats.len());
        seats.resize(n, Seat { slot, len: 0 });
        tokens.resize(n, 0);
    }
    (seats, tokens)
}

/// One decode step as [`decode_launch`] computes it, replayed where it can be: its outputs on
/// the device once it ran (to read with `read_logits` or `read_outputs`, which advance the
/// seats), `None` for no tokens.
pub fn graph_step<K: Kernels>(
    ops: &DeviceStepOps<Staged<K>>,
    replays: &mut Replays<K::Graph>,
    (c, layout): (&ModelConfig, &StateLayout),
    arenas: &mut [DBuf<Staged<K>>],
    seats: &[Seat],
    tokens: &[u32],
) -> Result<Option<Outputs<K>>, StepError<K::Error>> {
    if tokens.is_empty() {
        return Ok(None);
    }
    let (padded_seats, padded_tokens) = padded(layout, seats, tokens);
    let (seats, tokens) = (&padded_seats[..], &padded_tokens[..]);
    let k = ops.kernels();
    replays.stats.steps += 1;
    k.start(Pass::Plan);
    let planned = decode_launch(ops, c, layout, arenas, seats, tokens);
    let sig = k.finish();
    let logits = match planned {
        Ok(Some(logits)) => logits,
        Ok(None) => return Ok(None),
        Err(StepError::Input(e)) => return Err(StepError::Input(e)),
        // Nothing launched: the plans are written again as the step runs.
        Err(StepError::Device(_)) => {
            return run_as_it_comes(ops, (c, layout), arenas, seats, tokens);
        }
    };
    // Kept without a graph (the device records none, or gave up on this one): the launch
    // pass runs; seen before: it is recorded.
    let record = if let Some(i) = replays.kept.iter().position(|(s, _)| *s == sig) {
        replays.stats.matched += 1;
        if let Some(graph) = &replays.kept[i].1 {
            k.launch_graph(graph)?;
            replays.stats.replayed += 1;
            return Ok(Some(logits));
        }
        false
    } else if replays.seen_again(sig) {
        true
    } else {
        drop(logits);
        return run_as_it_comes(ops, (c, layout), arenas, seats, tokens);
    };
    // The launch pass takes the plan pass's buffers (each request the oldest free one).
    drop(logits);
    k.start(Pass::Launch);
    let capturing = match if record { k.begin_capture() } else { Ok(false) } {
        Ok(capturing) => capturing,
        Err(e) => {
            replays.fell_back(sig, &e.to_string());
            return run_as_it_comes(ops, (c, layout), arenas, seats, tokens);
        }
    };
    let launched = decode_launch(ops, c, layout, arenas, seats, tokens);
    let graph = if capturing { k.end_capture() } else { Ok(None) };
    let again = k.finish();
    match (launched, graph) {
        (Ok(Some(logits)), Ok(graph)) if again == sig => {
            if let Some(graph) = &graph {
                k.launch_graph(graph)?;
                replays.stats.captured += 1;
                replays.stats.replayed += 1;
            }
            if !replays.kept.iter().any(|(s, _)| *s == sig) {
                replays.keep(sig, graph);
            }
            Ok(Some(logits))
        }
        // A recording ran nothing: the step runs as it comes.
        (launched, graph) if capturing => {
            let why = match (launched, graph) {
                (Err(e), _) => e.to_string(),
                (_, Err(e)) => format!("recording: {e}"),
                _ => "the recording made other launches than the plan pass".to_owned(),
            };
            replays.fell_back(sig, &why);
            run_as_it_comes(ops, (c, layout), arenas, seats, tokens)
        }
        // Launches ran over plans they may not match: the state cannot be trusted.
        (Err(e), _) => Err(e),
        _ => Err(StepError::Device(
            "the launch pass made other launches than the plan pass"
                .to_owned()
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use engine::{config::ExpertFormat, model::Model, synth::Preset};

    use super::*;
    use crate::step::{
        decode::{engine_decode, read_logits},
        emulated::EmulatedKernels,
        tests::{model_of, tokens},
    };

    /// Sequences decoded from their first token by `graph_step` over the kernels' CPU
    /// references: every step whose signature repeats runs as its plan pass (every write)
    /// then its launch pass (every launch, no write), as a graph replays it; the logits are
    /// the engine's bit for bit all the same.
    fn run(model: &Model, sequences: usize, steps: u64) -> (ReplayStats, Vec<Logits>, Vec<Logits>) {
        let c = &model.config;
        let ops = DeviceStepOps::new(Staged::new(EmulatedKernels::new(c)), model).unwrap();
        let layout = StateLayout::stored(c, sequences, steps as usize + 1, model.kv_rows())
            .with_shared_slot();
        let mut arenas = layout.arenas(&ops).unwrap();
        let mut seats: Vec<Seat> = (0..sequences)
            .map(|i| Seat {
                slot: sequences - 1 - i,
                len: 0,
            })
            .collect();
        let mut states: Vec<_> = (0..sequences).map(|_| model.new_state()).collect();
        let mut replays = Replays::default();
        let (mut want, mut got) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let next = tokens(sequences, 700 + step, c.vocab_size);
            want.push(engine_decode(model, &mut states, &next).unwrap());
            let out = graph_step(&ops, &mut replays, (c, &layout), &mut arenas, &seats, &next)
                .unwrap()
                .unwrap();
            got.push(read_logits(&ops, c, &out, &mut seats).unwrap());
        }
        (replays.stats, want, got)
    }

    /// Sequences joining one by one (every 7 steps, so their windows close out of step):
    /// batches of 1 to 5 over `steps` steps, the engine's bits whatever the padding.
    fn staggered(model: &Model, shared: bool, steps: u64) -> ReplayStats {
        // (Unpadded, measured: 66 of 100 steps matched; padded: 67. Most misses here are
        // the sizes that grow a class as these short sequences lengthen.)
        let c = &model.config;
        let ops = DeviceStepOps::new(Staged::new(EmulatedKernels::new(c)), model).unwrap();
        let mut layout = StateLayout::stored(c, 5, steps as usize + 1, model.kv_rows());
        if shared {
            layout = layout.with_shared_slot();
        }
        let mut arenas = layout.arenas(&ops).unwrap();
        let (mut seats, mut states) = (Vec::new(), Vec::new());
        let mut replays = Replays::default();
        for step in 0..steps {
            if step % 7 == 0 && seats.len() < 5 {
                seats.push(Seat {
                    slot: 4 - seats.len(),
                    len: 0,
                });
                states.push(model.new_state());
            }
            let next = tokens(seats.len(), 900 + step, c.vocab_size);
            let want = engine_decode(model, &mut states, &next).unwrap();
            let out = graph_step(&ops, &mut replays, (c, &layout), &mut arenas, &seats, &next)
                .unwrap()
                .unwrap();
            let got = read_logits(&ops, c, &out, &mut seats).unwrap();
            assert!(same(&[want], &[got]), "step {step}");
        }
        replays.stats
    }

    /// A batch that grows from 1 to 5 sequences, padded to batch sizes 1, 2, 4, 8 with seats
    /// of the shared slot and its window closes padded likewise: the engine's bits for every
    /// sequence (nothing of the padding reaches them), and steps run as a graph would.
    #[test]
    fn steps_of_a_changing_batch_padded_to_its_size_give_the_engines_bits() {
        let (_dir, model) = model_of(Preset::Tiny, ExpertFormat::Nvfp4);
        let stats = staggered(&model, true, 100);
        eprintln!("{stats:?}");
        assert!(stats.matched > 0, "{stats:?}");
    }

    /// With the fast linears and experts (the dense GEMM's split partials in pooled scratch,
    /// the grouped GEMV), replayed steps give the bits of the same ops run eagerly, step by
    /// step, and half of them (21 of 40 measured) run as plan pass then launch pass.
    #[test]
    fn fast_steps_replay_as_they_run_eagerly() {
        let (_dir, model) = model_of(Preset::Tiny, ExpertFormat::Nvfp4);
        let c = &model.config;
        let staged = DeviceStepOps::new(Staged::new(EmulatedKernels::new(c)), &model)
            .unwrap()
            .with_fast_linears()
            .with_fast_experts();
        let eager = DeviceStepOps::new(EmulatedKernels::new(c), &model)
            .unwrap()
            .with_fast_linears()
            .with_fast_experts();
        let stats = beside_eager((&staged, &eager), &model, (3, 40), 800);
        eprintln!("{stats:?}");
        assert!(stats.matched * 2 >= stats.steps, "{stats:?}");
    }

    /// Two ranks of each group that steps every request on every rank (the heads split, the
    /// experts whole on each, split between them, or sliced) replay their decode steps, the
    /// group's collectives launches of the launch pass, with the bits of the same group's
    /// eager steps, step by step; most steps (on every rank) run as plan pass then launch
    /// pass, which need nothing from the host but the plans written before them.
    #[test]
    fn a_groups_steps_replay_as_its_eager_steps() {
        use std::time::Duration;

        use engine::parallel::collective::InProcessGroup;

        use crate::step::group_runs::{Split, rank_model};

        let (dir, _) = model_of(Preset::Tiny, ExpertFormat::Nvfp4);
        let splits = [
            Split::Heads { experts: false },
            Split::Heads { experts: true },
            Split::Sliced,
        ];
        for split in splits {
            let group = || InProcessGroup::new(2, Duration::from_secs(30));
            let links = group()
                .into_iter()
                .zip(group())
                .zip(group().into_iter().zip(group()));
            let stats: Vec<ReplayStats> = std::thread::scope(|s| {
                let handles: Vec<_> = links
                    .map(|(staged_links, eager_links)| {
                        let dir = dir.path();
                        s.spawn(move || {
                            let staged_model = rank_model(dir, staged_links, split).unwrap();
                            let eager_model = rank_model(dir, eager_links, split).unwrap();
                            let c = &staged_model.config;
                            let kernels = Staged::new(EmulatedKernels::new(c));
                            let staged = DeviceStepOps::new(kernels, &staged_model).unwrap();
                            let eager =
                                DeviceStepOps::new(EmulatedKernels::new(c), &eager_model).unwrap();
                            beside_eager((&staged, &eager), &staged_model, (3, 60), 500)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (r, st) in stats.iter().enumerate() {
                eprintln!("{split:?} rank {r}: {st:?}");
                assert!(st.matched * 2 >= st.steps, "{split:?} rank {r}: {st:?}");
            }
        }
    }

    /// A signature whose recording failed twice is kept without a graph (its steps then run
    /// their launch pass, never a third recording); one failure is retried.
    #[test]
    fn a_signature_that_fails_to_record_twice_is_not_recorded_again() {
        let mut replays = Replays::<()>::default();
        let sig = |hash| Signature {
            hash,
            launches: 3,
            writes: 1,
        };
        replays.fell_back(sig(1), "capture refused");
        replays.fell_back(sig(2), "capture refused");
        assert!(replays.kept.is_empty());
        replays.fell_back(sig(1), "another reason");
        assert_eq!(replays.kept.len(), 1);
        assert!(replays.kept[0].0 == sig(1) && replays.kept[0].1.is_none());
        assert_eq!(replays.stats.fell_back, 3);
        assert_eq!(replays.reasons.len(), 2, "each reason logged once");
    }

    /// `sequences` sequences decoded from their first token for `steps` steps by `graph_step`
    /// over `staged` and eagerly over `eager` (the same ops), tokens from `seed`: the same bits
    /// at every step. How the replayed steps ran.
    fn beside_eager(
        (staged, eager): (
            &DeviceStepOps<Staged<EmulatedKernels>>,
            &DeviceStepOps<EmulatedKernels>,
        ),
        model: &Model,
        (sequences, steps): (usize, u64),
        seed: u64,
    ) -> ReplayStats {
        use crate::step::decode::decode_step;
        let c = &model.config;
        let layout = StateLayout::stored(c, sequences, steps as usize + 1, model.kv_rows())
            .with_shared_slot();
        let (mut replayed, mut direct) = (
            layout.arenas(staged).unwrap(),
            layout.arenas(eager).unwrap(),
        );
        let first: Vec<Seat> = (0..sequences).map(|slot| Seat { slot, len: 0 }).collect();
        let (mut seats, mut eager_seats) = (first.clone(), first);
        let mut replays = Replays::default();
        for step in 0..steps {
            let next = tokens(sequences, seed + step, c.vocab_size);
            let out = graph_step(
                staged,
                &mut replays,
                (c, &layout),
                &mut replayed,
                &seats,
                &next,
            )
            .unwrap()
            .unwrap();
            let got = read_logits(staged, c, &out, &mut seats).unwrap();
            let want =
                decode_step(eager, c, &layout, &mut direct, &mut eager_seats, &next).unwrap();
            assert!(same(&[want], &[got]), "step {step}");
        }
        replays.stats
    }

    /// A step's logits, by sequence.
    type Logits = Vec<Vec<f32>>;

    fn same(a: &[Logits], b: &[Logits]) -> bool {
        a.len() == b.len()
            && a.iter()
                .flatten()
                .flatten()
                .zip(b.iter().flatten().flatten())
                .all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// 3 sequences decoded from their first token for 150 steps, every window close and the
    /// first HCA window on the way: the same bits as the engine, and most steps (120 of 150
    /// measured) run as plan pass then launch pass, as a graph would replay them. Putting
    /// the token ids of each layer's routing into a pooled buffer of their own (written by the
    /// host after kernels used it in a step) fails this and no other step test.
    #[test]
    fn replayed_steps_give_the_engines_bits() {
        let (_dir, model) = model_of(Preset::Tiny, ExpertFormat::Nvfp4);
        let (stats, want, got) = run(&model, 3, 150);
        eprintln!("{stats:?}");
        assert!(same(&want, &got));
        assert_eq!(stats.steps, 150);
        assert!(stats.matched * 4 >= stats.steps * 3, "{stats:?}");
        assert_eq!((stats.captured, stats.replayed, stats.fell_back), (0, 0, 0));
    }
}
