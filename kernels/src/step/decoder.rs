//! [`StepDecoder`]: the device decode step as the engine's [`DecodeDevice`], so a worker's
//! scheduler steps its decode tokens on the device: the weights uploaded once, the sequences'
//! state in the arenas of a [`StateLayout`] (a slot per running request), each step's tokens
//! in and logits out. Over [`super::emulated::EmulatedKernels`] it is what CI checks the
//! scheduler's use of a device with; over `cuda::CudaKernels` it is a GPU decode worker.

use engine::{
    config::ModelConfig,
    model::{Model, SequenceState},
    paged::layout::RowFormat,
    scheduler::{
        DecodeDevice, DecodeOut, DecodeSeat, DeviceError, DeviceRun, PromptChunk, PromptOut,
    },
};

use super::{
    decode::{Seat, decode_launch, prompt_step, read_logits, read_outputs},
    device_ops::{DBuf, DeviceStepOps},
    kernels::Kernels,
    layout::StateLayout,
    replay::{Outputs, ReplayStats, Replays, graph_step},
    staged::Staged,
};

/// The decode step over `K`'s kernels with the state of `slots` sequences on the device.
pub struct StepDecoder<K: Kernels> {
    name: String,
    ops: DeviceStepOps<Staged<K>>,
    config: ModelConfig,
    layout: StateLayout,
    arenas: Vec<DBuf<K>>,
    kv_rows: RowFormat,
    /// Steps replayed as graphs (`None`: every step runs as it comes).
    replays: Option<Replays<K::Graph>>,
    /// How the last step ran.
    last: Option<DeviceRun>,
    /// Whether a state was ever loaded (graphs are turned on before).
    loaded: bool,
    /// Whether it steps prompt chunks (of up to `layout.chunk` tokens).
    prompts: bool,
}

impl<K: Kernels> std::fmt::Debug for StepDecoder<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepDecoder")
            .field("name", &self.name)
            .field("slots", &self.layout.sequence_slots())
            .field("tokens", &self.layout.tokens)
            .finish_non_exhaustive()
    }
}

/// Bytes of the arenas holding `slots` sequences of at most `tokens` tokens of a model
/// configured by `c` whose K=V rows are stored as `kv` (what a device needs for the state
/// beside the weights).
pub fn arena_bytes(c: &ModelConfig, slots: usize, tokens: usize, kv: RowFormat) -> usize {
    let layout = StateLayout::stored(c, slots, tokens, kv);
    (0..c.layers.len()).map(|l| 4 * layout.arena_len(l)).sum()
}

impl<K: Kernels> StepDecoder<K> {
    /// Uploads `model`'s weights through `k` and allocates the arenas of `slots` sequences of
    /// at most `tokens` tokens each, once `room` (given the kernels and the arenas' bytes) says
    /// they fit; `name` names the device in logs and errors.
    pub fn new(
        name: &str,
        k: K,
        model: &Model,
        (slots, tokens): (usize, usize),
        room: impl FnOnce(&K, usize) -> Result<(), K::Error>,
    ) -> Result<Self, K::Error> {
        let ops = DeviceStepOps::new(Staged::new(k), model)?;
        let kv = model.kv_rows();
        room(
            ops.kernels().inner(),
            arena_bytes(&model.config, slots, tokens, kv),
        )?;
        let layout = StateLayout::stored(&model.config, slots, tokens, kv);
        let arenas = layout.arenas(&ops)?;
        Ok(Self {
            name: name.to_owned(),
            ops,
            config: model.config.clone(),
            layout,
            arenas,
            kv_rows: model.kv_rows(),
            replays: None,
            last: None,
            loaded: false,
            prompts: false,
        })
    }

    /// The kernels it launches.
    pub fn kernels(&self) -> &K {
        self.ops.kernels().inner()
    }

    /// Runs the routed experts with the fast grouped GEMV from now on
    /// (`DeviceStepOps::with_fast_experts`: within its bound, not the engine's bits).
    #[must_use]
    pub fn with_fast_experts(mut self) -> Self {
        self.ops = self.ops.with_fast_experts();
        self.name = format!("{}, fast experts", self.name);
        self
    }

