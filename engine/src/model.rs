//! The DeepSeek-V4 forward pass on the CPU in f32: the oracle every fast path is checked
//! against. A sequence is fed in chunks of any size (a whole prompt, then one token at a time);
//! each token's result depends only on the tokens before it, never on the chunking.

pub mod attention;
pub mod compressor;
pub mod delta;
pub mod expert;
pub mod hyper;
pub mod moe;

use std::path::Path;

use attention::AttentionState;
use rayon::prelude::*;

use crate::{
    backend::{Attached, Backend, BackendError, BackendPlan, LayerDevice, Op},
    config::ModelConfig,
    rope::Rope,
    tensor::rms_norm,
    weights::{self, LoadError, ModelWeights},
};

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    main_rope: Rope,
    compress_rope: Rope,
    /// The compute backend for the ops it runs; `None`: everything on the CPU reference.
    backend: Option<Attached>,
    /// This rank's share of the routed experts when they are spread over ranks.
    expert_parallel: Option<std::sync::Arc<crate::parallel::expert::ExpertParallel>>,
    /// This rank's share of the attention heads under tensor parallelism.
    tensor_parallel: Option<std::sync::Arc<crate::parallel::tensor::TensorParallel>>,
    /// This rank's slice of every routed expert (expert tensor parallelism).
    sliced_experts: Option<std::sync::Arc<crate::parallel::sliced::SlicedExperts>>,
    /// How K=V rows are stored: each is rounded to it as it is computed ([`Self::set_kv_storage`]).
    kv_rows: crate::paged::layout::RowFormat,
}

/// Everything a sequence carries from one forward call to the next.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceState {
    /// Tokens processed so far (the next token's position).
    pub len: usize,
    pub layers: Vec<AttentionState>,
}

impl SequenceState {
    /// The same state with windows trimmed to what the next step can attend to (for comparing
    /// states reached through different chunkings).
    #[must_use]
    pub fn normalized(&self, config: &ModelConfig) -> Self {
        let mut out = self.clone();
        let keep = (config.sliding_window - 1) * config.head_dim;
        for layer in &mut out.layers {
            let drop = layer.window.len().saturating_sub(keep);
            layer.window.drain(..drop);
            layer.boundary_every = 0;
            layer.boundaries.clear();
        }
        out
    }
}

