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
    group_runs::{on_ranks, one_rank, slot_tokens},
};

fn checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    generate(&GenerateOptions {
        preset: Preset::Tiny,
        seed: 17,
        experts: ExpertFormat::Nvfp4,
        out: dir.path().to_path_buf(),
        tokenizer_dir: None,
    })
    .unwrap();
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

#[test]
fn expert_parallel_ranks_on_their_devices_give_the_one_rank_events() {
    let dir = checkpoint();
    let want = one_rank(dir.path()).unwrap();
    assert_eq!(want.len(), 7);
    assert!(
        want.values()
            .flatten()
            .all(|e| !matches!(e, Event::Failed { .. })),
        "{want:?}"
    );
    for (ranks, chunk) in [(2usize, 16usize), (2, 0), (4, 7)] {
        let open = |model: &Model, _rank: usize| {
            Ok(Box::new(emulated(model, chunk)?) as Box<dyn StepDevice>)
        };
        let got = on_ranks(dir.path(), ranks, &open).unwrap();
        assert_eq!(got, want, "{ranks} ranks, prompt chunks of {chunk}");
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
