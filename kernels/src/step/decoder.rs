//! [`StepDecoder`]: the device decode step as the engine's [`StepDevice`], so a worker's
//! scheduler steps its decode tokens on the device: the weights uploaded once, the sequences'
//! state in the arenas of a [`StateLayout`] (a slot per running request), each step's tokens
//! in and logits out. Over [`super::emulated::EmulatedKernels`] it is what CI checks the
//! scheduler's use of a device with; over `cuda::CudaKernels` it is a GPU decode worker.

use engine::{
    config::ModelConfig,
    model::{Model, SequenceState},
    paged::layout::RowFormat,
    scheduler::{
        DecodeOut, DecodeSeat, DeviceError, DeviceRun, PromptChunk, PromptOut, StepDevice,
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

    /// Runs the routed experts with the grouped GEMM from now on
    /// (`DeviceStepOps::with_gemm_experts`: within its bound, not the engine's bits; for
    /// prompt chunks).
    #[must_use]
    pub fn with_gemm_experts(mut self) -> Self {
        self.ops = self.ops.with_gemm_experts();
        self.name = format!("{}, GEMM experts", self.name);
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
        let ops = &self.ops;
        if ops.expert_parallel().is_some() && ops.tensor_parallel().is_none() {
            return Err(
                "graphs replay steps without host work; a rank of an expert-parallel group \
                 with requests of its own (dp attention) reads back its dispatch messages' \
                 counts at every MoE layer (their sizes follow the routing)"
                    .to_owned()
                    .into(),
            );
        }
        let group = ops.tensor_parallel().is_some() || ops.sliced_experts().is_some();
        if group && let Err(why) = ops.kernels().graphs_hold_collectives() {
            return Err(format!("graphs over a group: {why}").into());
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
    /// ([`StepDevice::prompt_step`], [`super::decode::prompt_step`]: the exact kernels, the
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

impl<K: Kernels> StepDevice for StepDecoder<K>
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

    fn expert_parallel(&self) -> bool {
        self.ops.expert_parallel().is_some()
    }

    fn tensor_parallel(&self) -> bool {
        self.ops.tensor_parallel().is_some()
    }

    fn sliced_experts(&self) -> bool {
        self.ops.sliced_experts().is_some()
    }

    fn idle_step(&mut self) -> Result<(), DeviceError> {
        self.ops.idle_exchange().map_err(DeviceError::device)
    }

    /// The chunks' tokens as one step (each token a seat of its sequence's slot at its
    /// position), the output head over the rows their logits ask for only; then every chunk's
    /// delta read back from its slot in one read (two reads a step: logits, deltas).
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
        // Every chunk's delta in one read.
        let spans: Vec<(usize, (usize, usize))> = chunks
            .iter()
            .map(|c| (c.slot, (c.start, c.start + c.tokens.len())))
            .collect();
        let deltas = self
            .layout
            .read_deltas(&self.ops, &self.arenas, &spans)
            .map_err(DeviceError::device)?;
        let mut rows = rows.into_iter();
        Ok(chunks
            .iter()
            .zip(deltas)
            .map(|(c, delta)| PromptOut {
                logits: rows.by_ref().take(c.rows()).collect(),
                delta,
            })
            .collect())
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
mod tests;
