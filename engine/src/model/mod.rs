//! The DeepSeek-V4 forward pass on the CPU in f32: the oracle every fast path is checked
//! against. A sequence is fed in chunks of any size (a whole prompt, then one token at a time);
//! each token's result depends only on the tokens before it, never on the chunking.

pub mod attention;
pub mod compressor;
pub mod hyper;
pub mod moe;

use std::path::Path;

use attention::AttentionState;
use rayon::prelude::*;

use crate::{
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
}

/// Everything a sequence carries from one forward call to the next.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceState {
    /// Tokens processed so far (the next token's position).
    pub len: usize,
    pub layers: Vec<AttentionState>,
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
}

impl Model {
    /// Loads `config.json` and the weights from a checkpoint folder.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        let weights = weights::load(dir, &config)?;
        Ok(Self::new(config, weights))
    }

    pub fn new(config: ModelConfig, weights: ModelWeights) -> Self {
        let (main_rope, compress_rope) = Rope::tables(&config);
        Self {
            config,
            weights,
            main_rope,
            compress_rope,
        }
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
        let c = &self.config;
        let w = &self.weights;
        if let Some((index, &token)) = tokens
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
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let mut streams: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| w.embed.row(t as usize).repeat(c.hc_mult))
            .collect();
        for (i, layer) in w.layers.iter().enumerate() {
            let (mixes, inputs): (Vec<_>, Vec<_>) = streams
                .par_iter()
                .map(|x| {
                    let (mix, mut collapsed) = hyper::pre(x, &layer.hc_attn, c);
                    rms_norm(&mut collapsed, &layer.attn_norm, c.rms_norm_eps);
                    (mix, collapsed)
                })
                .unzip();
            let attn = attention::forward(
                &layer.attn,
                c.layers[i].attention,
                &mut state.layers[i],
                &inputs,
                state.len,
                c,
                &attention::Ropes {
                    main: &self.main_rope,
                    compress: &self.compress_rope,
                },
            );
            streams
                .par_iter_mut()
                .zip(&attn)
                .zip(&mixes)
                .zip(tokens)
                .for_each(|(((x, y), mix), &token)| {
                    *x = hyper::post(x, y, mix, c.hc_mult);
                    let (mix, mut collapsed) = hyper::pre(x, &layer.hc_ffn, c);
                    rms_norm(&mut collapsed, &layer.ffn_norm, c.rms_norm_eps);
                    let y = moe::forward(&layer.moe, &collapsed, token, c);
                    *x = hyper::post(x, &y, &mix, c.hc_mult);
                });
        }
        state.len += tokens.len();
        let wanted: Vec<usize> = match logits {
            Logits::None => Vec::new(),
            Logits::Last => vec![tokens.len() - 1],
            Logits::All => (0..tokens.len()).collect(),
        };
        Ok(wanted
            .into_par_iter()
            .map(|t| {
                let mut h = hyper::head(&streams[t], &w.hc_head, c);
                rms_norm(&mut h, &w.norm, c.rms_norm_eps);
                w.head.apply(&h)
            })
            .collect())
    }
}
