//! The seam between the forward pass and a compute backend. The CPU code in [`crate::model`]
//! is the reference and computes every op; a backend (the CUDA one lives in the `kernels`
//! crate) takes over the ops it says it runs. A backend that does not run every op is only
//! accepted in *hybrid* mode, which the operator asks for explicitly and which the plan makes
//! visible, so a deployment never runs half on the CPU without knowing it.
//!
//! A backend's results are checked where they enter the forward pass (shape, finiteness): a
//! failing device makes the step fail, and the scheduler turns that into an error for every
//! request of the batch, never into plausible-looking tokens.

use std::{fmt, ops::Range, sync::Arc};

use crate::tensor::Weight;

/// An op of the forward pass a backend may take over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Op {
    /// Attention's linears: the Q, KV and output projections, the compressors' and the
    /// indexer's projections ([`LinearId`]).
    AttentionLinears,
    /// Attention's norms and RoPE, the compressors' pooling and the indexer's scoring.
    AttentionElementwise,
    /// Each token's softmax with sinks over its window and compressed rows.
    AttentionCore,
    /// The routed experts of every MoE layer.
    RoutedExperts,
    /// The shared expert of every MoE layer.
    SharedExpert,
    /// Routing gates, hyper-connections, norms.
    Mixing,
    /// The output head (vocabulary projection).
    OutputHead,
}

impl Op {
    /// Every op, in forward order.
    pub const ALL: [Op; 7] = [
        Op::AttentionLinears,
        Op::AttentionElementwise,
        Op::AttentionCore,
        Op::Mixing,
        Op::RoutedExperts,
        Op::SharedExpert,
        Op::OutputHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::AttentionLinears => "attention linears",
            Op::AttentionElementwise => "attention norms, RoPE, compression and index scoring",
            Op::AttentionCore => "attention core",
            Op::RoutedExperts => "routed experts",
            Op::SharedExpert => "shared expert",
            Op::Mixing => "mixing (gates, hyper-connections, norms)",
            Op::OutputHead => "output head",
        }
    }
}

/// One of a layer's attention linears (`[out, in]` as in the checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinearId {
    /// `attn.wq_a`: hidden to the Q low rank.
    QA,
    /// `attn.wq_b`: Q low rank to the heads.
    QB,
    /// `attn.wkv`: hidden to the shared K=V head.
    Kv,
    /// `attn.wo_a`: grouped, each head group to its block of rows.
    OA,
    /// `attn.wo_b`: the groups' low ranks to hidden.
    OB,
    /// `attn.compressor.wkv` and `.wgate`.
    CompressorKv,
    CompressorGate,
    /// `attn.indexer.compressor.wkv` and `.wgate`.
    IndexerCompressorKv,
    IndexerCompressorGate,
    /// `attn.indexer.wq_b` and `attn.indexer.weights_proj`.
    IndexerQB,
    IndexerWeights,
}

impl LinearId {
    /// Every attention linear.
    pub const ALL: [LinearId; 11] = [
        LinearId::QA,
        LinearId::QB,
        LinearId::Kv,
        LinearId::OA,
        LinearId::OB,
        LinearId::CompressorKv,
        LinearId::CompressorGate,
        LinearId::IndexerCompressorKv,
        LinearId::IndexerCompressorGate,
        LinearId::IndexerQB,
        LinearId::IndexerWeights,
    ];

    /// The checkpoint name of the linear in layer `layer` (before `.weight`).
    pub fn tensor(self, layer: usize) -> String {
        let suffix = match self {
            LinearId::QA => "wq_a",
            LinearId::QB => "wq_b",
            LinearId::Kv => "wkv",
            LinearId::OA => "wo_a",
            LinearId::OB => "wo_b",
            LinearId::CompressorKv => "compressor.wkv.weight",
            LinearId::CompressorGate => "compressor.wgate.weight",
            LinearId::IndexerCompressorKv => "indexer.compressor.wkv.weight",
            LinearId::IndexerCompressorGate => "indexer.compressor.wgate.weight",
            LinearId::IndexerQB => "indexer.wq_b",
            LinearId::IndexerWeights => "indexer.weights_proj.weight",
        };
        format!("{}attn.{suffix}", crate::schema::layer(layer))
    }
}

