//! The serving loop of one worker: requests wait in a FIFO queue, are admitted when their
//! pages fit, and every `step` runs one batched forward pass mixing decode tokens (first, for
//! latency) with prefill chunks (packed into the remaining token budget, cut at page
//! boundaries so completed blocks enter the prefix cache). Pages for the prompt plus
//! `max_tokens` are reserved at admission, so a running request can never run out of pages
//! mid-flight. Because the forward pass is batch-invariant and each request samples from its
//! own seeded stream, a request's tokens do not depend on what else is running.

use std::collections::VecDeque;

mod device;
mod device_prompt;
mod events;
mod handoff;
mod host_step;

pub use device::{
    DecodeOut, DecodeSeat, DeviceError, DeviceRun, HostStepDevice, PromptChunk, PromptOut,
    StepDevice,
};
use events::StepError;
pub use events::{EngineError, Event};
pub use handoff::{HandoffError, PromptState, Reservation, StateWrite};

use crate::{
    grammar::TokenTableSource,
    model::Model,
    paged::{
        layout::{KvStorage, StateLayout},
        store::{PagedSeq, PagedStore},
    },
    sampling::{Sampled, Sampler, SamplingError, SamplingParams, StopConditions},
};

/// Sizes and budgets of the engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub page_size: usize,
    pub num_pages: u32,
    /// Requests decoding or prefilling at once (also the number of state slots).
    pub max_running: usize,
    /// Tokens per forward step (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    pub kv: KvStorage,
    pub prefix_cache: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 64,
            num_pages: 1024,
            max_running: 32,
            max_batch_tokens: 512,
            kv: KvStorage::F32,
            prefix_cache: true,
        }
    }
}

/// A request to generate.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopConditions,
}

/// Token accounting of a finished request (defined with the request vocabulary in `proto`).
pub use proto::request::Usage;

#[derive(Debug)]
struct Running {
    id: u64,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    cached: usize,
    seq: PagedSeq,
    sampler: Sampler,
    /// Prefill only: export the state after the first token instead of decoding.
    handoff: bool,
    /// Alternatives per prompt token when the prompt's log-probabilities were asked for.
    prompt_logprobs: Option<usize>,
    /// Those log-probabilities so far (one per prompt token after the first).
    prompt_entries: Vec<Sampled>,
    /// Its slot on the decode device once it decodes there (its state then lives there, and
    /// its pages hold only the prompt's).
    slot: Option<usize>,
}

/// Most positions of a prompt-logprobs request computed in one step: each needs a full logits
/// row (129,280 floats for V4), so its chunks are capped to bound that memory.
const PROMPT_LOGPROB_CHUNK: usize = 256;

/// One worker's engine.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    store: PagedStore,
    config: EngineConfig,
    /// (request, sampler, prefill only)
    waiting: VecDeque<(GenerationRequest, Sampler, bool)>,
    running: Vec<Running>,
    /// Pages reserved for prompt state another worker writes ([`Engine::reserve`]).
    reserved: Vec<(u64, PagedSeq)>,
    /// The token table output constraints compile against.
    token_table: TokenTableSource,
    /// Told about every step (worker metrics).
    observer: Option<StepObserver>,
    /// Where decode tokens step when they do not step here ([`Engine::set_step_device`]).
    device: Option<device::OnDevice>,
    /// How the device ran the last device step, and the tokens it sent back as argmaxes.
    last_device: (Option<DeviceRun>, usize),
    /// Requests arrive only with their prompts' state ([`Engine::commit`]): no prompt computes
    /// here ([`Engine::set_decode_only`]).
    decode_only: bool,
}

/// What one forward step did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepRecord {
    /// Wall time of the step (admission, forward pass, sampling).
    pub seconds: f64,
    /// Requests in the step's batch.
    pub requests: usize,
    /// Prompt tokens computed (prefill chunks).
    pub prompt_tokens: usize,
    /// Tokens decoded (one per decoding request).
    pub decode_tokens: usize,
    /// Requests admitted at the step's start, and their prompt tokens taken from the prefix
    /// cache (not computed).
    pub admitted: usize,
    pub cached_tokens: usize,
    /// How the decode device ran its part of the step, if it has one and stepped.
    pub device_run: Option<DeviceRun>,
    /// Whether the device stepped prompt chunks in this step.
    pub device_prompts: bool,
    /// Tokens the decode device sent back as their argmax rather than their logits.
    pub argmax_tokens: usize,
}

