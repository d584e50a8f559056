//! Expert-parallel ranks stepping on their devices over the kernels' references
//! (`step::group_runs`): every request's events equal the one-rank host engine's, at 2 and 4
//! ranks, with prompts on the device or on the host, though each rank's copies of the experts
//! it does not hold are wrong; a rank whose device step fails fails the group's requests with
//! its words instead of leaving the others waiting.

use engine::{
    config::ExpertFormat,
    model::Model,
    scheduler::{DecodeSeat, Event, StepDevice},
    synth::{GenerateOptions, Preset, generate},
};

use crate::step::{
    decoder::StepDecoder,
    emulated::EmulatedKernels,
    group_runs::{
        Split, config as slot_config, on_group, on_group_host, on_ranks, one_rank, slot_tokens,
    },
};

pub(super) fn checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 17, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    dir
}

/// The emulated step device for a rank's model, with prompt chunks of `chunk` (0: none).
fn emulated(model: &Model, chunk: usize) -> Result<StepDecoder<EmulatedKernels>, String> {
    let kernels = EmulatedKernels::new(&model.config);
    let device = StepDecoder::new(
        "emulated",
        kernels,
        model,
        (3, slot_tokens()),
        |_, _| Ok(()),
    )
    .map_err(|e| e.to_string())?;
    if chunk == 0 {
        return Ok(device);
    }
    device
        .with_prompts(chunk, |_, _| Ok(()))
        .map_err(|e| e.to_string())
}

/// Every request of `events` answered (none failed): a reference worth comparing with.
fn all_answered(events: &std::collections::BTreeMap<u64, Vec<Event>>) {
    assert_eq!(events.len(), 7);
    assert!(
        events
            .values()
            .flatten()
            .all(|e| !matches!(e, Event::Failed { .. })),
        "{events:?}"
    );
}

#[test]
fn expert_parallel_ranks_on_their_devices_give_the_one_rank_events() {
    let dir = checkpoint();
    let want = one_rank(dir.path()).unwrap();
    all_answered(&want);
    for (ranks, chunk) in [(2usize, 16usize), (2, 0), (4, 7)] {
        let open = |model: &Model, _rank: usize| {
            Ok(Box::new(emulated(model, chunk)?) as Box<dyn StepDevice>)
        };
        let got = on_ranks(dir.path(), ranks, &open).unwrap();
        assert_eq!(got, want, "{ranks} ranks, prompt chunks of {chunk}");
    }
}

/// Two tensor-parallel ranks on their devices, each computing half the heads and output groups
/// and gathering the groups' outputs, the experts whole on each rank or split between them
/// (each computing its experts' pairs of the tokens both hold): every rank's events equal the
/// one-rank host engine's, prompts on the device and on the host.
#[test]
fn tensor_parallel_ranks_on_their_devices_give_the_one_rank_events() {
    let dir = checkpoint();
    let want = one_rank(dir.path()).unwrap();
    for (experts, chunk) in [(false, 16usize), (true, 7), (true, 0)] {
        let open = |model: &Model, _rank: usize| {
            Ok(Box::new(emulated(model, chunk)?) as Box<dyn StepDevice>)
        };
        let split = Split::Heads { experts };
        let got = on_group(dir.path(), (2, split), &open).unwrap();
        assert_eq!(got, want, "{split:?}, prompt chunks of {chunk}");
    }
}

/// Two ranks with every routed expert sliced between them, each holding and computing its
/// half of every expert's intermediate values and summing both halves' partial outputs in
/// rank order: every rank's events equal the host forward's of the same group, bit for bit,
/// prompts on the device and on the host (the one-rank engine's bits differ: the partial sums
/// add in another order, `engine/tests/sliced_experts.rs` bounds them).
#[test]
fn expert_slice_ranks_on_their_devices_give_the_host_groups_events() {
    let dir = checkpoint();
    let want = on_group_host(dir.path(), (2, Split::Sliced)).unwrap();
    all_answered(&want);
    for chunk in [16usize, 0] {
        let open = |model: &Model, _rank: usize| {
            Ok(Box::new(emulated(model, chunk)?) as Box<dyn StepDevice>)
        };
        let got = on_group(dir.path(), (2, Split::Sliced), &open).unwrap();
        assert_eq!(got, want, "prompt chunks of {chunk}");
    }
}

/// A group whose ranks would step prompts differently (one on its device in chunks, one on
/// the host, which would meet the other's device exchanges with its host forward's) is
/// refused at start, naming both ranks' ways; ranks alike start.
#[test]
fn a_group_whose_ranks_step_differently_is_refused() {
    use engine::{
        backend::BackendError,
        parallel::group::{GroupSpec, RankSetup, start},
        plan::shard::Parallel,
        scheduler::EngineConfig,
    };
    let dir = checkpoint();
    let spec = GroupSpec {
        parallel: Parallel {
            ep: 2,
            dp_attention: true,
            ..Parallel::SINGLE
        },
        ..GroupSpec::SINGLE
    };
    for chunks in [[16usize, 0], [16, 16]] {
        let open = |model: &Model, _: &EngineConfig, rank: usize| {
            emulated(model, chunks[rank])
                .map(|d| Box::new(d) as Box<dyn StepDevice>)
                .map_err(|reason| BackendError::Unavailable {
                    backend: "emulated".to_owned(),
                    reason,
                })
        };
        let setup = RankSetup {
            decode: Some(&open),
            ..RankSetup::cpu(2)
        };
        let model = Model::load(dir.path()).unwrap();
        let started = start(
            model,
            &slot_config(),
            "alike",
            (spec, setup),
            "alike",
            &|_| {},
        );
        if chunks[0] == chunks[1] {
            assert!(started.is_ok(), "{:?}", started.err());
            continue;
        }
        let refused = started.err().unwrap().to_string();
        assert!(
            refused.contains("rank 1 steps on emulated (prompts on the host)")
                && refused.contains("rank 0 on emulated, prompt chunks of 16 (prompt chunk 16)"),
            "{refused}"
        );
    }
}