    /// Runs the bf16 and FP8 linears with the dense GEMM from now on
    /// (`DeviceStepOps::with_fast_linears`: within its bound, not the engine's bits).
    #[must_use]
    pub fn with_fast_linears(mut self) -> Self {
        self.ops = self.ops.with_fast_linears();
        self.name = format!("{}, fast linears", self.name);
        self
    }

    /// Replays steps as graphs from now on ([`graph_step`]: recorded where the device
    /// records, the launch pass run where it does not), padded to batch sizes with seats of
    /// a shared slot the arenas gain (one slot's bytes more, once `room` says those bytes fit;
    /// before any state is loaded).
    pub fn with_graphs(
        mut self,
        room: impl FnOnce(&K, usize) -> Result<(), K::Error>,
    ) -> Result<Self, K::Error> {
        if self.loaded {
            return Err("graphs are turned on before any state is loaded"
                .to_owned()
                .into());
        }
        if self.prompts {
            return Err(
                "graphs replay the decode steps of a device that steps no prompts"
                    .to_owned()
                    .into(),
            );
        }
        let layout = self.layout.clone().with_shared_slot();
        // What the shared slot adds, checked while the old arenas still hold their bytes.
        let bytes = |layout: &StateLayout| -> usize {
            (0..self.config.layers.len())
                .map(|l| 4 * layout.arena_len(l))
                .sum()
        };
        room(
            self.ops.kernels().inner(),
            bytes(&layout) - bytes(&self.layout),
        )?;
        // The old arenas go first: both would not fit where the state fills the device.
        self.arenas = Vec::new();
        self.layout = layout;
        self.arenas = self.layout.arenas(&self.ops)?;
        self.replays = Some(Replays::default());
        self.name = format!("{}, graphs", self.name);
        Ok(self)
    }

    /// Steps prompt chunks of up to `chunk` tokens of a sequence too from now on
    /// ([`DecodeDevice::prompt_step`], [`super::decode::prompt_step`]: the exact kernels, the
    /// engine's bits): the arenas are laid out again for chunks (`StateLayout::chunked`: a
    /// longer window ring, more unfinished compressor windows), once `room` says the bytes
    /// they add fit; before any state is loaded, and without graphs.
    pub fn with_prompts(
        mut self,
        chunk: usize,
        room: impl FnOnce(&K, usize) -> Result<(), K::Error>,
    ) -> Result<Self, K::Error> {
        if self.loaded || self.replays.is_some() || chunk == 0 {
            return Err(format!(
                "prompt chunks ({chunk} tokens) are turned on before any state is loaded, \
                 without graphs, for chunks of a token or more"
            )
            .into());
        }
        let l = &self.layout;
        let layout = StateLayout::chunked(&self.config, (l.slots, l.tokens), self.kv_rows, chunk);
        let bytes = |layout: &StateLayout| -> usize {
            (0..self.config.layers.len())
                .map(|l| 4 * layout.arena_len(l))
                .sum()
        };
        room(
            self.ops.kernels().inner(),
            bytes(&layout).saturating_sub(bytes(&self.layout)),
        )?;
        self.arenas = Vec::new();
        self.layout = layout;
        self.arenas = self.layout.arenas(&self.ops)?;
        self.prompts = true;
        self.name = format!("{}, prompt chunks of {chunk}", self.name);
        Ok(self)
    }

    /// How its steps ran, with graphs.
    pub fn replay_stats(&self) -> Option<ReplayStats> {
        self.replays.as_ref().map(|r| r.stats)
    }

    /// Attends with the fast kernel from now on (`DeviceStepOps::with_fast_attention`: FP8 K=V
    /// rows, within its bound of the exact attention).
    pub fn with_fast_attention(mut self) -> Result<Self, K::Error> {
        self.ops = self.ops.with_fast_attention()?;
        self.name = format!("{}, fast attention", self.name);
        Ok(self)
    }
}