/// Receives a [`StepRecord`] after each step, on the engine's thread.
pub struct StepObserver(pub Box<dyn FnMut(&StepRecord) + Send>);

impl std::fmt::Debug for StepObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepObserver")
    }
}

impl Engine {
    pub fn new(
        mut model: Model,
        config: EngineConfig,
        fingerprint: &str,
    ) -> Result<Self, EngineError> {
        model.set_kv_storage(config.kv);
        let layout = StateLayout::new(&model.config, config.page_size, config.kv, fingerprint)?;
        let mut store = PagedStore::new(
            &model.config,
            layout,
            config.num_pages,
            config.max_running as u32,
        );
        // Cannot fail: the cache starts empty.
        let _ = store.set_prefix_cache(config.prefix_cache);
        Ok(Self {
            model,
            store,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: Vec::new(),
            token_table: TokenTableSource::none(),
            observer: None,
            device: None,
            last_device: (None, 0),
            decode_only: false,
        })
    }

    /// Tells `observer` what every later step did.
    pub fn set_step_observer(&mut self, observer: StepObserver) {
        self.observer = Some(observer);
    }

    /// Where output constraints get their token table (without one they are refused). The
    /// table is built now, on a thread of its own, so that no request waits for it on the
    /// engine's thread.
    pub fn set_token_table(&mut self, source: TokenTableSource) {
        source.build_in_background();
        self.token_table = source;
    }

