//! [`StateDelta`]: what a forward step over positions `from..to` added to a sequence's state,
//! and nothing else: the K=V rows of those positions, the compressed rows of the windows they
//! closed, and each compressor's slot part after them. It is what a page store needs to store
//! the step ([`crate::paged::store::PagedStore::scatter_delta`]) and all a device that keeps the
//! state sends back after a prompt chunk (the rows it computed, not the whole state).

use super::{SequenceState, compressor::PendingState};
use crate::config::ModelConfig;

/// A compressor's part of a [`StateDelta`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompressorDelta {
    /// The rows of the windows the step closed (`from / ratio .. to / ratio`), `d` each.
    pub rows: Vec<f32>,
    /// Its slot part after the step.
    pub pending: PendingState,
}

/// A layer's part of a [`StateDelta`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerDelta {
    /// The K=V rows of positions `from..to`, `head_dim` each.
    pub window: Vec<f32>,
    /// The attention compressor (CSA and HCA layers).
    pub compressor: Option<CompressorDelta>,
    /// The indexer's compressor (CSA layers).
    pub indexer: Option<CompressorDelta>,
}

/// What a step over positions `from..to` of a sequence added to its state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateDelta {
    pub from: usize,
    pub to: usize,
    pub layers: Vec<LayerDelta>,
}

impl StateDelta {
    /// The part of `state` (a sequence `state.len` tokens long) that positions `from..` added.
    ///
    /// # Errors
    /// When `state` does not hold those positions' rows (its window keeps fewer, or it is not
    /// a state of `config`'s layers).
    pub fn of(state: &SequenceState, from: usize, config: &ModelConfig) -> Result<Self, String> {
        let to = state.len;
        if from > to || state.layers.len() != config.layers.len() {
            return Err(format!(
                "no delta from position {from} of a {to}-token state of {} layers",
                state.layers.len()
            ));
        }
        let hd = config.head_dim;
        let mut layers = Vec::with_capacity(state.layers.len());
        for (l, (layer, spec)) in state.layers.iter().zip(&config.layers).enumerate() {
            let held = layer.window.len() / hd.max(1);
            if held < to - from {
                return Err(format!(
                    "layer {l} keeps {held} window rows, the step added {}",
                    to - from
                ));
            }
            let ratio = spec.attention.ratio();
            let part = |comp: &super::compressor::CompressorState, d: usize| {
                let rows = comp
                    .rows
                    .get(from / ratio * d..to / ratio * d)
                    .ok_or_else(|| {
                        format!(
                            "layer {l}: a compressor of {} rows, not {}",
                            comp.rows.len() / d.max(1),
                            to / ratio
                        )
                    })?;
                Ok::<_, String>(CompressorDelta {
                    rows: rows.to_vec(),
                    pending: comp.pending(),
                })
            };
            layers.push(LayerDelta {
                window: layer.window[(held - (to - from)) * hd..].to_vec(),
                compressor: layer.compressor.as_ref().map(|c| part(c, hd)).transpose()?,
                indexer: layer
                    .indexer
                    .as_ref()
                    .map(|c| part(c, config.index_head_dim))
                    .transpose()?,
            });
        }
        Ok(Self { from, to, layers })
    }

    /// Checks that every part has the size a step over `from..to` of a model configured by
    /// `config` gives it (what a device sent back, before anything stores it).
    ///
    /// # Errors
    /// Names the first part whose size is wrong.
    pub fn check(&self, config: &ModelConfig) -> Result<(), String> {
        let (from, to) = (self.from, self.to);
        if from > to || self.layers.len() != config.layers.len() {
            return Err(format!(
                "a delta of positions {from}..{to} over {} layers for a model of {}",
                self.layers.len(),
                config.layers.len()
            ));
        }
        let hd = config.head_dim;
        for (l, (layer, spec)) in self.layers.iter().zip(&config.layers).enumerate() {
            let bad = |what: &str| Err(format!("layer {l}: {what} of the wrong size"));
            if layer.window.len() != (to - from) * hd {
                return bad("K=V rows");
            }
            let kind = spec.attention;
            let ratio = kind.ratio();
            let csa = matches!(kind, crate::config::Attention::Csa { .. });
            let parts = [
                (&layer.compressor, kind.ratio() > 0, hd, csa, "compressor"),
                (
                    &layer.indexer,
                    csa,
                    config.index_head_dim,
                    true,
                    "indexer compressor",
                ),
            ];
            for (part, present, d, overlap, what) in parts {
                match part {
                    None if !present => {}
                    Some(p) if present => {
                        let width = if overlap { 2 * d } else { d };
                        let prev = if overlap && to >= ratio { ratio * d } else { 0 };
                        let q = &p.pending;
                        if p.rows.len() != (to / ratio - from / ratio) * d
                            || q.pending_kv.len() != to % ratio * width
                            || q.pending_gate.len() != to % ratio * width
                            || q.prev_kv.len() != prev
                            || q.prev_gate.len() != prev
                        {
                            return bad(what);
                        }
                    }
                    _ => return bad(what),
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config::ExpertFormat,
        model::{Logits, Model},
        synth::{GenerateOptions, Preset, Rng, generate},
    };

    fn tiny() -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 3, ExpertFormat::Nvfp4, dir.path());
        generate(&options).unwrap();
        let model = Model::load(dir.path()).unwrap();
        (dir, model)
    }

    /// A delta holds exactly the step's rows and the compressors' slot part after it, checks
    /// as the right size, and a state that no longer keeps the rows has none.
    #[test]
    fn a_delta_holds_the_steps_rows_and_checks() {
        let (_dir, model) = tiny();
        let c = &model.config;
        let mut rng = Rng::for_tensor(1, "delta");
        let tokens: Vec<u32> = (0..140)
            .map(|_| (rng.next_u64() % c.vocab_size as u64) as u32)
            .collect();
        let mut state = model.new_state();
        model
            .forward(&mut state, &tokens[..121], Logits::None)
            .unwrap();
        let before = state.clone();
        model
            .forward(&mut state, &tokens[121..], Logits::None)
            .unwrap();
        let delta = StateDelta::of(&state, 121, c).unwrap();
        delta.check(c).unwrap();
        assert_eq!((delta.from, delta.to), (121, 140));
        for (l, (d, (a, b))) in delta
            .layers
            .iter()
            .zip(before.layers.iter().zip(&state.layers))
            .enumerate()
        {
            assert_eq!(d.window[..], b.window[b.window.len() - 19 * c.head_dim..]);
            if let (Some(dc), Some(ac), Some(bc)) = (&d.compressor, &a.compressor, &b.compressor) {
                assert_eq!(dc.rows[..], bc.rows[ac.rows.len()..], "layer {l}");
                assert_eq!(dc.pending, bc.pending());
            }
        }
        // A window closed inside the step: some layer has rows.
        assert!(
            delta
                .layers
                .iter()
                .any(|l| l.compressor.as_ref().is_some_and(|c| !c.rows.is_empty()))
        );
        let mut wrong = delta.clone();
        wrong.layers[0].window.pop();
        assert!(wrong.check(c).unwrap_err().contains("layer 0"));
        let mut wrong = delta.clone();
        let l = c
            .layers
            .iter()
            .position(|s| s.attention.ratio() > 0)
            .unwrap();
        wrong.layers[l].compressor = None;
        assert!(wrong.check(c).is_err());
        let mut wrong = delta;
        wrong.to += 1;
        assert!(wrong.check(c).is_err());
        let trimmed = state.normalized(c);
        assert!(StateDelta::of(&trimmed, 0, c).is_err());
    }
}
