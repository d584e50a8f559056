//! Stepping on a device that keeps the sequences' state between steps. With a
//! [`StepDevice`] attached ([`Engine::set_step_device`]), a request's prompt is computed
//! here (unless the device steps prompts too, below); when it starts decoding (its prompt computed here, or its state written by a
//! prefill worker and committed), its state is read from its pages once and loaded into a slot
//! of the device, and from then on every decode token of it steps on the device: nothing of its
//! state crosses back, only the token in and the logits out, which are sampled here exactly as
//! the host forward's would be. Its pages stay reserved (they hold its prompt) and its decoded
//! blocks are not offered to the prefix cache (their rows live on the device only).
//!
//! A device that also steps prompt chunks (`StepDevice::prompt_chunk` not 0) seats a request
//! at its first chunk instead, and its prompt computes there too (`device_prompt`): what each
//! chunk added comes back and is stored in the pages, so they hold the prompt as they would
//! without the device.
//!
//! A device is checked against the engine's own forward pass: [`HostStepDevice`] is that
//! reference behind the same trait (states on the host, the engine's `forward_batch`), and a
//! device's engine must produce the same events as an engine without one.

use std::fmt;

use super::{Engine, EngineError, Event, StepError};
use crate::{
    model::{Logits, Model, SequenceState, Step, delta::StateDelta},
    paged::layout::RowFormat,
};

pub use crate::backend::DeviceError;

/// One sequence of a decode step: the sequence in slot `slot`, `len` tokens long, steps with
/// `token` (at position `len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeSeat {
    pub slot: usize,
    pub len: usize,
    pub token: u32,
}

/// A prompt chunk of a device's prompt step: `tokens` of the sequence in slot `slot`, the
/// first at position `start` (the sequence's length before the chunk), with the logits rows
/// `logits` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptChunk<'a> {
    pub slot: usize,
    pub start: usize,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

impl PromptChunk<'_> {
    /// Logits rows the chunk asks for.
    pub fn rows(&self) -> usize {
        match self.logits {
            Logits::None => 0,
            Logits::Last => usize::from(!self.tokens.is_empty()),
            Logits::All => self.tokens.len(),
        }
    }
}

/// What a prompt step gives back for a chunk: its logits rows (as its `logits` asked) and
/// what it added to the sequence's state, which the engine stores in the sequence's pages.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptOut {
    pub logits: Vec<Vec<f32>>,
    pub delta: StateDelta,
}

/// What a decode step gives back for a sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum DecodeOut {
    /// Its logits (`vocab_size` values), which the host samples.
    Logits(Vec<f32>),
    /// The id of its largest logit, ties to the lowest id (`sampling::argmax`), every logit
    /// finite: all a greedy request without log-probabilities needs.
    Argmax(u32),
    /// The first of its logits that is not finite.
    NonFinite(usize),
}

impl DecodeOut {
    /// A sequence's output from its logits row: the row, or (`argmax`) its argmax.
    pub fn of(row: Vec<f32>, argmax: bool) -> Self {
        if !argmax {
            return Self::Logits(row);
        }
        match crate::sampling::argmax(&row) {
            Ok(token) => Self::Argmax(token),
            Err(at) => Self::NonFinite(at),
        }
    }
}

/// How a device ran its last step (for the worker's metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRun {
    /// Its launches as they came.
    AsItCame,
    /// A graph recorded by an earlier step with the same launches.
    Replayed,
    /// Recorded as a graph, then replayed.
    Recorded,
    /// Its plans first, then its launches, as a graph would run them (where the device
    /// records none).
    LaunchPass,
    /// A recording that failed, then its launches as they came.
    FellBack,
}

impl DeviceRun {
    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            Self::AsItCame => "as_it_came",
            Self::Replayed => "replayed",
            Self::Recorded => "recorded",
            Self::LaunchPass => "launch_pass",
            Self::FellBack => "fell_back",
        }
    }
}

/// A device that holds sequences' state in slots and runs whole decode steps over them, and,
/// where its [`Self::prompt_chunk`] is not 0, steps of prompt chunks.
pub trait StepDevice: Send + fmt::Debug {
    /// What steps, for logs and errors ("cuda").
    fn name(&self) -> &str;

    /// Sequences it holds at once.
    fn slots(&self) -> usize;

    /// The longest a sequence's state may grow (tokens).
    fn max_tokens(&self) -> usize;

    /// The form it rounds K=V rows to as it computes them (`Model::kv_rows`): the engine's.
    fn kv_rows(&self) -> RowFormat;

