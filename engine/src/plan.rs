//! Sizing a deployment from `config.json` alone: the checkpoint's weight bytes by tensor class
//! (from the same tensor list the loader checks files against, so the figures cannot drift
//! from what is loaded), the state every token and every request needs in the engine's own
//! page layout, and how much of it fits in a GPU group's memory after the weights.

use crate::{
    config::{Attention, ModelConfig},
    paged::layout::{ALIGN, KvStorage, LayoutError, Placement, StateLayout},
    schema::{self, Storage, TensorSpec},
};

/// What a tensor is for, as operators size it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum WeightClass {
    Embedding,
    Head,
    /// Q, KV and output projections of every layer.
    AttentionLinears,
    /// The compressed layers' compressors and the lightning indexer.
    CompressorsAndIndexer,
    /// The MoE gates (weights, bias, hash tables).
    Router,
    SharedExperts,
    RoutedExperts,
    /// Norms, hyper-connection parameters, attention sinks.
    Small,
    /// The draft stages stored as `mtp.*` (not loaded by the engine).
    DraftStages,
}

impl WeightClass {
    /// Stable name for text and JSON.
    pub fn name(self) -> &'static str {
        match self {
            WeightClass::Embedding => "embedding",
            WeightClass::Head => "head",
            WeightClass::AttentionLinears => "attention_linears",
            WeightClass::CompressorsAndIndexer => "compressors_and_indexer",
            WeightClass::Router => "router",
            WeightClass::SharedExperts => "shared_experts",
            WeightClass::RoutedExperts => "routed_experts",
            WeightClass::Small => "norms_and_hyper_connections",
            WeightClass::DraftStages => "draft_stages",
        }
    }

    /// Whether the engine loads tensors of this class to serve.
    pub fn served(self) -> bool {
        self != WeightClass::DraftStages
    }

    fn of(spec: &TensorSpec) -> Self {
        let n = spec.name.as_str();
        if n.starts_with("mtp.") {
            WeightClass::DraftStages
        } else if n == "embed.weight" {
            WeightClass::Embedding
        } else if n == "head.weight" {
            WeightClass::Head
        } else if n.contains(".ffn.experts.") {
            WeightClass::RoutedExperts
        } else if n.contains(".ffn.shared_experts.") {
            WeightClass::SharedExperts
        } else if n.contains(".ffn.gate.") {
            WeightClass::Router
        } else if n.contains(".compressor.") || n.contains(".indexer.") {
            WeightClass::CompressorsAndIndexer
        } else if n.contains(".attn.") && matches!(spec.storage, Storage::Linear(_)) {
            WeightClass::AttentionLinears
        } else {
            WeightClass::Small
        }
    }
}

/// Bytes and tensor count of one class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassBytes {
    pub class: WeightClass,
    pub bytes: u64,
    /// Logical tensors (a quantized linear and its scales count once).
    pub tensors: usize,
}

/// The checkpoint's weight bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightPlan {
    /// In `WeightClass` order; classes without tensors are left out.
    pub classes: Vec<ClassBytes>,
    /// Every tensor's data: what the checkpoint's shards hold, headers aside.
    pub total: u64,
    /// What the engine loads to serve (the draft stages are left out).
    pub served: u64,
}

/// Weight bytes of the checkpoint `c` describes.
pub fn weights(c: &ModelConfig) -> WeightPlan {
    let mut classes: Vec<ClassBytes> = Vec::new();
    for spec in schema::tensors(c).iter().chain(&schema::draft_tensors(c)) {
        let class = WeightClass::of(spec);
        let bytes = schema::stored_bytes(spec);
        match classes.iter_mut().find(|c| c.class == class) {
            Some(c) => {
                c.bytes += bytes;
                c.tensors += 1;
            }
            None => classes.push(ClassBytes {
                class,
                bytes,
                tensors: 1,
            }),
        }
    }
    classes.sort_by_key(|c| c.class);
    let total = classes.iter().map(|c| c.bytes).sum();
    let served = classes
        .iter()
        .filter(|c| c.class.served())
        .map(|c| c.bytes)
        .sum();
    WeightPlan {
        classes,
        total,
        served,
    }
}

/// Which attention a layer has, as state sizing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LayerKind {
    Sliding,
    Csa,
    Hca,
}