/// How a step ran, from the replay counts before and after it.
fn run_of(before: ReplayStats, after: ReplayStats) -> DeviceRun {
    if after.fell_back > before.fell_back {
        DeviceRun::FellBack
    } else if after.captured > before.captured {
        DeviceRun::Recorded
    } else if after.replayed > before.replayed {
        DeviceRun::Replayed
    } else if after.matched > before.matched {
        DeviceRun::LaunchPass
    } else {
        DeviceRun::AsItCame
    }
}

fn seated(seats: &[DecodeSeat]) -> Vec<Seat> {
    seats
        .iter()
        .map(|s| Seat {
            slot: s.slot,
            len: s.len,
        })
        .collect()
}

impl<K: Kernels> StepDecoder<K> {
    /// Runs a step over `at` (the seats' slots and lengths), replayed where graphs are on:
    /// its outputs on the device.
    fn run(
        &mut self,
        at: &[Seat],
        seats: &[DecodeSeat],
    ) -> Result<Option<Outputs<K>>, DeviceError> {
        if let Some(s) = at.iter().find(|s| s.slot >= self.layout.sequence_slots()) {
            return Err(DeviceError::device(format!(
                "no slot {}: {} slots",
                s.slot,
                self.layout.sequence_slots()
            )));
        }
        let tokens: Vec<u32> = seats.iter().map(|s| s.token).collect();
        let shape = (&self.config, &self.layout);
        let out = if let Some(replays) = &mut self.replays {
            let before = replays.stats;
            let out = graph_step(&self.ops, replays, shape, &mut self.arenas, at, &tokens);
            self.last = Some(run_of(before, replays.stats));
            out
        } else {
            self.last = Some(DeviceRun::AsItCame);
            decode_launch(&self.ops, shape.0, shape.1, &mut self.arenas, at, &tokens)
        };
        out.map_err(DeviceError::device)
    }
}

impl<K: Kernels> DecodeDevice for StepDecoder<K>
where
    StepDecoder<K>: Send,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn slots(&self) -> usize {
        self.layout.sequence_slots()
    }

    fn max_tokens(&self) -> usize {
        self.layout.tokens
    }

    fn kv_rows(&self) -> RowFormat {
        self.kv_rows
    }

    fn load(&mut self, slot: usize, state: &SequenceState) -> Result<(), DeviceError> {
        if slot >= self.layout.sequence_slots() {
            return Err(DeviceError::device(format!(
                "no slot {slot}: {} slots",
                self.layout.sequence_slots()
            )));
        }
        self.loaded = true;
        self.layout
            .load(&self.ops, &mut self.arenas, slot, state)
            .map_err(DeviceError::device)
    }

    fn step(&mut self, seats: &[DecodeSeat]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let mut at = seated(seats);
        match self.run(&at, seats)? {
            Some(out) => read_logits(&self.ops, &self.config, &out, &mut at),
            None => Ok(Vec::new()),
        }
        .map_err(DeviceError::device)
    }

    /// The argmax of a greedy sequence's logits is taken on the device: what crosses back for
    /// it is two indices, not its logits.
    fn step_outputs(
        &mut self,
        seats: &[DecodeSeat],
        argmax: &[bool],
    ) -> Result<Vec<DecodeOut>, DeviceError> {
        let mut at = seated(seats);
        match self.run(&at, seats)? {
            Some(out) => read_outputs(&self.ops, &self.config, &out, &mut at, argmax),
            None => Ok(Vec::new()),
        }
        .map_err(DeviceError::device)
    }

    fn last_run(&self) -> Option<DeviceRun> {
        self.last
    }

    fn prompt_chunk(&self) -> usize {
        if self.prompts { self.layout.chunk } else { 0 }
    }

    /// The chunks' tokens as one step (each token a seat of its sequence's slot at its
    /// position), the output head over the rows their logits ask for only; then each chunk's
    /// delta read back from its slot.
    fn prompt_step(&mut self, chunks: &[PromptChunk<'_>]) -> Result<Vec<PromptOut>, DeviceError> {
        if !self.prompts {
            return Err(DeviceError::device(format!(
                "{} steps no prompts",
                self.name
            )));
        }
        let slots = self.layout.sequence_slots();
        if let Some(c) = chunks.iter().find(|c| c.slot >= slots) {
            return Err(DeviceError::device(format!(
                "no slot {}: {slots} slots",
                c.slot
            )));
        }
        let (mut seats, mut tokens, mut wanted) = (Vec::new(), Vec::new(), Vec::new());
        for c in chunks {
            let first = tokens.len();
            let n = c.tokens.len();
            seats.extend((0..n).map(|i| Seat {
                slot: c.slot,
                len: c.start + i,
            }));
            tokens.extend_from_slice(c.tokens);
            wanted.extend((n - c.rows()..n).map(|i| first + i));
        }
        self.loaded = true;
        let shape = (&self.config, &self.layout);
        let rows = prompt_step(
            &self.ops,
            shape.0,
            shape.1,
            &mut self.arenas,
            &mut seats,
            (&tokens, &wanted),
        )
        .map_err(DeviceError::device)?;
        let mut rows = rows.into_iter();
        let mut outs = Vec::with_capacity(chunks.len());
        for c in chunks {
            let to = c.start + c.tokens.len();
            let delta = self
                .layout
                .read_delta(&self.ops, &self.arenas, c.slot, (c.start, to))
                .map_err(DeviceError::device)?;
            outs.push(PromptOut {
                logits: rows.by_ref().take(c.rows()).collect(),
                delta,
            });
        }
        Ok(outs)
    }

    fn read(&mut self, slot: usize, len: usize) -> Result<SequenceState, DeviceError> {
        if slot >= self.layout.sequence_slots() || len > self.layout.tokens {
            return Err(DeviceError::device(format!(
                "no {len}-token state in slot {slot} of {}",
                self.layout.sequence_slots()
            )));
        }
        self.layout
            .read(&self.ops, &self.arenas, slot, len)
            .map_err(DeviceError::device)
    }
}