/// What a device reports when one of its ops fails: its own words (a driver, launch or copy
/// error, or inputs it cannot take), or that it does not implement the op.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("not implemented")]
    NotImplemented,
    #[error("{0}")]
    Device(String),
}

impl DeviceError {
    /// A device failure, in the device's words.
    pub fn device(message: impl std::fmt::Display) -> Self {
        Self::Device(message.to_string())
    }
}

/// A failure inside a backend, or a backend that cannot serve this model as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The backend does not run these ops and hybrid mode was not asked for.
    #[error(
        "the {backend} backend does not run {ops} on its device; set hybrid = true to run them \
         on the CPU (slow), or use the cpu backend"
    )]
    Incomplete { backend: String, ops: String },
    /// The backend cannot start here (no driver or device, or not in this build).
    #[error("{backend} backend: {reason}")]
    Unavailable { backend: String, reason: String },
    /// The device failed or returned something unusable.
    #[error("{backend} backend, {op}: {message}")]
    Failed {
        backend: String,
        op: &'static str,
        message: String,
    },
}

/// The routed-expert work of one MoE layer for a batch: pair `p` applies expert
/// `pairs[p].1` to token row `pairs[p].0` of `xs`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBatch<'a> {
    pub layer: usize,
    /// Expert inputs (`hidden_size` each; after `ffn_norm`).
    pub xs: &'a [Vec<f32>],
    pub pairs: &'a [(usize, usize)],
}

/// The attention core of one layer for a chunk of tokens: token `t` attends with its queries
/// (`heads * head_dim`, normed and rotated) to the rows `keys[t]` (indices into `rows`, in the
/// order the reference sums), with `sinks[h]` in each head's denominator and logits scaled
/// by `scale`. The output per token is `Σ softmax · row` per head, before the inverse rotation.
#[derive(Debug, Clone, Copy)]
pub struct AttendBatch<'a> {
    pub layer: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// The distinct K=V rows the tokens read (`head_dim` each).
    pub rows: &'a [&'a [f32]],
    /// Queries of every token, `[tokens, heads * head_dim]`.
    pub queries: &'a [Vec<f32>],
    pub keys: &'a [Vec<usize>],
    pub sinks: &'a [f32],
    pub scale: f32,
}

/// A compute backend for the ops it claims in [`Backend::runs`].
pub trait Backend: Send + Sync + fmt::Debug {
    /// Short name for logs and errors ("cuda").
    fn name(&self) -> &str;

    /// Whether this backend computes `op` (on this model: e.g. FP4 experts only).
    fn runs(&self, op: Op) -> bool;

    /// One full SwiGLU expert output (`hidden_size` values) per pair, in pair order.
    fn routed_experts(&self, batch: ExpertBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
        let _ = batch;
        Err(DeviceError::NotImplemented)
    }

    /// The logits (`vocab_size` values) of each final hidden state (after the final norm).
    fn output_head(&self, hidden: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let _ = hidden;
        Err(DeviceError::NotImplemented)
    }

    /// Rows `rows` of attention linear `which` of layer `layer` times each of `xs`.
    fn linear(
        &self,
        layer: usize,
        which: LinearId,
        rows: Range<usize>,
        xs: &[&[f32]],
    ) -> Result<Vec<Vec<f32>>, DeviceError> {
        let _ = (layer, which, rows, xs);
        Err(DeviceError::NotImplemented)
    }

    /// The shared expert of layer `layer` for every input (`hidden_size` values each).
    fn shared_expert(&self, layer: usize, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let _ = (layer, xs);
        Err(DeviceError::NotImplemented)
    }

    /// The attention core: one `heads * head_dim` output per token.
    fn attend(&self, batch: AttendBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
        let _ = batch;
        Err(DeviceError::NotImplemented)
    }
}

/// Where each op runs, decided once when a backend is attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendPlan {
    pub backend: String,
    pub on_device: Vec<Op>,
    /// Ops left on the CPU reference (non-empty only in hybrid mode).
    pub on_cpu: Vec<Op>,
}

impl BackendPlan {
    /// Whether some ops fall back to the CPU.
    pub fn is_hybrid(&self) -> bool {
        !self.on_cpu.is_empty()
    }