    /// Puts `state` into slot `slot`, replacing what it held.
    fn load(&mut self, slot: usize, state: &SequenceState) -> Result<(), DeviceError>;

    /// One decode step over `seats`: each sequence's logits (`vocab_size` values), in order.
    /// After an error the seated sequences' states are lost.
    fn step(&mut self, seats: &[DecodeSeat]) -> Result<Vec<Vec<f32>>, DeviceError>;

    /// One decode step over `seats`, where `argmax[i]` says sequence i needs only the argmax
    /// of its logits (a greedy request without log-probabilities or anything else between
    /// its logits and its token): a device that can computes it there and sends back the id
    /// alone. This one steps and takes it here.
    fn step_outputs(
        &mut self,
        seats: &[DecodeSeat],
        argmax: &[bool],
    ) -> Result<Vec<DecodeOut>, DeviceError> {
        let rows = self.step(seats)?;
        Ok(rows
            .into_iter()
            .zip(argmax.iter().chain(std::iter::repeat(&false)))
            .map(|(row, &argmax)| DecodeOut::of(row, argmax))
            .collect())
    }

    /// The state of the `len`-token sequence in slot `slot`, in the engine's form.
    fn read(&mut self, slot: usize, len: usize) -> Result<SequenceState, DeviceError>;

    /// How its last step ran (where it has more than one way).
    fn last_run(&self) -> Option<DeviceRun> {
        None
    }

    /// The most consecutive prompt tokens of one sequence a [`Self::prompt_step`] takes; 0
    /// (this default) where it steps decode tokens only and prompts compute on the host.
    fn prompt_chunk(&self) -> usize {
        0
    }

