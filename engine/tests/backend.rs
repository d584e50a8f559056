//! The backend seam: a backend computing the routed experts with the reference code gives
//! bit-identical logits; a backend that fails or returns non-finite values fails the step, and
//! the scheduler turns that into an error for the request with its pages returned; a backend
//! that does not run every op is refused unless hybrid mode is asked for.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use engine::{
    backend::{AttendBatch, Backend, BackendError, DeviceError, ExpertBatch, LinearId, Op},
    config::ExpertFormat,
    model::{ForwardError, Logits, Model},
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, generate},
    tensor::Weight,
    weights::{AttentionWeights, MoeWeights},
};

fn load() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 5, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

/// Attention linears through the reference matrices, routed and shared experts through the
/// reference `moe::expert`, one token at a time, and the output head through the reference
/// matrix; optionally poisons one layer's expert output.
#[derive(Debug)]
struct ReferenceOps {
    attn: Vec<AttentionWeights>,
    linear_calls: AtomicUsize,
    moe: Vec<MoeWeights>,
    head: Weight,
    heads_seen: AtomicUsize,
    limit: f32,
    poison_layer: Option<usize>,
    pairs_seen: AtomicUsize,
}

impl ReferenceOps {
    fn new(model: &Model, poison_layer: Option<usize>) -> Self {
        Self {
            attn: model
                .weights
                .layers
                .iter()
                .map(|l| l.attn.clone())
                .collect(),
            linear_calls: AtomicUsize::new(0),
            moe: model.weights.layers.iter().map(|l| l.moe.clone()).collect(),
            head: model.weights.head.clone(),
            heads_seen: AtomicUsize::new(0),
            limit: model.config.swiglu_limit,
            poison_layer,
            pairs_seen: AtomicUsize::new(0),
        }
    }
}

impl Backend for ReferenceOps {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn runs(&self, op: Op) -> bool {
        matches!(
            op,
            Op::AttentionLinears | Op::RoutedExperts | Op::SharedExpert | Op::OutputHead
        )
    }

    fn linear(
        &self,
        layer: usize,
        which: LinearId,
        rows: std::ops::Range<usize>,
        xs: &[&[f32]],
    ) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.linear_calls.fetch_add(1, Ordering::Relaxed);
        let m = self.attn[layer]
            .linear(which)
            .ok_or_else(|| DeviceError::device(format!("layer {layer} has no {which:?}")))?;
        Ok(m.apply_rows_many(rows.start, rows.len(), xs))
    }

    fn shared_expert(&self, layer: usize, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let shared = &self.moe[layer].shared;
        Ok(xs
            .iter()
            .map(|x| engine::model::moe::expert(shared, x, self.limit))
            .collect())
    }

    fn output_head(&self, hidden: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.heads_seen.fetch_add(hidden.len(), Ordering::Relaxed);
        Ok(self.head.apply_many(hidden))
    }

    fn routed_experts(&self, batch: ExpertBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.pairs_seen
            .fetch_add(batch.pairs.len(), Ordering::Relaxed);
        let experts = &self.moe[batch.layer].experts;
        Ok(batch
            .pairs
            .iter()
            .map(|&(t, e)| {
                let mut y = engine::model::moe::expert(&experts[e], &batch.xs[t], self.limit);
                if self.poison_layer == Some(batch.layer) {
                    y[0] = f32::NAN;
                }
                y
            })
            .collect())
    }
}

fn run(model: &Model, prompt: &[u32], decode: &[u32]) -> Result<Vec<Vec<f32>>, ForwardError> {
    let mut state = model.new_state();
    let mut out = model.forward(&mut state, prompt, Logits::All)?;
    for &t in decode {
        out.extend(model.forward(&mut state, &[t], Logits::Last)?);
    }
    Ok(out)
}