impl LayerKind {
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Sliding => "sliding",
            LayerKind::Csa => "csa",
            LayerKind::Hca => "hca",
        }
    }

    fn of(a: Attention) -> Self {
        match a {
            Attention::Sliding => LayerKind::Sliding,
            Attention::Csa { .. } => LayerKind::Csa,
            Attention::Hca { .. } => LayerKind::Hca,
        }
    }
}

/// State of the layers of one kind.
#[derive(Debug, Clone, PartialEq)]
pub struct KindState {
    pub kind: LayerKind,
    pub layers: usize,
    /// Paged bytes per token of one such layer (window rows, compressed rows and indexer keys,
    /// each at its share of the page it sits in).
    pub bytes_per_token: f64,
    /// Per-request slot bytes of one such layer (the compressors' unfinished windows).
    pub slot_bytes: u64,
}

/// The state layout's sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct StatePlan {
    pub page_size: usize,
    pub kv: KvStorage,
    pub page_bytes: u64,
    /// Slot of one request, all layers (aligned as the engine allocates it).
    pub slot_bytes: u64,
    pub kinds: Vec<KindState>,
}

impl StatePlan {
    /// Paged bytes per token, all layers.
    pub fn bytes_per_token(&self) -> f64 {
        self.page_bytes as f64 / self.page_size as f64
    }

    /// Bytes one request holds at `context` tokens: whole pages plus its slot.
    pub fn request_bytes(&self, context: u64) -> u64 {
        context.div_ceil(self.page_size as u64).max(1) * self.page_bytes + self.slot_bytes
    }
}

/// State sizes in the engine's layout for pages of `page_size` tokens.
pub fn state(c: &ModelConfig, page_size: usize, kv: KvStorage) -> Result<StatePlan, LayoutError> {
    let layout = StateLayout::new(c, page_size, kv, "plan")?;
    let mut kinds: Vec<KindState> = Vec::new();
    for (layer, spec) in c.layers.iter().enumerate() {
        let kind = LayerKind::of(spec.attention);
        let (mut paged, mut slot) = (0u64, 0u64);
        for r in layout.regions.iter().filter(|r| r.layer == layer) {
            // Regions are padded to the layout's alignment, as the engine allocates them.
            let bytes = (r.rows * r.row_stride).next_multiple_of(ALIGN) as u64;
            match r.placement {
                Placement::Paged => paged += bytes,
                Placement::PerRequest => slot += bytes,
            }
        }
        let per_token = paged as f64 / page_size as f64;
        match kinds.iter_mut().find(|k| k.kind == kind) {
            Some(k) => k.layers += 1,
            None => kinds.push(KindState {
                kind,
                layers: 1,
                bytes_per_token: per_token,
                slot_bytes: slot,
            }),
        }
    }
    kinds.sort_by_key(|k| k.kind);
    Ok(StatePlan {
        page_size,
        kv,
        page_bytes: layout.page_bytes as u64,
        slot_bytes: layout.slot_bytes as u64,
        kinds,
    })
}

/// What fits in a GPU group's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// Memory the engine may use, all GPUs together (memory x GPUs x utilization).
    pub usable_bytes: u64,
    /// Usable memory left after the served weights; 0 when they do not fit.
    pub free_bytes: u64,
    /// Whether the served weights fit at all.
    pub weights_fit: bool,
    /// Pages of state, and the tokens they hold.
    pub pages: u64,
    pub tokens: u64,
    /// Requests of `context` tokens that fit at once (each with its slot).
    pub requests: u64,
    pub context: u64,
}

/// The state that fits beside the served weights in `gpus` GPUs of `memory_bytes` each, of
/// which the engine may use the fraction `utilization`.
pub fn fit(
    weights: &WeightPlan,
    state: &StatePlan,
    memory_bytes: u64,
    gpus: u64,
    utilization: f64,
    context: u64,
) -> Fit {
    let usable = ((memory_bytes as f64) * (gpus as f64) * utilization).floor() as u64;
    let free = usable.saturating_sub(weights.served);
    let pages = free / state.page_bytes.max(1);
    Fit {
        usable_bytes: usable,
        free_bytes: free,
        weights_fit: weights.served <= usable,
        pages,
        tokens: pages * state.page_size as u64,
        requests: free / state.request_bytes(context).max(1),
        context,
    }
}

pub mod host;
pub mod shard;

#[cfg(test)]
mod tests;