    /// Decides the plan for `backend`: every op it runs goes to it; the rest stay on the CPU,
    /// which is refused unless `hybrid`.
    pub fn decide(backend: &dyn Backend, hybrid: bool) -> Result<Self, BackendError> {
        let (on_device, on_cpu): (Vec<Op>, Vec<Op>) =
            Op::ALL.iter().partition(|&&op| backend.runs(op));
        if !on_cpu.is_empty() && !hybrid {
            return Err(BackendError::Incomplete {
                backend: backend.name().to_owned(),
                ops: names(&on_cpu),
            });
        }
        Ok(Self {
            backend: backend.name().to_owned(),
            on_device,
            on_cpu,
        })
    }
}

impl fmt::Display for BackendPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} backend runs {}",
            self.backend,
            names(&self.on_device)
        )?;
        if self.is_hybrid() {
            write!(f, "; hybrid mode: {} on the CPU", names(&self.on_cpu))?;
        }
        Ok(())
    }
}

fn names(ops: &[Op]) -> String {
    if ops.is_empty() {
        return "nothing".to_owned();
    }
    ops.iter()
        .map(|op| op.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A backend attached to a model with its plan.
#[derive(Debug, Clone)]
pub struct Attached {
    pub backend: Arc<dyn Backend>,
    pub plan: BackendPlan,
}

impl Attached {
    /// Whether the backend runs `op` in this plan.
    pub fn runs(&self, op: Op) -> bool {
        self.plan.on_device.contains(&op)
    }

    /// [`Backend::routed_experts`], with its output checked: one row of `width` finite values
    /// per pair.
    pub fn routed_experts(
        &self,
        batch: ExpertBatch<'_>,
        width: usize,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.backend.routed_experts(batch);
        let context = format!("layer {}, pair", batch.layer);
        self.checked(Op::RoutedExperts, out, batch.pairs.len(), width, &context)
    }

    /// [`Backend::output_head`], with its output checked: `vocab` finite logits per state.
    pub fn output_head(
        &self,
        hidden: &[Vec<f32>],
        vocab: usize,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.backend.output_head(hidden);
        self.checked(Op::OutputHead, out, hidden.len(), vocab, "position")
    }

    /// [`Backend::linear`], with its output checked: `rows.len()` finite values per input.
    pub fn linear(
        &self,
        layer: usize,
        which: LinearId,
        rows: Range<usize>,
        xs: &[&[f32]],
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let width = rows.len();
        let out = self.backend.linear(layer, which, rows, xs);
        let context = format!("layer {layer} {which:?}, input");
        self.checked(Op::AttentionLinears, out, xs.len(), width, &context)
    }

    /// [`Backend::shared_expert`], with its output checked: one row of `width` finite values
    /// per input.
    pub fn shared_expert(
        &self,
        layer: usize,
        xs: &[Vec<f32>],
        width: usize,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.backend.shared_expert(layer, xs);
        let context = format!("layer {layer}, token");
        self.checked(Op::SharedExpert, out, xs.len(), width, &context)
    }

    /// [`Backend::attend`], with its output checked: `heads * head_dim` finite values per
    /// token.
    pub fn attend(&self, batch: AttendBatch<'_>) -> Result<Vec<Vec<f32>>, BackendError> {
        let out = self.backend.attend(batch);
        let context = format!("layer {}, token", batch.layer);
        let width = batch.heads * batch.head_dim;
        self.checked(Op::AttentionCore, out, batch.queries.len(), width, &context)
    }

    /// A backend result as the forward pass needs it: `count` rows of `width` finite values.
    fn checked(
        &self,
        op: Op,
        out: Result<Vec<Vec<f32>>, DeviceError>,
        count: usize,
        width: usize,
        item: &str,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let failed = |message: String| BackendError::Failed {
            backend: self.plan.backend.clone(),
            op: op.name(),
            message,
        };
        let out = out.map_err(|e| failed(e.to_string()))?;
        if out.len() != count {
            return Err(failed(format!("{} outputs for {count} inputs", out.len())));
        }
        for (i, row) in out.iter().enumerate() {
            if row.len() != width {
                return Err(failed(format!(
                    "{item} {i}: {} values, not {width}",
                    row.len()
                )));
            }
            if let Some(at) = row.iter().position(|v| !v.is_finite()) {
                return Err(failed(format!("{item} {i}: non-finite value at {at}")));
            }
        }
        Ok(out)
    }
}

/// Where one layer's ops run: on the attached backend for the ops it runs, else here.
#[derive(Debug, Clone, Copy)]
pub struct LayerDevice<'a> {
    pub backend: Option<&'a Attached>,
    pub layer: usize,
}

impl<'a> LayerDevice<'a> {
    /// The backend, when it runs `op`.
    pub fn on(&self, op: Op) -> Option<&'a Attached> {
        self.backend.filter(|b| b.runs(op))
    }

    /// Attention linear `which` (the reference weight `m`) times each of `xs`.
    pub fn linear<V: AsRef<[f32]> + Sync>(
        &self,
        which: LinearId,
        m: &Weight,
        xs: &[V],
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        self.linear_rows(which, m, 0..m.rows, xs)
    }

    /// Rows `rows` of attention linear `which` times each of `xs`.
    pub fn linear_rows<V: AsRef<[f32]> + Sync>(
        &self,
        which: LinearId,
        m: &Weight,
        rows: Range<usize>,
        xs: &[V],
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        match self.on(Op::AttentionLinears) {
            Some(backend) if !xs.is_empty() => {
                let refs: Vec<&[f32]> = xs.iter().map(AsRef::as_ref).collect();
                backend.linear(self.layer, which, rows, &refs)
            }
            _ => Ok(m.apply_rows_many(rows.start, rows.len(), xs)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Only(Vec<Op>);

    impl Backend for Only {
        fn name(&self) -> &'static str {
            "test"
        }
        fn runs(&self, op: Op) -> bool {
            self.0.contains(&op)
        }
    }

    #[test]
    fn a_partial_backend_needs_hybrid_mode() {
        let partial = Only(vec![Op::RoutedExperts]);
        let err = BackendPlan::decide(&partial, false).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("attention core"), "{text}");
        assert!(text.contains("hybrid = true"), "{text}");
        assert!(!text.contains("routed experts"), "{text}");
        let plan = BackendPlan::decide(&partial, true).unwrap();
        assert!(plan.is_hybrid());
        assert_eq!(plan.on_device, vec![Op::RoutedExperts]);
        assert_eq!(plan.on_cpu.len(), Op::ALL.len() - 1);
        let shown = plan.to_string();
        assert!(
            shown.starts_with("test backend runs routed experts; hybrid mode:"),
            "{shown}"
        );
    }

    #[test]
    fn a_complete_backend_is_not_hybrid() {
        let all = Only(Op::ALL.to_vec());
        let plan = BackendPlan::decide(&all, false).unwrap();
        assert!(!plan.is_hybrid());
        assert!(!plan.to_string().contains("hybrid"));
    }

    #[derive(Debug)]
    struct Returns(Vec<Vec<f32>>);

    impl Backend for Returns {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn runs(&self, _: Op) -> bool {
            true
        }
        fn routed_experts(&self, _: ExpertBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
            Ok(self.0.clone())
        }
    }

    fn attached(out: Vec<Vec<f32>>) -> Attached {
        let backend: Arc<dyn Backend> = Arc::new(Returns(out));
        let plan = BackendPlan::decide(backend.as_ref(), false).unwrap();
        Attached { backend, plan }
    }

    #[test]
    fn unusable_backend_output_is_an_error() {
        let xs = vec![vec![0.0; 3]];
        let pairs = [(0, 0), (0, 1)];
        let batch = ExpertBatch {
            layer: 2,
            xs: &xs,
            pairs: &pairs,
        };
        let good = attached(vec![vec![1.0; 3], vec![2.0; 3]]);
        assert_eq!(good.routed_experts(batch, 3).unwrap().len(), 2);
        for (bad, what) in [
            (vec![vec![1.0; 3]], "1 outputs for 2 inputs"),
            (
                vec![vec![1.0; 3], vec![1.0; 2]],
                "layer 2, pair 1: 2 values",
            ),
            (
                vec![vec![1.0; 3], vec![1.0, f32::NAN, 1.0]],
                "non-finite value at 1",
            ),
            (
                vec![vec![f32::INFINITY; 3], vec![1.0; 3]],
                "layer 2, pair 0: non-finite",
            ),
        ] {
            let err = attached(bad).routed_experts(batch, 3).unwrap_err();
            assert!(err.to_string().contains(what), "{err} lacks {what}");
        }
    }
}