/// Which positions of a chunk need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// Bad input to a forward call.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ForwardError {
    #[error("token id {token} at chunk index {index} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    /// The compute backend failed; the step produced nothing.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl Model {
    /// Loads `config.json` and the weights from a checkpoint folder.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        let weights = weights::load(dir, &config)?;
        Ok(Self::new(config, weights))
    }

    /// [`Self::load`], reporting how far the weights check is in `progress`.
    pub fn load_with_progress(
        dir: &Path,
        progress: &std::sync::Arc<weights::LoadProgress>,
    ) -> Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        let weights = weights::load_with_progress(dir, &config, progress)?;
        Ok(Self::new(config, weights))
    }

    pub fn new(config: ModelConfig, weights: ModelWeights) -> Self {
        let (main_rope, compress_rope) = Rope::tables(&config);
        Self {
            config,
            weights,
            main_rope,
            compress_rope,
            backend: None,
            expert_parallel: None,
            tensor_parallel: None,
            sliced_experts: None,
            kv_rows: crate::paged::layout::RowFormat::F32,
        }
    }

    /// Another copy of this model for another rank: the same weights (borrowed from the same
    /// mapping; small owned tensors copied) and K=V row storage, no backend and no expert
    /// parallelism attached.
    #[must_use]
    pub fn replica(&self) -> Self {
        let mut copy = Self::new(self.config.clone(), self.weights.clone());
        copy.kv_rows = self.kv_rows;
        copy
    }

    /// Stores K=V rows as `kv` says: from now on each window, CSA and HCA row is rounded to its
    /// stored form as it is computed, before any attention reads it, so what a token computes
    /// does not depend on how its prompt was cut into chunks (nor, through the chunk budget,
    /// on the other requests of a batch). F32 (the default) leaves rows as computed.
    pub fn set_kv_storage(&mut self, kv: crate::paged::layout::KvStorage) {
        self.kv_rows = crate::paged::layout::RowFormat::for_kv(&self.config, kv);
    }

    /// The stored form K=V rows are rounded to.
    pub fn kv_rows(&self) -> crate::paged::layout::RowFormat {
        self.kv_rows
    }

    /// Hands the ops `backend` runs to it. Ops it does not run stay on the CPU reference, which
    /// is refused unless `hybrid`; the returned plan says where each op runs (log it).
    pub fn attach_backend(
        &mut self,
        backend: std::sync::Arc<dyn Backend>,
        hybrid: bool,
    ) -> Result<BackendPlan, BackendError> {
        let plan = BackendPlan::decide(backend.as_ref(), hybrid)?;
        self.backend = Some(Attached {
            backend,
            plan: plan.clone(),
        });
        Ok(plan)
    }

    /// Spreads the routed experts over the ranks of `ep`'s group: every MoE layer's
    /// (token, expert) products are computed by the rank that holds the expert. Every rank must
    /// then run every step together ([`Self::idle_forward`] when it has no tokens).
    pub fn set_expert_parallel(
        &mut self,
        ep: std::sync::Arc<crate::parallel::expert::ExpertParallel>,
    ) {
        self.expert_parallel = Some(ep);
    }

    /// Computes only `tp`'s share of every layer's attention heads, gathering the groups'
    /// outputs from the other ranks of its group (which must run the same steps).
    pub fn set_tensor_parallel(
        &mut self,
        tp: std::sync::Arc<crate::parallel::tensor::TensorParallel>,
    ) {
        self.tensor_parallel = Some(tp);
    }

    /// Slices every routed expert over the ranks of `sliced`'s group (which must run the same
    /// requests in the same steps, as under tensor parallelism): each rank computes its slice
    /// of every pair and the ranks sum the gathered partials in rank order.
    pub fn set_sliced_experts(
        &mut self,
        sliced: std::sync::Arc<crate::parallel::sliced::SlicedExperts>,
    ) {
        self.sliced_experts = Some(sliced);
    }

    /// The expert slicing attached, if any.
    pub fn sliced_experts(&self) -> Option<&crate::parallel::sliced::SlicedExperts> {
        self.sliced_experts.as_deref()
    }

    /// The tensor parallelism attached, if any.
    pub fn tensor_parallel(&self) -> Option<&crate::parallel::tensor::TensorParallel> {
        self.tensor_parallel.as_deref()
    }

    /// The expert parallelism attached, if any.
    pub fn expert_parallel(&self) -> Option<&crate::parallel::expert::ExpertParallel> {
        self.expert_parallel.as_deref()
    }

    /// [`Self::expert_parallel`], shared: a device stepping this rank exchanges over it too.
    pub fn expert_parallel_shared(
        &self,
    ) -> Option<std::sync::Arc<crate::parallel::expert::ExpertParallel>> {
        self.expert_parallel.clone()
    }

    /// The expert-slice group this rank is part of, shared (a device step gathers over it).
    pub fn sliced_experts_shared(
        &self,
    ) -> Option<std::sync::Arc<crate::parallel::sliced::SlicedExperts>> {
        self.sliced_experts.clone()
    }

    /// Fails every group this rank is part of (expert, head and expert-slice groups), so the
    /// other ranks stop at once instead of waiting for this one.
    pub fn fail_groups(&self, reason: &str) {
        if let Some(ep) = self.expert_parallel() {
            ep.fail(reason);
        }
        if let Some(sliced) = self.sliced_experts() {
            sliced.fail(reason);
        }
        if let Some(tp) = self.tensor_parallel() {
            tp.fail(reason);
        }
    }

    /// [`Self::tensor_parallel`], shared: a device stepping this rank gathers over it too.
    pub fn tensor_parallel_shared(
        &self,
    ) -> Option<std::sync::Arc<crate::parallel::tensor::TensorParallel>> {
        self.tensor_parallel.clone()
    }

    /// A step without tokens under expert parallelism: every MoE layer's exchanges with nothing
    /// to send, so the ranks that have tokens get their experts computed here. Without expert
    /// parallelism it does nothing.
    pub fn idle_forward(&self) -> Result<(), ForwardError> {
        let Some(ep) = self.expert_parallel.as_deref() else {
            return Ok(());
        };
        for layer in &self.weights.layers {
            ep.routed(&layer.moe.experts, self.config.swiglu_limit, &[], &[])
                .map_err(|e| expert_failure(&e))?;
        }
        Ok(())
    }

    /// Where each op runs; `None` when no backend is attached (all on the CPU).
    pub fn backend_plan(&self) -> Option<&BackendPlan> {
        self.backend.as_ref().map(|b| &b.plan)
    }

    /// A fresh sequence.
    pub fn new_state(&self) -> SequenceState {
        SequenceState {
            len: 0,
            layers: self
                .config
                .layers
                .iter()
                .map(|l| AttentionState::new(l.attention))
                .collect(),
        }
    }

    /// Runs `tokens` (the next tokens of the sequence) and returns logits for the requested
    /// positions of the chunk, in order.
    pub fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let mut out = self.forward_batch(&mut [Step {
            state,
            tokens,
            logits,
        }])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Runs one step for several sequences at once (prefill chunks and decode tokens mixed).
    /// Every token is computed by exactly the code and reduction order it would see alone, so a
    /// sequence's logits do not depend on the rest of the batch. Fails without touching any
    /// state if a token is outside the vocabulary.
    pub fn forward_batch(
        &self,
        batch: &mut [Step<'_>],
    ) -> Result<Vec<Vec<Vec<f32>>>, ForwardError> {
        self.forward_batch_observed(batch, &mut |_, _| {})
    }

    /// [`Self::forward_batch`], calling `after_layer(l, batch)` as soon as layer `l`'s attention
    /// has updated every sequence's state (the sequences' `len` still counts only the positions
    /// before this step), so a layer's new state can leave while later layers run.
    ///
    /// The whole step runs on a thread of the compute pool, so its parallel loops (tens per
    /// layer) start from a pool thread; started from outside the pool, each would wake the
    /// pool and wait for it.
    pub fn forward_batch_observed(
        &self,
        batch: &mut [Step<'_>],
        after_layer: &mut (dyn FnMut(usize, &[Step<'_>]) + Send),
    ) -> Result<Vec<Vec<Vec<f32>>>, ForwardError> {
        if rayon::current_thread_index().is_some() {
            self.forward_on_pool(batch, after_layer)
        } else {
            rayon::scope(|_| self.forward_on_pool(batch, after_layer))
        }
    }

    fn forward_on_pool(
        &self,
        batch: &mut [Step<'_>],
        after_layer: &mut (dyn FnMut(usize, &[Step<'_>]) + Send),
    ) -> Result<Vec<Vec<Vec<f32>>>, ForwardError> {
        let c = &self.config;
        let w = &self.weights;
        for step in batch.iter() {
            if let Some((index, &token)) = step
                .tokens
                .iter()
                .enumerate()
                .find(|(_, t)| **t as usize >= c.vocab_size)
            {
                return Err(ForwardError::TokenOutOfRange {
                    token,
                    index,
                    vocab: c.vocab_size,
                });
            }
        }
        // Token rows of all sequences, concatenated; `spans[s]` is sequence s's range.
        let mut spans = Vec::with_capacity(batch.len());
        let mut tokens: Vec<u32> = Vec::new();
        for step in batch.iter() {
            spans.push(tokens.len()..tokens.len() + step.tokens.len());
            tokens.extend_from_slice(step.tokens);
        }
        let mut streams: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| w.embed.row_f32(t as usize).repeat(c.hc_mult))
            .collect();
        let ropes = attention::Ropes {
            main: &self.main_rope,
            compress: &self.compress_rope,
            kv_rows: self.kv_rows,
        };
        for (i, layer) in w.layers.iter().enumerate() {
            let (mixes, inputs): (Vec<_>, Vec<_>) = hyper::pre_many(&streams, &layer.hc_attn, c)
                .into_par_iter()
                .map(|(mix, mut collapsed)| {
                    rms_norm(&mut collapsed, &layer.attn_norm, c.rms_norm_eps);
                    (mix, collapsed)
                })
                .unzip();
            let device = LayerDevice {
                backend: self.backend.as_ref(),
                layer: i,
            };
            let attn: Vec<Vec<Vec<f32>>> = batch
                .par_iter_mut()
                .zip(&spans)
                .map(|(step, span)| {
                    attention::forward(
                        &layer.attn,
                        c.layers[i].attention,
                        &mut step.state.layers[i],
                        &inputs[span.clone()],
                        step.state.len,
                        c,
                        &ropes,
                        device,
                        self.tensor_parallel.as_deref(),
                    )
                })
                .collect::<Result<_, _>>()?;
            // The layer's state is final once its attention ran; its MoE does not touch it.
            after_layer(i, batch);
            let mut lows: Vec<Vec<f32>> = attn.into_iter().flatten().collect();
            if let Some(tp) = self.tensor_parallel.as_deref() {
                lows = tp
                    .gather(lows)
                    .map_err(|e| parallel_failure("attention", &e))?;
            }
            // `wo_b` mixes every group, each token's row the same dot products as alone.
            let attn = device.linear(crate::backend::LinearId::OB, &layer.attn.wo_b, &lows)?;
            streams
                .par_iter_mut()
                .zip(&attn)
                .zip(&mixes)
                .for_each(|((x, y), mix)| *x = hyper::post(x, y, mix, c.hc_mult));
            let (ffn_mixes, ffn_inputs): (Vec<_>, Vec<_>) =
                hyper::pre_many(&streams, &layer.hc_ffn, c)
                    .into_par_iter()
                    .map(|(mix, mut collapsed)| {
                        rms_norm(&mut collapsed, &layer.ffn_norm, c.rms_norm_eps);
                        (mix, collapsed)
                    })
                    .unzip();
            let routed = self
                .backend
                .as_ref()
                .filter(|b| b.runs(Op::RoutedExperts))
                .map(|b| (b, i));
            let shared_on = self
                .backend
                .as_ref()
                .filter(|b| b.runs(Op::SharedExpert))
                .map(|b| (b, i));
            let ffn = moe::forward_many(
                &layer.moe,
                &ffn_inputs,
                &tokens,
                c,
                moe::Routed {
                    backend: routed,
                    expert_parallel: self.expert_parallel.as_deref(),
                    replicated_tokens: self.tensor_parallel.is_some(),
                    sliced: self.sliced_experts.as_deref(),
                },
                shared_on,
            )?;
            streams
                .par_iter_mut()
                .zip(&ffn)
                .zip(&ffn_mixes)
                .for_each(|((x, y), mix)| *x = hyper::post(x, y, mix, c.hc_mult));
        }
        // Final hidden states of every wanted position of every sequence, then one pass over
        // the output head for all of them.
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        for (s, (step, span)) in batch.iter_mut().zip(&spans).enumerate() {
            step.state.len += span.len();
            let positions: Vec<usize> = match step.logits {
                _ if span.is_empty() => Vec::new(),
                Logits::None => Vec::new(),
                Logits::Last => vec![span.end - 1],
                Logits::All => span.clone().collect(),
            };
            wanted.extend(positions.into_iter().map(|t| (s, t)));
        }
        let hidden: Vec<Vec<f32>> = wanted
            .par_iter()
            .map(|&(_, t)| {
                let mut h = hyper::head(&streams[t], &w.hc_head, c);
                rms_norm(&mut h, &w.norm, c.rms_norm_eps);
                h
            })
            .collect();
        let logits = match self.backend.as_ref().filter(|b| b.runs(Op::OutputHead)) {
            Some(backend) if !hidden.is_empty() => backend.output_head(&hidden, c.vocab_size)?,
            _ => w.head.apply_many(&hidden),
        };
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); batch.len()];
        for ((s, _), l) in wanted.into_iter().zip(logits) {
            out[s].push(l);
        }
        Ok(out)
    }
}

/// One sequence's part of a batched forward step.
#[derive(Debug)]
pub struct Step<'a> {
    pub state: &'a mut SequenceState,
    /// The sequence's next tokens (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    pub logits: Logits,
}

/// A failed expert-parallel exchange, as the forward pass reports it.
/// A collective of tensor-parallel `what` that failed, as the step's error.
fn parallel_failure(
    what: &'static str,
    e: &crate::parallel::collective::CollectiveError,
) -> BackendError {
    BackendError::Failed {
        backend: "tensor-parallel".to_owned(),
        op: what,
        message: e.to_string(),
    }
}

pub(crate) fn expert_failure(e: &crate::parallel::expert::ExpertError) -> BackendError {
    BackendError::Failed {
        backend: "expert-parallel".to_owned(),
        op: "routed experts",
        message: e.to_string(),
    }
}