    /// One step of prompt chunks, at most one per sequence and at most
    /// [`Self::prompt_chunk`] tokens each: every chunk's logits rows and state delta, in
    /// order. After an error the chunks' sequences' states are lost.
    fn prompt_step(&mut self, chunks: &[PromptChunk<'_>]) -> Result<Vec<PromptOut>, DeviceError> {
        Err(DeviceError::device(format!(
            "{} steps no prompts ({} chunks asked)",
            self.name(),
            chunks.len()
        )))
    }

    /// Whether its steps exchange the routed experts' pairs over the expert-parallel group of
    /// the model it was opened for (one rank of a group; false by default: it holds every
    /// expert).
    fn expert_parallel(&self) -> bool {
        false
    }

    /// Whether its steps compute a share of the attention heads and gather the output groups
    /// over the tensor-parallel group of the model it was opened for (false by default).
    fn tensor_parallel(&self) -> bool {
        false
    }

    /// Whether its steps compute a slice of every routed expert and gather the partial outputs
    /// over the expert-slice group of the model it was opened for (false by default).
    fn sliced_experts(&self) -> bool {
        false
    }

    /// A step with no sequences, for a rank of an expert-parallel group with nothing to
    /// step: it serves the other ranks' pairs of every layer's experts (their steps wait for
    /// it). Nothing to do by default.
    fn idle_step(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// An attached device and its free slots.
#[derive(Debug)]
pub(super) struct OnDevice {
    pub(super) device: Box<dyn StepDevice>,
    /// Free slots, the next one last.
    free: Vec<usize>,
    /// Steps asked of it (decode and prompt, failed ones too): a rank of an expert-parallel
    /// group that asked none in a phase of the engine's step takes part with an idle one.
    pub(super) steps: u64,
}

impl Engine {
    /// Steps every decode token on `device` from now on, and every prompt chunk where the
    /// device steps prompts ([`StepDevice::prompt_chunk`]; otherwise they compute here). Refused
    /// when the device cannot hold every request the engine runs at once, or the longest one,
    /// when it rounds K=V rows to another form than the engine stores them in, when its steps
    /// take part in other groups than the model's (tensor-parallel, expert-parallel,
    /// expert-sliced), or while requests run.
    pub fn set_step_device(&mut self, device: Box<dyn StepDevice>) -> Result<(), EngineError> {
        let refuse = |why: String| Err(EngineError::Device(format!("{}: {why}", device.name())));
        if device.kv_rows() != self.model.kv_rows() {
            return refuse(format!(
                "it rounds K=V rows to {:?} and this engine stores them as {:?} (kv_cache_dtype)",
                device.kv_rows(),
                self.model.kv_rows()
            ));
        }
        // The device's steps take part in exactly the model's groups.
        let m = &self.model;
        for (does, rank_of, device_does, model_is) in [
            (
                "compute a share of the heads",
                "a tensor-parallel group",
                device.tensor_parallel(),
                m.tensor_parallel().is_some(),
            ),
            (
                "exchange over an expert-parallel group",
                "an expert-parallel group",
                device.expert_parallel(),
                m.expert_parallel().is_some(),
            ),
            (
                "compute a slice of every expert",
                "an expert-sliced group (moe_tensor_parallel)",
                device.sliced_experts(),
                m.sliced_experts().is_some(),
            ),
        ] {
            if device_does != model_is {
                return refuse(format!(
                    "it does{} {does} and this engine's model is{} a rank of {rank_of}",
                    if device_does { "" } else { " not" },
                    if model_is { "" } else { " not" },
                ));
            }
        }
        if device.slots() < self.config.max_running {
            return refuse(format!(
                "{} slots for max_running {}",
                device.slots(),
                self.config.max_running
            ));
        }
        let longest = (self.config.num_pages as usize * self.config.page_size)
            .min(self.model.config.max_position_embeddings);
        if device.max_tokens() < longest {
            return refuse(format!(
                "slots of {} tokens, and a request may reach {longest}",
                device.max_tokens()
            ));
        }
        if !self.running.is_empty() {
            return refuse("requests are running".to_owned());
        }
        let free = (0..device.slots()).rev().collect();
        self.device = Some(OnDevice {
            device,
            free,
            steps: 0,
        });
        Ok(())
    }

    /// The most prompt tokens of a sequence the attached device steps at once (0: prompts
    /// compute on the host).
    pub(super) fn device_prompt_chunk(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.device.prompt_chunk())
    }

    /// Steps asked of the attached device so far (0 without one).
    pub(super) fn device_steps(&self) -> u64 {
        self.device.as_ref().map_or(0, |d| d.steps)
    }

    /// Whether this engine is a rank of an expert-parallel group stepping on a device: every
    /// phase of its steps exchanges with the other ranks, so it takes part in each.
    pub(super) fn group_on_device(&self) -> bool {
        self.device.is_some() && self.model.expert_parallel().is_some()
    }

    /// An idle device step (a rank of an expert-parallel group whose phase had nothing to
    /// step); a failure fails the group, whose ranks then fail their requests.
    pub(super) fn idle_device_step(&mut self) {
        let Some(d) = self.device.as_mut() else {
            return;
        };
        if let Err(e) = d.device.idle_step() {
            tracing::error!(error = %e, "idle device step of an expert-parallel rank failed");
            self.model.fail_groups(&format!("idle device step: {e}"));
        }
    }

    /// The attached step device's name, if one is attached.
    pub fn step_device(&self) -> Option<&str> {
        self.device.as_ref().map(|d| d.device.name())
    }

    /// The state of running request `id` as the device holds it, when it decodes there.
    pub fn device_state(&mut self, id: u64) -> Option<Result<SequenceState, DeviceError>> {
        let r = self.running.iter().find(|r| r.id == id)?;
        let (slot, len) = (r.slot?, r.seq.len);
        Some(self.device.as_mut()?.device.read(slot, len))
    }

    /// Returns a finished request's slot.
    pub(super) fn free_slot(&mut self, slot: Option<usize>) {
        if let (Some(slot), Some(d)) = (slot, self.device.as_mut()) {
            d.free.push(slot);
        }
    }

    /// Running request `i`'s slot on the device: the one it holds, or a free one its state
    /// (its pages': a prompt's cached prefix, or a prompt's whole state) is loaded into
    /// first, which it then keeps until it leaves.
    pub(super) fn seat(&mut self, i: usize) -> Result<usize, StepError> {
        let Some(d) = self.device.as_mut() else {
            return Err(StepError::Forward("no step device is attached".to_owned()));
        };
        let r = &mut self.running[i];
        if let Some(slot) = r.slot {
            return Ok(slot);
        }
        let Some(slot) = d.free.pop() else {
            return Err(StepError::Forward("no free decode slot".to_owned()));
        };
        let loaded = self
            .store
            .gather(&r.seq)
            .map_err(StepError::from)
            .and_then(|state| {
                d.device.load(slot, &state).map_err(|e| {
                    StepError::Forward(format!("{}: loading a state: {e}", d.device.name()))
                })
            });
        match loaded {
            Ok(()) => {
                r.slot = Some(slot);
                Ok(slot)
            }
            Err(e) => {
                d.free.push(slot);
                Err(e)
            }
        }
    }

    /// One decode token of each running request of `seated` on the device: those not there yet
    /// are loaded first (their state read from their pages), the logits come back and are
    /// sampled here. A failed load fails its request; a failed step fails every request of it.
    pub(super) fn device_step(
        &mut self,
        seated: &[usize],
        events: &mut Vec<Event>,
        failed: &mut Vec<(usize, StepError)>,
    ) {
        let mut seats = Vec::with_capacity(seated.len());
        let mut stepping = Vec::with_capacity(seated.len());
        for &i in seated {
            let slot = match self.seat(i) {
                Ok(slot) => slot,
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            let r = &self.running[i];
            let Some(&token) = r.tokens.get(r.seq.len) else {
                failed.push((i, StepError::Forward("no token to decode".to_owned())));
                continue;
            };
            seats.push(DecodeSeat {
                slot,
                len: r.seq.len,
                token,
            });
            stepping.push(i);
        }
        let Some(d) = self.device.as_mut() else {
            return;
        };
        if stepping.is_empty() {
            return;
        }
        let vocab = self.model.config.vocab_size;
        let name = d.device.name().to_owned();
        let argmax: Vec<bool> = stepping
            .iter()
            .map(|&i| self.running[i].sampler.takes_argmax())
            .collect();
        let fits = |out: &DecodeOut| match out {
            DecodeOut::Logits(row) => row.len() == vocab,
            DecodeOut::Argmax(token) => (*token as usize) < vocab,
            DecodeOut::NonFinite(at) => *at < vocab,
        };
        d.steps += 1;
        let outputs = match d.device.step_outputs(&seats, &argmax) {
            Ok(outs) if outs.len() == seats.len() && outs.iter().all(fits) => outs,
            Ok(outs) => {
                let e = StepError::Forward(format!(
                    "{name} decode step: {} outputs for {} sequences, not all within a \
                     vocabulary of {vocab}",
                    outs.len(),
                    seats.len()
                ));
                failed.extend(stepping.iter().map(|&i| (i, e.clone())));
                return;
            }
            Err(e) => {
                let e = StepError::Forward(format!("{name} decode step: {e}"));
                // The group's other ranks may wait for this one's exchanges: they stop now.
                self.model.fail_groups(&e.to_string());
                failed.extend(stepping.iter().map(|&i| (i, e.clone())));
                return;
            }
        };
        // A device's result is checked where it enters, as a backend's op is: a non-finite
        // logit fails its request (the sampler would mask it and answer anyway).
        let non_finite =
            |at: usize| StepError::Forward(format!("{name} decode step: non-finite logit at {at}"));
        let mut rows: Vec<(usize, Option<&[f32]>)> = Vec::with_capacity(stepping.len());
        let mut argmaxes = Vec::new();
        for (&i, out) in stepping.iter().zip(&outputs) {
            match out {
                DecodeOut::Logits(row) => match row.iter().position(|v| !v.is_finite()) {
                    None => rows.push((i, Some(row.as_slice()))),
                    Some(at) => failed.push((i, non_finite(at))),
                },
                DecodeOut::Argmax(token) => argmaxes.push((i, *token)),
                DecodeOut::NonFinite(at) => failed.push((i, non_finite(*at))),
            }
        }
        self.last_device = (d.device.last_run(), argmaxes.len());
        let mut sampled: Vec<_> = rows
            .iter()
            .map(|&(i, _)| i)
            .zip(self.sample_all(&rows))
            .collect();
        for (i, token) in argmaxes {
            sampled.push((i, Some(self.running[i].sampler.take_argmax(token))));
        }
        // In the order the requests stepped, as without a device.
        sampled.sort_by_key(|&(i, _)| stepping.iter().position(|&s| s == i));
        for (i, sampled) in sampled {
            // Its rows are on the device: the pages reserved for them stay unwritten.
            self.running[i].seq.len += 1;
            if let Err(e) = self.take_sampled(i, sampled, events) {
                failed.push((i, e));
            }
        }
    }
}

/// The reference step device: each slot's state on the host, each step the engine's own
/// forward pass (`Model::forward_batch`). What a device is checked against, and a device for
/// tests of the engine's side of the seam.
#[derive(Debug)]
pub struct HostStepDevice {
    model: Model,
    states: Vec<Option<SequenceState>>,
    max_tokens: usize,
    /// Prompt tokens of a sequence a step takes (0: none).
    prompt_chunk: usize,
}

impl HostStepDevice {
    /// `slots` sequences of at most `max_tokens` tokens, stepped by `model`.
    pub fn new(model: Model, slots: usize, max_tokens: usize) -> Self {
        Self {
            model,
            states: vec![None; slots],
            max_tokens,
            prompt_chunk: 0,
        }
    }

    /// The same that also steps prompt chunks of up to `chunk` tokens (the engine's forward
    /// over a slot's state; the delta taken from the state after it).
    #[must_use]
    pub fn with_prompts(mut self, chunk: usize) -> Self {
        self.prompt_chunk = chunk;
        self
    }

    /// Takes the states of the `(slot, len)` sequences out of their slots (put back by
    /// [`Self::put_back`]), refusing a slot that holds no sequence of that length.
    fn take(&mut self, seats: &[(usize, usize)]) -> Result<Vec<SequenceState>, DeviceError> {
        let mut taken = Vec::with_capacity(seats.len());
        for &(slot, len) in seats {
            // A state of another length stays where it is.
            let state = self
                .states
                .get_mut(slot)
                .filter(|s| s.as_ref().is_some_and(|s| s.len == len))
                .and_then(Option::take);
            let Some(state) = state else {
                self.put_back(seats, taken);
                return Err(DeviceError::device(format!(
                    "slot {slot} holds no sequence of {len} tokens"
                )));
            };
            taken.push(state);
        }
        Ok(taken)
    }

    fn put_back(&mut self, seats: &[(usize, usize)], states: Vec<SequenceState>) {
        for (state, &(slot, _)) in states.into_iter().zip(seats) {
            self.states[slot] = Some(state);
        }
    }
}

impl StepDevice for HostStepDevice {
    fn name(&self) -> &'static str {
        "host reference"
    }

    fn slots(&self) -> usize {
        self.states.len()
    }

    fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    fn kv_rows(&self) -> RowFormat {
        self.model.kv_rows()
    }

    fn load(&mut self, slot: usize, state: &SequenceState) -> Result<(), DeviceError> {
        let held = self
            .states
            .get_mut(slot)
            .ok_or_else(|| DeviceError::device(format!("no slot {slot}")))?;
        *held = Some(state.clone());
        Ok(())
    }

    fn step(&mut self, seats: &[DecodeSeat]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let at: Vec<(usize, usize)> = seats.iter().map(|s| (s.slot, s.len)).collect();
        let mut taken = self.take(&at)?;
        let out = {
            let mut batch: Vec<Step<'_>> = taken
                .iter_mut()
                .zip(seats)
                .map(|(state, seat)| Step {
                    state,
                    tokens: std::slice::from_ref(&seat.token),
                    logits: Logits::Last,
                })
                .collect();
            self.model.forward_batch(&mut batch)
        };
        let out = out.map_err(DeviceError::device)?;
        self.put_back(&at, taken);
        Ok(out
            .into_iter()
            .map(|mut rows| rows.pop().unwrap_or_default())
            .collect())
    }

    fn prompt_chunk(&self) -> usize {
        self.prompt_chunk
    }

    fn prompt_step(&mut self, chunks: &[PromptChunk<'_>]) -> Result<Vec<PromptOut>, DeviceError> {
        if let Some(c) = chunks.iter().find(|c| c.tokens.len() > self.prompt_chunk) {
            return Err(DeviceError::device(format!(
                "a chunk of {} tokens, at most {}",
                c.tokens.len(),
                self.prompt_chunk
            )));
        }
        let at: Vec<(usize, usize)> = chunks.iter().map(|c| (c.slot, c.start)).collect();
        let mut taken = self.take(&at)?;
        let out = {
            let mut batch: Vec<Step<'_>> = taken
                .iter_mut()
                .zip(chunks)
                .map(|(state, c)| Step {
                    state,
                    tokens: c.tokens,
                    logits: c.logits,
                })
                .collect();
            self.model.forward_batch(&mut batch)
        };
        let out = out.map_err(DeviceError::device)?;
        let mut outs = Vec::with_capacity(chunks.len());
        for ((state, c), logits) in taken.iter().zip(chunks).zip(out) {
            let delta =
                StateDelta::of(state, c.start, &self.model.config).map_err(DeviceError::device)?;
            outs.push(PromptOut { logits, delta });
        }
        self.put_back(&at, taken);
        Ok(outs)
    }

    fn read(&mut self, slot: usize, len: usize) -> Result<SequenceState, DeviceError> {
        self.states
            .get(slot)
            .and_then(Option::as_ref)
            .filter(|s| s.len == len)
            .map(|s| s.normalized(&self.model.config))
            .ok_or_else(|| DeviceError::device(format!("slot {slot} holds no {len}-token state")))
    }
}