    /// A sampler for `req`, with its output constraint compiled when it has one.
    pub(crate) fn sampler(
        &self,
        sampling: SamplingParams,
        stop: StopConditions,
        prompt: &[u32],
        seed: u64,
    ) -> Result<Sampler, EngineError> {
        let constraint = match &sampling.constraint {
            Some(c) => Some(self.token_table.get()?.compile(c)?),
            None => None,
        };
        let sampler = Sampler::new(sampling, stop, prompt, self.model.config.vocab_size, seed)?;
        Ok(match constraint {
            Some(c) => sampler.constrained(c),
            None => sampler,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Gives the model back (the engine's state is dropped).
    pub fn into_model(self) -> Model {
        self.model
    }

    pub fn store(&self) -> &PagedStore {
        &self.store
    }

    /// Requests running and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Queues a request after validating it completely (parameters, token ids, size).
    pub fn add(&mut self, req: GenerationRequest) -> Result<(), EngineError> {
        self.enqueue(req, false)
    }

    /// Takes requests only with their prompts' state from now on ([`Engine::commit`]; a decode
    /// worker's engine): a request whose prompt would compute here is refused. As a rank of an
    /// expert-parallel group stepping on a device it then joins no host forward, which it can
    /// never have (every rank of the group is told the same before it steps).
    pub fn set_decode_only(&mut self) {
        self.decode_only = true;
    }

    fn enqueue(&mut self, req: GenerationRequest, handoff: bool) -> Result<(), EngineError> {
        if self.decode_only {
            return Err(EngineError::DecodeOnly);
        }
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let known = self.running.iter().any(|r| r.id == req.id)
            || self.waiting.iter().any(|(w, ..)| w.id == req.id)
            || self.reserved.iter().any(|(id, _)| *id == req.id);
        if known {
            return Err(EngineError::DuplicateId(req.id));
        }
        let tokens = req.prompt.len() + req.stop.max_tokens as usize;
        let limit = self.model.config.max_position_embeddings;
        if tokens > limit {
            return Err(EngineError::TooLong { tokens, limit });
        }
        let needed = self.store.pages_for(tokens);
        if needed > self.store.pages().total() {
            return Err(EngineError::TooLarge {
                needed,
                tokens,
                total: self.store.pages().total(),
            });
        }
        let sampler = self.sampler(
            req.sampling.clone(),
            req.stop.clone(),
            &req.prompt,
            default_seed(req.id),
        )?;
        self.waiting.push_back((req, sampler, handoff));
        Ok(())
    }

    /// Ends every request (waiting, running, reserved) with [`Event::Failed`] saying `error`:
    /// the engine can no longer step (its rank lost its group). Their pages return.
    pub fn fail_all(&mut self, error: &str) -> Vec<Event> {
        let ids: Vec<u64> = self
            .waiting
            .iter()
            .map(|(r, ..)| r.id)
            .chain(self.running.iter().map(|r| r.id))
            .chain(self.reserved.iter().map(|(id, _)| *id))
            .collect();
        ids.into_iter()
            .map(|id| {
                let _ = self.cancel(id);
                Event::Failed {
                    id,
                    error: error.to_owned(),
                }
            })
            .collect()
    }

    /// Removes a request wherever it is; its pages return to the pool.
    pub fn cancel(&mut self, id: u64) -> Option<Event> {
        if let Some(i) = self.waiting.iter().position(|(w, ..)| w.id == id) {
            self.waiting.remove(i);
            return Some(Event::Cancelled { id });
        }
        if self.release_reservation(id) {
            return Some(Event::Cancelled { id });
        }
        let i = self.running.iter().position(|r| r.id == id)?;
        let r = self.running.swap_remove(i);
        self.free_slot(r.slot);
        Some(match self.store.release(r.seq) {
            Ok(()) => Event::Cancelled { id },
            Err(e) => Event::Failed {
                id,
                error: e.to_string(),
            },
        })
    }

    /// Admits waiting requests in order while their pages and a slot fit.
    /// Admits waiting requests while there is room; returns how many, and their cached
    /// prompt tokens.
    fn admit(&mut self) -> (usize, usize) {
        let (mut admitted, mut cached_tokens) = (0, 0);
        while self.running.len() < self.config.max_running {
            let Some((req, _, handoff)) = self.waiting.front() else {
                break;
            };
            // A prefill-only request never decodes here: its prompt is all it needs.
            let total = if *handoff {
                req.prompt.len()
            } else {
                req.prompt.len() + req.stop.max_tokens as usize
            };
            // Cached positions have no logits: a prompt whose log-probabilities are asked for
            // is computed whole.
            let opened = if req.sampling.prompt_logprobs.is_some() {
                self.store.open().map(|seq| (seq, 0))
            } else {
                self.store.open_prompt(&req.prompt)
            };
            let Ok((mut seq, cached)) = opened else {
                break;
            };
            if self.store.reserve(&mut seq, total).is_err() {
                // Not enough pages now: wait for running requests to finish (FIFO, no skip).
                let _ = self.store.release(seq);
                break;
            }
            let Some((req, sampler, handoff)) = self.waiting.pop_front() else {
                break;
            };
            admitted += 1;
            cached_tokens += cached;
            self.running.push(Running {
                prompt_logprobs: req.sampling.prompt_logprobs.map(|k| k as usize),
                prompt_entries: Vec::new(),
                id: req.id,
                prompt_len: req.prompt.len(),
                tokens: req.prompt,
                cached,
                seq,
                sampler,
                handoff,
                slot: None,
            });
        }
        (admitted, cached_tokens)
    }

    /// Runs one forward step and returns what it produced.
    pub fn step(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        self.step_with(&mut |e| events.push(e));
        events
    }

    /// Runs one forward step, passing what it produced to `emit`: state parts of prefill-only
    /// requests as soon as they are final (during the forward pass), the rest at the end.
    /// Returns the number of events emitted.
    pub fn step_with(&mut self, emit: &mut (dyn FnMut(Event) + Send)) -> usize {
        let started = std::time::Instant::now();
        let (admitted, cached_tokens) = self.admit();
        let plan = self.plan_step();
        // With a decode device, the decode tokens step there, and the prompt chunks too
        // where it steps prompts; the rest here.
        let prompts_on_device = self.device_prompt_chunk() > 0;
        let (on_device, plan): (Vec<_>, Vec<_>) = plan
            .into_iter()
            .partition(|(i, ..)| self.device.is_some() && self.is_decoding(*i));
        let (prompts, plan): (Vec<_>, Vec<_>) = plan.into_iter().partition(|_| prompts_on_device);
        // Under expert parallelism the other ranks' tokens need this rank's experts: it takes
        // part in every step, with no tokens of its own. On a device every rank runs the same
        // phases (its decode step, then its prompt step where it steps prompts, or the host
        // forward where it does not), each with an idle step where it has nothing to step.
        let group_on_device = self.group_on_device();
        if plan.is_empty() && on_device.is_empty() && prompts.is_empty() {
            if group_on_device {
                self.idle_device_step();
                if prompts_on_device {
                    self.idle_device_step();
                }
            }
            if !group_on_device || (!prompts_on_device && !self.decode_only) {
                self.idle_host_forward();
            }
            return 0;
        }
        let mut record = StepRecord {
            requests: plan.len() + on_device.len() + prompts.len(),
            admitted,
            cached_tokens,
            decode_tokens: on_device.len(),
            ..StepRecord::default()
        };
        for (i, range, _) in plan.iter().chain(&prompts) {
            if self.is_decoding(*i) {
                record.decode_tokens += range.len();
            } else {
                record.prompt_tokens += range.len();
            }
        }
        let mut events = Vec::new();
        let mut failed: Vec<(usize, StepError)> = Vec::new();
        let asked = self.device_steps();
        if !on_device.is_empty() {
            let seated: Vec<usize> = on_device.iter().map(|(i, ..)| *i).collect();
            self.last_device = (None, 0);
            self.device_step(&seated, &mut events, &mut failed);
            (record.device_run, record.argmax_tokens) = self.last_device;
        }
        if group_on_device && self.device_steps() == asked {
            self.idle_device_step();
        }
        let mut emitted = 0;
        let asked = self.device_steps();
        if !prompts.is_empty() {
            record.device_prompts = true;
            emitted += self.device_prompt_step(&prompts, emit, &mut events, &mut failed);
        }
        if group_on_device && prompts_on_device && self.device_steps() == asked {
            self.idle_device_step();
        }
        if !plan.is_empty() {
            emitted += self.host_step(&plan, emit, &mut events, &mut failed);
        } else if group_on_device && !prompts_on_device && !self.decode_only {
            self.idle_host_forward();
        }
        failed.sort_by_key(|(i, _)| *i);
        failed.dedup_by_key(|(i, _)| *i);
        self.retire(&mut events, failed);
        emitted += events.len();
        for event in events {
            emit(event);
        }
        if let Some(observer) = self.observer.as_mut() {
            record.seconds = started.elapsed().as_secs_f64();
            (observer.0)(&record);
        }
        emitted
    }

    /// The host forward's part in a step of an expert-parallel group without tokens of its own.
    fn idle_host_forward(&self) {
        if let Err(e) = self.model.idle_forward() {
            tracing::error!(error = %e, "idle step of an expert-parallel rank failed");
        }
    }

    /// Whether running request `i` has computed its prompt (its next token is a decode token).
    fn is_decoding(&self, i: usize) -> bool {
        self.running[i].seq.len >= self.running[i].prompt_len
    }

    /// Of the logits `rows` of request `i`'s chunk `range`: records the prompt tokens'
    /// log-probabilities when they were asked for, and returns the row to sample the next
    /// token from (the last row of a chunk that ends the prompt, or of a decode step).
    fn take_prompt_logprobs(
        &mut self,
        i: usize,
        range: &std::ops::Range<usize>,
        rows: &mut Vec<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>, StepError> {
        let r = &mut self.running[i];
        let Some(top) = r.prompt_logprobs.filter(|_| range.start < r.prompt_len) else {
            return Ok(rows.pop());
        };
        // Row j is computed at position start + j and predicts the token after it.
        for (j, row) in rows.iter().enumerate() {
            let next = range.start + j + 1;
            if next < r.prompt_len {
                r.prompt_entries
                    .push(crate::sampling::prompt_logprob(row, r.tokens[next], top)?);
            }
        }
        Ok(if range.end == r.prompt_len {
            rows.pop()
        } else {
            None
        })
    }

    /// Samples the next token of every request of `ready` (running index, logits) that
    /// produced logits; `None` for the others, in `ready`'s order. Requests are sampled side by
    /// side when there are several: a grammar's mask (llguidance) and the passes over a
    /// vocabulary-wide row are each request's own work, and each sampler has its own random
    /// stream, so the order changes nothing.
    #[expect(
        clippy::type_complexity,
        reason = "one result per request, in the order given"
    )]
    fn sample_all(
        &mut self,
        ready: &[(usize, Option<&[f32]>)],
    ) -> Vec<Option<Result<Sampled, SamplingError>>> {
        use rayon::prelude::*;
        let mut rows: Vec<Option<&[f32]>> = vec![None; self.running.len()];
        for (i, logits) in ready {
            rows[*i] = *logits;
        }
        let mut out: Vec<Option<Result<Sampled, SamplingError>>> =
            (0..self.running.len()).map(|_| None).collect();
        let sample = |((r, row), slot): (
            (&mut Running, Option<&[f32]>),
            &mut Option<Result<Sampled, SamplingError>>,
        )| {
            if let Some(row) = row {
                *slot = Some(r.sampler.sample(row));
            }
        };
        if rows.iter().filter(|r| r.is_some()).count() > 1 {
            self.running
                .par_iter_mut()
                .zip(rows.par_iter().copied())
                .zip(out.par_iter_mut())
                .for_each(sample);
        } else {
            self.running
                .iter_mut()
                .zip(rows.iter().copied())
                .zip(out.iter_mut())
                .for_each(sample);
        }
        ready.iter().map(|(i, _)| out[*i].take()).collect()
    }

    /// Stores request `i`'s new state in its pages and offers its completed blocks to the
    /// prefix cache.
    fn store_state(
        &mut self,
        i: usize,
        state: &crate::model::SequenceState,
    ) -> Result<(), StepError> {
        let r = &mut self.running[i];
        self.store.scatter(&mut r.seq, state)?;
        self.store.offer_inner_blocks(&r.seq, state, &r.tokens)?;
        self.store.offer_block(&r.seq, &r.tokens)?;
        Ok(())
    }

    /// Takes request `i`'s sampled token (when it produced logits) and marks it done.
    fn take_sampled(
        &mut self,
        i: usize,
        sampled: Option<Result<Sampled, SamplingError>>,
        events: &mut Vec<Event>,
    ) -> Result<(), StepError> {
        let r = &mut self.running[i];
        let Some(sampled) = sampled else {
            return Ok(());
        };
        let sampled = sampled?;
        r.tokens.push(sampled.token);
        let index = r.tokens.len() - r.prompt_len - 1;
        if index == 0 && r.prompt_logprobs.is_some() {
            events.push(Event::PromptLogprobs {
                id: r.id,
                entries: std::mem::take(&mut r.prompt_entries),
            });
        }
        events.push(Event::Token {
            id: r.id,
            index,
            sampled,
        });
        if r.handoff {
            let event = handoff::export(&self.store, r)?;
            events.push(event);
            return Ok(());
        }
        if let Some(reason) = r.sampler.finish() {
            events.push(Event::Finished {
                id: r.id,
                reason,
                usage: Usage {
                    prompt_tokens: r.prompt_len,
                    cached_tokens: r.cached,
                    completion_tokens: index + 1,
                },
            });
        }
        Ok(())
    }

    /// Releases finished and failed requests.
    fn retire(&mut self, events: &mut Vec<Event>, failed: Vec<(usize, StepError)>) {
        let finished: Vec<u64> = events
            .iter()
            .filter_map(|e| match e {
                Event::Finished { id, .. } | Event::Prefilled { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        let failed_ids: Vec<(u64, String)> = failed
            .into_iter()
            .map(|(i, e)| (self.running[i].id, e.to_string()))
            .collect();
        let mut keep = Vec::with_capacity(self.running.len());
        for r in std::mem::take(&mut self.running) {
            let failure = failed_ids.iter().find(|(id, _)| *id == r.id);
            if failure.is_none() && !finished.contains(&r.id) {
                keep.push(r);
                continue;
            }
            let id = r.id;
            self.free_slot(r.slot);
            let released = self.store.release(r.seq);
            if let Some((_, error)) = failure {
                events.push(Event::Failed {
                    id,
                    error: error.clone(),
                });
            } else if let Err(e) = released {
                events.push(Event::Failed {
                    id,
                    error: e.to_string(),
                });
            }
        }
        self.running = keep;
    }

    /// Runs steps until every request has finished; returns all events (bounded by the work
    /// queued: each step makes progress on at least one request).
    pub fn run_to_completion(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        while !self.is_idle() {
            let step = self.step();
            if step.is_empty() && self.running.is_empty() {
                // Nothing admitted and nothing running: the head request can never fit.
                if let Some((req, ..)) = self.waiting.pop_front() {
                    events.push(Event::Failed {
                        id: req.id,
                        error: "request does not fit in the page pool".into(),
                    });
                }
            }
            events.extend(step);
        }
        events
    }
}

/// Seed for requests without one: derived from the id, so runs are reproducible.
fn default_seed(id: u64) -> u64 {
    id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed
}