#[test]
fn reference_experts_backend_gives_identical_logits() {
    let (_dir, plain) = load();
    let (_dir2, mut with_backend) = load();
    let backend = Arc::new(ReferenceOps::new(&with_backend, None));
    let plan = with_backend
        .attach_backend(Arc::clone(&backend) as Arc<dyn Backend>, true)
        .unwrap();
    assert!(plan.is_hybrid());
    assert_eq!(
        plan.on_device,
        vec![
            Op::AttentionLinears,
            Op::RoutedExperts,
            Op::SharedExpert,
            Op::OutputHead
        ]
    );
    assert_eq!(
        plan.to_string(),
        "reference backend runs attention linears, routed experts, shared expert, output head; \
         hybrid mode: attention norms, RoPE, compression and index scoring, attention core, \
         mixing (gates, hyper-connections, norms) on the CPU"
    );
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7919 + 3) % 1000).collect();
    let decode = [17u32, 404, 9];
    let want = run(&plain, &prompt, &decode).unwrap();
    let got = run(&with_backend, &prompt, &decode).unwrap();
    assert_eq!(got.len(), prompt.len() + decode.len());
    for (g, w) in got.iter().zip(&want) {
        assert!(g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    let layers = with_backend.config.num_layers();
    let k = with_backend.config.experts_per_token;
    // Every token of every layer went through the backend.
    assert_eq!(
        backend.pairs_seen.load(Ordering::Relaxed),
        layers * k * (prompt.len() + decode.len())
    );
    assert_eq!(
        backend.heads_seen.load(Ordering::Relaxed),
        prompt.len() + decode.len()
    );
    assert!(backend.linear_calls.load(Ordering::Relaxed) >= layers * 4 * (1 + decode.len()));
}

/// The attention core in f64, straight from its definition (softmax with a sink per head).
#[derive(Debug, Default)]
struct ReferenceAttend {
    tokens_seen: AtomicUsize,
}

impl Backend for ReferenceAttend {
    fn name(&self) -> &'static str {
        "reference attention"
    }

    fn runs(&self, op: Op) -> bool {
        op == Op::AttentionCore
    }

    fn attend(&self, b: AttendBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.tokens_seen
            .fetch_add(b.queries.len(), Ordering::Relaxed);
        let hd = b.head_dim;
        Ok(b.queries
            .iter()
            .zip(b.keys)
            .map(|(q, keys)| {
                let mut out = vec![0.0f32; b.heads * hd];
                for h in 0..b.heads {
                    let qh = &q[h * hd..(h + 1) * hd];
                    let logits: Vec<f64> = keys
                        .iter()
                        .map(|&k| {
                            let dot: f64 = qh
                                .iter()
                                .zip(b.rows[k])
                                .map(|(a, r)| f64::from(*a) * f64::from(*r))
                                .sum();
                            dot * f64::from(b.scale)
                        })
                        .collect();
                    let sink = f64::from(b.sinks[h]);
                    let max = logits.iter().copied().fold(sink, f64::max);
                    let denom: f64 =
                        (sink - max).exp() + logits.iter().map(|l| (l - max).exp()).sum::<f64>();
                    for d in 0..hd {
                        let v: f64 = logits
                            .iter()
                            .zip(keys)
                            .map(|(l, &k)| (l - max).exp() / denom * f64::from(b.rows[k][d]))
                            .sum();
                        out[h * hd + d] = v as f32;
                    }
                }
                out
            })
            .collect())
    }
}

/// The attention core through a backend (here an f64 one) gives the reference's logits up to
/// f32 rounding: the keys, their order, the sinks and the scale reach it intact.
#[test]
fn attention_core_backend_matches_the_reference() {
    let (_dir, plain) = load();
    let (_dir2, mut with_backend) = load();
    let backend = Arc::new(ReferenceAttend::default());
    with_backend
        .attach_backend(Arc::clone(&backend) as Arc<dyn Backend>, true)
        .unwrap();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7919 + 3) % 1000).collect();
    let decode = [17u32, 404, 9];
    let want = run(&plain, &prompt, &decode).unwrap();
    let got = run(&with_backend, &prompt, &decode).unwrap();
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-4 * scale, "position {p}: {err} of {scale}");
    }
    assert_eq!(
        backend.tokens_seen.load(Ordering::Relaxed),
        with_backend.config.num_layers() * (prompt.len() + decode.len())
    );
}

#[test]
fn a_partial_backend_is_refused_without_hybrid_mode() {
    let (_dir, mut model) = load();
    let backend = Arc::new(ReferenceOps::new(&model, None));
    let err = model.attach_backend(backend, false).unwrap_err();
    assert!(matches!(err, BackendError::Incomplete { .. }), "{err}");
    assert!(model.backend_plan().is_none());
}

#[test]
fn a_failing_backend_fails_the_step_and_the_request() {
    let (_dir, mut model) = load();
    let backend = Arc::new(ReferenceOps::new(&model, Some(1)));
    model.attach_backend(backend, true).unwrap();
    let err = run(&model, &[5, 6, 7], &[]).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ForwardError::Backend(_)), "{text}");
    assert!(
        text.contains("layer 1") && text.contains("non-finite"),
        "{text}"
    );

    let mut engine = Engine::new(model, EngineConfig::default(), "test").unwrap();
    let free = engine.store().pages().free_count();
    engine
        .add(GenerationRequest {
            id: 9,
            prompt: vec![5, 6, 7, 8],
            sampling: SamplingParams::default(),
            stop: StopConditions {
                max_tokens: 4,
                min_tokens: 0,
                stop_token_ids: vec![],
                ignore_eos: true,
                eos_token_ids: vec![1],
            },
        })
        .unwrap();
    let events = engine.run_to_completion();
    assert!(
        !events.iter().any(|e| matches!(e, Event::Token { .. })),
        "no token comes out of a failed step: {events:?}"
    );
    let failed = events
        .iter()
        .find_map(|e| match e {
            Event::Failed { id: 9, error } => Some(error.clone()),
            _ => None,
        })
        .expect("the request fails");
    assert!(failed.contains("non-finite"), "{failed}");
    assert_eq!(engine.store().pages().free_count(), free);
}