#[cfg(test)]
mod tests {
    use engine::{
        config::ExpertFormat,
        paged::layout::KvStorage,
        sampling::{SamplingParams, StopConditions},
        scheduler::{Engine, EngineConfig, Event, GenerationRequest},
        synth::{GenerateOptions, Preset, Rng, generate},
    };

    use super::*;
    use crate::step::emulated::EmulatedKernels;

    /// The tiny checkpoint of `seed`, loaded.
    fn tiny(seed: u64) -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        generate(&GenerateOptions {
            preset: Preset::Tiny,
            seed,
            experts: ExpertFormat::Nvfp4,
            out: dir.path().to_path_buf(),
            tokenizer_dir: None,
        })
        .unwrap();
        let model = Model::load(dir.path()).unwrap();
        (dir, model)
    }

    fn config() -> EngineConfig {
        EngineConfig {
            page_size: 16,
            num_pages: 24,
            max_running: 3,
            max_batch_tokens: 48,
            kv: KvStorage::F32,
            prefix_cache: true,
        }
    }

    fn requests(vocab: usize) -> Vec<GenerationRequest> {
        let mut rng = Rng::for_tensor(9, "decoder");
        (0..4u64)
            .map(|id| GenerationRequest {
                id,
                prompt: (0..[2, 21, 7, 40][id as usize])
                    .map(|_| (rng.next_u64() % vocab as u64) as u32)
                    .collect(),
                sampling: SamplingParams {
                    temperature: [0.0, 0.9][id as usize % 2],
                    seed: Some(id + 3),
                    // The first greedy without log-probabilities: its argmax on the device.
                    logprobs: id != 0,
                    top_logprobs: if id == 0 { 0 } else { 2 },
                    ..SamplingParams::default()
                },
                stop: StopConditions {
                    max_tokens: [6, 3, 9, 5][id as usize],
                    min_tokens: 0,
                    stop_token_ids: vec![],
                    ignore_eos: true,
                    eos_token_ids: vec![],
                },
            })
            .collect()
    }

    /// Three requests, a fourth arriving once they decode.
    fn run(engine: &mut Engine, requests: &[GenerationRequest]) -> Vec<Event> {
        let mut events = Vec::new();
        for r in &requests[..3] {
            engine.add(r.clone()).unwrap();
        }
        for _ in 0..3 {
            events.extend(engine.step());
        }
        engine.add(requests[3].clone()).unwrap();
        events.extend(engine.run_to_completion());
        events
    }

    /// A scheduler decoding on the device step (over the kernels' CPU references) produces
    /// the events of one decoding with the host forward: every token, its log-probabilities,
    /// the finishes; slots are reused (4 requests through 3) and the state read back from a
    /// slot is the engine's.
    #[test]
    fn an_engine_decoding_on_the_device_step_gives_the_host_forwards_events() {
        let (_dir, mut model) = tiny(4);
        let c = config();
        let tokens = c.num_pages as usize * c.page_size;
        let requests = requests(model.config.vocab_size);
        let mut want = Vec::new();
        // FP8 K=V rows too: the step rounds them as the engine does.
        // And with steps replayed as graphs (plan pass, then launch pass, over the references).
        for (kv, graphs) in [
            (KvStorage::Fp8, false),
            (KvStorage::F32, true),
            (KvStorage::Fp8, true),
            (KvStorage::F32, false),
        ] {
            model.set_kv_storage(kv);
            let c = EngineConfig { kv, ..c.clone() };
            let mut host = Engine::new(model.replica(), c.clone(), "t").unwrap();
            want = run(&mut host, &requests);
            let kernels = EmulatedKernels::new(&model.config);
            let mut decoder =
                StepDecoder::new("emulated", kernels, &model, (3, tokens), |_, _| Ok(())).unwrap();
            if graphs {
                decoder = decoder.with_graphs(|_, _| Ok(())).unwrap();
            }
            let mut engine = Engine::new(model.replica(), c, "t").unwrap();
            engine.set_decode_device(Box::new(decoder)).unwrap();
            // Each device step reports how it ran; the greedy request's tokens come back as
            // argmaxes.
            let records = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let seen = std::sync::Arc::clone(&records);
            engine.set_step_observer(engine::scheduler::StepObserver(Box::new(move |r| {
                seen.lock().unwrap().push((r.device_run, r.argmax_tokens));
            })));
            let got = run(&mut engine, &requests);
            let records = records.lock().unwrap().clone();
            let runs: Vec<DeviceRun> = records.iter().filter_map(|r| r.0).collect();
            assert!(!runs.is_empty());
            // (These short, changing batches repeat no step's launches: none is replayed.)
            assert!(
                runs.iter()
                    .all(|r| *r == DeviceRun::AsItCame || (graphs && *r == DeviceRun::LaunchPass)),
                "{kv:?}: {runs:?}"
            );
            let argmaxes: usize = records.iter().map(|r| r.1).sum();
            assert!(argmaxes > 0, "{kv:?}");
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g, w, "{kv:?}, graphs {graphs}");
            }
            assert!(want.iter().all(|e| !matches!(e, Event::Failed { .. })));
            let finished = want
                .iter()
                .filter(|e| matches!(e, Event::Finished { .. }))
                .count();
            assert_eq!(finished, 4);
            let store = engine.store();
            assert_eq!(store.pages().used_count(), store.prefix().len());
        }

        // Mid-run, a slot holds the state the engine's forward reached.
        let mut engine = Engine::new(model.replica(), c.clone(), "t").unwrap();
        let kernels = EmulatedKernels::new(&model.config);
        let decoder =
            StepDecoder::new("emulated", kernels, &model, (3, tokens), |_, _| Ok(())).unwrap();
        engine.set_decode_device(Box::new(decoder)).unwrap();
        let req = &requests[2];
        engine.add(req.clone()).unwrap();
        for _ in 0..3 {
            let _ = engine.step();
        }
        let held = engine.device_state(req.id).unwrap().unwrap();
        let mut state = model.new_state();
        let mut fed = req.prompt.clone();
        fed.extend(
            want.iter()
                .filter_map(|e| match e {
                    Event::Token { id, sampled, .. } if *id == req.id => Some(sampled.token),
                    _ => None,
                })
                .take(held.len - req.prompt.len()),
        );
        model
            .forward(&mut state, &fed, engine::model::Logits::None)
            .unwrap();
        assert_eq!(held, state.normalized(&model.config));
    }

    /// Each request's events, in order.
    fn by_request(events: &[Event]) -> std::collections::BTreeMap<u64, Vec<Event>> {
        let mut out = std::collections::BTreeMap::<u64, Vec<Event>>::new();
        for e in events {
            let id = match e {
                Event::Token { id, .. }
                | Event::Finished { id, .. }
                | Event::Failed { id, .. }
                | Event::PromptLogprobs { id, .. } => *id,
                other => panic!("unexpected {other:?}"),
            };
            out.entry(id).or_default().push(e.clone());
        }
        out
    }

    /// An engine stepping prompt chunks and decode tokens on the device step (over the
    /// kernels' CPU references) gives every request the events of the host forward: a prompt
    /// longer than several chunks, one shorter than a chunk, prompt log-probabilities, and a
    /// prompt that extends another's (its first blocks from the prefix cache, stored from the
    /// device's deltas); slots are reused, and the device refuses graphs beside prompts.
    #[test]
    fn an_engine_stepping_prompts_on_the_device_gives_the_host_forwards_events() {
        let (_dir, mut model) = tiny(4);
        let c = config();
        let tokens = c.num_pages as usize * c.page_size;
        let mut requests = requests(model.config.vocab_size);
        requests[2].sampling.prompt_logprobs = Some(2);
        let mut longer = requests[3].clone();
        longer.id = 4;
        longer.prompt.extend([5, 6, 7]);
        requests.push(longer);
        for (kv, chunk) in [(KvStorage::Fp8, 16), (KvStorage::F32, 7)] {
            model.set_kv_storage(kv);
            let c = EngineConfig { kv, ..c.clone() };
            let mut host = Engine::new(model.replica(), c.clone(), "t").unwrap();
            let want = run(&mut host, &requests[..4]);
            host.add(requests[4].clone()).unwrap();
            let want = [want, host.run_to_completion()].concat();
            let kernels = EmulatedKernels::new(&model.config);
            let decoder = StepDecoder::new("emulated", kernels, &model, (3, tokens), |_, _| Ok(()))
                .unwrap()
                .with_prompts(chunk, |_, _| Ok(()))
                .unwrap();
            assert_eq!(decoder.prompt_chunk(), chunk);
            let mut engine = Engine::new(model.replica(), c, "t").unwrap();
            engine.set_decode_device(Box::new(decoder)).unwrap();
            let got = run(&mut engine, &requests[..4]);
            engine.add(requests[4].clone()).unwrap();
            let got = [got, engine.run_to_completion()].concat();
            let (want, got) = (by_request(&want), by_request(&got));
            assert_eq!(want.len(), 5);
            for (id, events) in &want {
                assert_eq!(
                    got.get(id),
                    Some(events),
                    "{kv:?}, chunk {chunk}: request {id}"
                );
            }
            let cached = |events: &[Event]| match events.last() {
                Some(Event::Finished { usage, .. }) => usage.cached_tokens,
                other => panic!("{other:?}"),
            };
            assert!(
                cached(&got[&4]) >= 32,
                "the longer prompt's blocks came from the cache"
            );
            let store = engine.store();
            assert_eq!(store.pages().used_count(), store.prefix().len());
        }
        let kernels = EmulatedKernels::new(&model.config);
        let decoder = StepDecoder::new("emulated", kernels, &model, (3, 64), |_, _| Ok(()))
            .unwrap()
            .with_prompts(8, |_, _| Ok(()))
            .unwrap();
        assert!(decoder.with_graphs(|_, _| Ok(())).is_err());
    }

    /// A greedy sequence without log-probabilities gets its argmax from the device: a step of
    /// three sequences, two of them greedy, reads back 6 indices and one logits row, and gives
    /// the argmaxes of the rows a plain step gives (and that row), with graphs or without.
    #[test]
    fn greedy_sequences_read_back_their_argmax_only() {
        let (_dir, model) = tiny(6);
        let vocab = model.config.vocab_size;
        let mut rng = Rng::for_tensor(2, "argmax");
        let mut random = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect()
        };
        let prompts = [random(5), random(17), random(9)];
        let open = |graphs: bool| {
            let kernels = EmulatedKernels::new(&model.config);
            let mut d =
                StepDecoder::new("emulated", kernels, &model, (3, 64), |_, _| Ok(())).unwrap();
            if graphs {
                d = d.with_graphs(|_, _| Ok(())).unwrap();
            }
            for (slot, prompt) in prompts.iter().enumerate() {
                let mut state = model.new_state();
                model
                    .forward(&mut state, prompt, engine::model::Logits::None)
                    .unwrap();
                d.load(slot, &state).unwrap();
            }
            d
        };
        let (mut plain, mut greedy, mut graphs) = (open(false), open(false), open(true));
        assert!(
            open(false).with_graphs(|_, _| Ok(())).is_err(),
            "after a load"
        );
        let argmax = [true, false, true];
        let mut runs = Vec::new();
        for step in 0..6 {
            let next = random(3);
            let seats: Vec<DecodeSeat> = (0..3)
                .map(|slot| DecodeSeat {
                    slot,
                    len: prompts[slot].len() + step,
                    token: next[slot],
                })
                .collect();
            let rows = plain.step(&seats).unwrap();
            let want: Vec<DecodeOut> = rows
                .into_iter()
                .zip(argmax)
                .map(|(row, a)| DecodeOut::of(row, a))
                .collect();
            for d in [&mut greedy, &mut graphs] {
                d.kernels().take_reads();
                assert_eq!(
                    d.step_outputs(&seats, &argmax).unwrap(),
                    want,
                    "step {step}"
                );
                assert_eq!(d.kernels().take_reads(), (2, 6 + vocab), "step {step}");
            }
            assert_eq!(greedy.last_run(), Some(DeviceRun::AsItCame));
            runs.push(graphs.last_run());
            assert!(matches!(want[0], DecodeOut::Argmax(_)));
        }
        // The same three sequences step after step: the later steps run as a graph would.
        assert!(runs.contains(&Some(DeviceRun::LaunchPass)), "{runs:?}");
    }

    /// Turning graphs on asks for the shared slot's bytes (one slot's arenas) and is refused
    /// with the room's words when they do not fit.
    #[test]
    fn graphs_ask_room_for_their_shared_slot() {
        let (_dir, model) = tiny(6);
        let open = || {
            let kernels = EmulatedKernels::new(&model.config);
            StepDecoder::new("emulated", kernels, &model, (3, 64), |_, _| Ok(())).unwrap()
        };
        let one_slot = arena_bytes(&model.config, 1, 64, model.kv_rows());
        let refused = open()
            .with_graphs(|_, bytes| Err(crate::step::ShapeError(format!("{bytes} bytes"))))
            .unwrap_err();
        assert_eq!(refused.to_string(), format!("{one_slot} bytes"));
        let asked = std::cell::Cell::new(0);
        let d = open()
            .with_graphs(|_, bytes| {
                asked.set(bytes);
                Ok(())
            })
            .unwrap();
        assert_eq!((asked.get(), d.slots()), (one_slot, 3));
    }

    /// The arenas' bytes: the window ring of every layer, the compressors' rows at their
    /// ratios, per slot; FP8 K=V rows take their stored bytes.
    #[test]
    fn arena_bytes_count_every_slot() {
        let c = Preset::Tiny.config(ExpertFormat::Nvfp4);
        let f32_rows = RowFormat::F32;
        let one = arena_bytes(&c, 1, 256, f32_rows);
        assert_eq!(arena_bytes(&c, 5, 256, f32_rows), 5 * one);
        assert!(
            arena_bytes(&c, 1, 512, f32_rows) > one,
            "compressed rows grow with length"
        );
        assert!(one >= 4 * c.layers.len() * c.sliding_window * c.head_dim);
        let fp8 = RowFormat::for_kv(&c, KvStorage::Fp8);
        let small = arena_bytes(&c, 1, 256, fp8);
        assert!(small < one, "{small} FP8 bytes, {one} f32");
        assert!(small >= c.layers.len() * c.sliding_window * fp8.row_bytes(c.head_dim));
    }
}