/// A step device whose decode steps fail from the `after`-th on.
#[derive(Debug)]
struct FailingAfter {
    inner: StepDecoder<EmulatedKernels>,
    after: usize,
    steps: usize,
}

impl StepDevice for FailingAfter {
    fn name(&self) -> &'static str {
        "failing"
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens()
    }
    fn kv_rows(&self) -> engine::paged::layout::RowFormat {
        self.inner.kv_rows()
    }
    fn load(
        &mut self,
        slot: usize,
        state: &engine::model::SequenceState,
    ) -> Result<(), engine::backend::DeviceError> {
        self.inner.load(slot, state)
    }
    fn step(
        &mut self,
        seats: &[DecodeSeat],
    ) -> Result<Vec<Vec<f32>>, engine::backend::DeviceError> {
        self.steps += 1;
        if self.steps >= self.after {
            return Err(engine::backend::DeviceError::device("planted failure"));
        }
        self.inner.step(seats)
    }
    fn read(
        &mut self,
        slot: usize,
        len: usize,
    ) -> Result<engine::model::SequenceState, engine::backend::DeviceError> {
        self.inner.read(slot, len)
    }
    fn expert_parallel(&self) -> bool {
        self.inner.expert_parallel()
    }
    fn idle_step(&mut self) -> Result<(), engine::backend::DeviceError> {
        self.inner.idle_step()
    }
    // Its prompts step on the device as the other rank's do (a group's ranks run the same
    // phases: a rank with prompts on the host would meet the others' device exchanges).
    fn prompt_chunk(&self) -> usize {
        self.inner.prompt_chunk()
    }
    fn prompt_step(
        &mut self,
        chunks: &[engine::scheduler::PromptChunk<'_>],
    ) -> Result<Vec<engine::scheduler::PromptOut>, engine::backend::DeviceError> {
        self.inner.prompt_step(chunks)
    }
}

/// Rank 1's third decode step fails before its exchanges: its requests fail with its words,
/// and the other rank's, waiting in an exchange, fail with the group's failure at once (not
/// after the collectives' timeout); nothing answers as if it had succeeded.
#[test]
fn a_failing_rank_fails_the_groups_requests() {
    let dir = checkpoint();
    let open = |model: &Model, rank: usize| {
        let inner = emulated(model, 16)?;
        Ok(if rank == 1 {
            Box::new(FailingAfter {
                inner,
                after: 3,
                steps: 0,
            }) as Box<dyn StepDevice>
        } else {
            Box::new(inner) as Box<dyn StepDevice>
        })
    };
    let started = std::time::Instant::now();
    let got = on_ranks(dir.path(), 2, &open).unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    let failed: Vec<(u64, String)> = got
        .values()
        .flatten()
        .filter_map(|e| match e {
            Event::Failed { id, error } => Some((*id, error.clone())),
            _ => None,
        })
        .collect();
    assert!(
        failed
            .iter()
            .any(|(id, e)| id % 2 == 1 && e.contains("planted failure")),
        "{failed:?}"
    );
    assert!(
        failed
            .iter()
            .any(|(id, e)| id % 2 == 0 && e.contains("rank 1")),
        "{failed:?}"
    );
    // Every request either finished whole before the failure or failed.
    for (id, events) in &got {
        assert!(
            matches!(
                events.last(),
                Some(Event::Failed { .. } | Event::Finished { .. })
            ),
            "request {id}: {events:?}"
        );
    }
}

/// Graphs over a group: a tensor-parallel rank (the heads split, the experts whole, split or
/// sliced: its exchanges' sizes are the batch's) turns them on; an expert-parallel rank with
/// requests of its own refuses them, naming the counts it reads back at every MoE layer.
#[test]
fn graphs_are_refused_only_where_a_groups_exchanges_follow_the_routing() {
    use std::time::Duration;

    use engine::parallel::collective::InProcessGroup;

    use crate::step::group_runs::rank_model;

    let dir = checkpoint();
    let splits = [
        Split::Experts,
        Split::Heads { experts: false },
        Split::Heads { experts: true },
        Split::Sliced,
    ];
    for split in splits {
        let first = || {
            InProcessGroup::new(2, Duration::from_secs(5))
                .into_iter()
                .next()
                .unwrap()
        };
        let model = rank_model(dir.path(), (first(), first()), split).unwrap();
        let graphs = emulated(&model, 0).unwrap().with_graphs(|_, _| Ok(()));
        match split {
            Split::Experts => {
                let e = graphs.err().unwrap().to_string();
                assert!(e.contains("counts at every MoE layer"), "{e}");
            }
            _ => assert!(graphs.is_ok(), "{split:?}"),
        }
    }
}
