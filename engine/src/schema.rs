//! The tensors a DeepSeek-V4 checkpoint must contain for a given configuration, in the native
//! layout (see docs/checkpoint-format.md). The loader checks files against this list and the
//! checkpoint generator writes exactly this list, so the two cannot drift.

use crate::config::{Attention, ExpertFormat, LayerSpec, LinearFormat, ModelConfig, Routing};

/// How a logical tensor is stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// `F32` tensor under its own name.
    F32,
    /// `BF16` tensor under its own name.
    Bf16,
    /// `I32` tensor under its own name (expert ids).
    I32,
    /// A dense linear `[out, in]`: `<name>.weight` (+ `<name>.scale` for FP8 blocks).
    Linear(LinearFormat),
    /// A routed expert projection `[out, in]` in the expert format.
    Expert(ExpertFormat),
}

/// One logical tensor: its name (for `Linear`/`Expert` the prefix before `.weight`), its
/// logical shape and its storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub storage: Storage,
}

impl TensorSpec {
    fn new(name: impl Into<String>, shape: &[usize], storage: Storage) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            storage,
        }
    }
}

/// Name prefix of layer `i`.
pub fn layer(i: usize) -> String {
    format!("layers.{i}.")
}

/// Every tensor of the model, in a fixed order.
pub fn tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let (d, hc) = (c.hidden_size, c.hc_mult);
    let mut out = vec![
        TensorSpec::new("embed.weight", &[c.vocab_size, d], Storage::Bf16),
        TensorSpec::new("head.weight", &[c.vocab_size, d], Storage::Bf16),
        TensorSpec::new("norm.weight", &[d], Storage::Bf16),
        TensorSpec::new("hc_head_fn", &[hc, hc * d], Storage::F32),
        TensorSpec::new("hc_head_base", &[hc], Storage::F32),
        TensorSpec::new("hc_head_scale", &[1], Storage::F32),
    ];
    for (i, spec) in c.layers.iter().enumerate() {
        block(&mut out, c, &layer(i), *spec, c.expert_format);
    }
    out
}

/// The tensors of the draft stages stored beside the decoder (`mtp.{i}.*`: a decoder block
/// with top-k routing, the `e_proj`/`h_proj` input projections and their norms, and the
/// stage's own hyper-connection head). The engine does not load them (the loader admits
/// `mtp.*` without reading it); they count towards the checkpoint's bytes. DSpark's own extra
/// projections in the 0731 checkpoints are not listed: their shapes are not published. Routed
/// experts of a draft stage are MXFP4 in NVFP4 builds (ModelOpt converts only the decoder's).
pub fn draft_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let (d, hc) = (c.hidden_size, c.hc_mult);
    let lin = Storage::Linear(c.linear_format);
    let experts = match c.expert_format {
        ExpertFormat::Nvfp4 => ExpertFormat::Mxfp4,
        other => other,
    };
    let mut out = Vec::new();
    for (i, attention) in c.draft_layers.iter().enumerate() {
        let p = format!("mtp.{i}.");
        for proj in ["e_proj", "h_proj"] {
            out.push(TensorSpec::new(format!("{p}{proj}"), &[d, d], lin));
        }
        for norm in ["enorm", "hnorm", "norm"] {
            out.push(TensorSpec::new(
                format!("{p}{norm}.weight"),
                &[d],
                Storage::Bf16,
            ));
        }
        out.push(TensorSpec::new(
            format!("{p}hc_head_fn"),
            &[hc, hc * d],
            Storage::F32,
        ));
        out.push(TensorSpec::new(
            format!("{p}hc_head_base"),
            &[hc],
            Storage::F32,
        ));
        out.push(TensorSpec::new(
            format!("{p}hc_head_scale"),
            &[1],
            Storage::F32,
        ));
        let spec = LayerSpec {
            attention: *attention,
            routing: Routing::TopK,
        };
        block(&mut out, c, &p, spec, experts);
    }
    out
}

/// One decoder block under name prefix `p`.
fn block(
    out: &mut Vec<TensorSpec>,
    c: &ModelConfig,
    p: &str,
    spec: LayerSpec,
    expert_format: ExpertFormat,
) {
    let (d, hc) = (c.hidden_size, c.hc_mult);
    let lin = Storage::Linear(c.linear_format);
    let mix = c.hc_mix_dim();
    for part in ["attn", "ffn"] {
        out.push(TensorSpec::new(
            format!("{p}{part}_norm.weight"),
            &[d],
            Storage::Bf16,
        ));
        out.push(TensorSpec::new(
            format!("{p}hc_{part}_fn"),
            &[mix, hc * d],
            Storage::F32,
        ));
        out.push(TensorSpec::new(
            format!("{p}hc_{part}_base"),
            &[mix],
            Storage::F32,
        ));
        out.push(TensorSpec::new(
            format!("{p}hc_{part}_scale"),
            &[3],
            Storage::F32,
        ));
    }
    let a = format!("{p}attn.");
    let (h, hd, qr) = (c.num_heads, c.head_dim, c.q_lora_rank);
    out.push(TensorSpec::new(format!("{a}wq_a"), &[qr, d], lin));
    out.push(TensorSpec::new(
        format!("{a}q_norm.weight"),
        &[qr],
        Storage::Bf16,
    ));
    out.push(TensorSpec::new(format!("{a}wq_b"), &[h * hd, qr], lin));
    out.push(TensorSpec::new(format!("{a}wkv"), &[hd, d], lin));
    out.push(TensorSpec::new(
        format!("{a}kv_norm.weight"),
        &[hd],
        Storage::Bf16,
    ));
    out.push(TensorSpec::new(
        format!("{a}wo_a"),
        &[c.o_groups * c.o_lora_rank, h * hd / c.o_groups],
        lin,
    ));
    out.push(TensorSpec::new(
        format!("{a}wo_b"),
        &[d, c.o_groups * c.o_lora_rank],
        lin,
    ));
    out.push(TensorSpec::new(format!("{a}attn_sink"), &[h], Storage::F32));
    match spec.attention {
        Attention::Sliding => {}
        Attention::Csa { ratio } => {
            compressor(out, &format!("{a}compressor."), d, hd, ratio, true);
            let (hi, di) = (c.index_n_heads, c.index_head_dim);
            out.push(TensorSpec::new(
                format!("{a}indexer.wq_b"),
                &[hi * di, qr],
                lin,
            ));
            out.push(TensorSpec::new(
                format!("{a}indexer.weights_proj.weight"),
                &[hi, d],
                Storage::Bf16,
            ));
            compressor(out, &format!("{a}indexer.compressor."), d, di, ratio, true);
        }
        Attention::Hca { ratio } => {
            compressor(out, &format!("{a}compressor."), d, hd, ratio, false);
        }
    }
    let f = format!("{p}ffn.");
    let (e, inter) = (c.n_routed_experts, c.moe_intermediate_size);
    out.push(TensorSpec::new(
        format!("{f}gate.weight"),
        &[e, d],
        Storage::Bf16,
    ));
    match spec.routing {
        Routing::TopK => out.push(TensorSpec::new(format!("{f}gate.bias"), &[e], Storage::F32)),
        Routing::Hash => out.push(TensorSpec::new(
            format!("{f}gate.tid2eid"),
            &[c.vocab_size, c.experts_per_token],
            Storage::I32,
        )),
    }
    for (w, shape) in [("w1", [inter, d]), ("w2", [d, inter]), ("w3", [inter, d])] {
        out.push(TensorSpec::new(
            format!("{f}shared_experts.{w}"),
            &shape,
            lin,
        ));
    }
    let expert = Storage::Expert(expert_format);
    for x in 0..e {
        for (w, shape) in [("w1", [inter, d]), ("w2", [d, inter]), ("w3", [inter, d])] {
            out.push(TensorSpec::new(
                format!("{f}experts.{x}.{w}"),
                &shape,
                expert,
            ));
        }
    }
}

/// A compressor: `overlap` (CSA) doubles the projected width into the two series Ca, Cb.
fn compressor(
    out: &mut Vec<TensorSpec>,
    prefix: &str,
    d: usize,
    head_dim: usize,
    ratio: usize,
    overlap: bool,
) {
    let width = if overlap { 2 * head_dim } else { head_dim };
    out.push(TensorSpec::new(
        format!("{prefix}wkv.weight"),
        &[width, d],
        Storage::Bf16,
    ));
    out.push(TensorSpec::new(
        format!("{prefix}wgate.weight"),
        &[width, d],
        Storage::Bf16,
    ));
    out.push(TensorSpec::new(
        format!("{prefix}ape"),
        &[ratio, width],
        Storage::F32,
    ));
    out.push(TensorSpec::new(
        format!("{prefix}norm.weight"),
        &[head_dim],
        Storage::Bf16,
    ));
}

/// The on-disk tensors of one logical tensor: (name, shape, accepted dtypes by name).
pub fn files_of(spec: &TensorSpec) -> Vec<(String, Vec<usize>, &'static [&'static str])> {
    let (rows, cols) = (spec.shape[0], spec.shape.get(1).copied().unwrap_or(1));
    let n = &spec.name;
    match spec.storage {
        Storage::F32 => vec![(n.clone(), spec.shape.clone(), &["F32"])],
        Storage::Bf16 => vec![(n.clone(), spec.shape.clone(), &["BF16"])],
        Storage::I32 => vec![(n.clone(), spec.shape.clone(), &["I32", "I64"])],
        Storage::Linear(LinearFormat::Bf16) | Storage::Expert(ExpertFormat::Bf16) => {
            vec![(format!("{n}.weight"), vec![rows, cols], &["BF16"])]
        }
        Storage::Linear(LinearFormat::Fp8Block) | Storage::Expert(ExpertFormat::Fp8Block) => vec![
            (format!("{n}.weight"), vec![rows, cols], &["F8_E4M3"]),
            (
                format!("{n}.scale"),
                vec![rows.div_ceil(128), cols.div_ceil(128)],
                &["F8_E8M0", "U8"],
            ),
        ],
        Storage::Expert(ExpertFormat::Mxfp4) => vec![
            (format!("{n}.weight"), vec![rows, cols / 2], &["I8", "U8"]),
            (
                format!("{n}.scale"),
                vec![rows, cols / 32],
                &["F8_E8M0", "U8"],
            ),
        ],
        Storage::Expert(ExpertFormat::Nvfp4) => vec![
            (format!("{n}.weight"), vec![rows, cols / 2], &["U8"]),
            (
                format!("{n}.weight_scale"),
                vec![rows, cols / 16],
                &["F8_E4M3"],
            ),
            (format!("{n}.weight_scale_2"), vec![], &["F32"]),
            (format!("{n}.input_scale"), vec![], &["F32"]),
        ],
    }
}

/// Bytes of one element of a safetensors dtype (by name).
pub fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F32" | "I32" => 4,
        "BF16" | "F16" => 2,
        "I64" => 8,
        "F8_E4M3" | "F8_E8M0" | "U8" | "I8" => 1,
        _ => return None,
    })
}

/// Bytes of a logical tensor's data on disk, all its files together, each stored in the first
/// dtype `files_of` accepts (expert ids as I32; headers not counted).
pub fn stored_bytes(spec: &TensorSpec) -> u64 {
    files_of(spec)
        .iter()
        .map(|(_, shape, dtypes)| {
            let elements: u64 = shape.iter().map(|&n| n as u64).product();
            elements * dtype_bytes(dtypes[0]).unwrap_or(0)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_accepted_dtype_has_a_size() {
        let config = crate::synth::Preset::Tiny.config(ExpertFormat::Nvfp4);
        for spec in tensors(&config) {
            for (name, _, dtypes) in files_of(&spec) {
                for dtype in dtypes {
                    assert!(dtype_bytes(dtype).is_some(), "{name}: {dtype}");
                }
            }
        }
    }

    #[test]
    fn stored_bytes_of_each_format() {
        let spec = |storage| TensorSpec::new("w", &[256, 512], storage);
        let elements = 256 * 512;
        let exp = |f| stored_bytes(&spec(Storage::Expert(f)));
        let lin = |f| stored_bytes(&spec(Storage::Linear(f)));
        assert_eq!(lin(LinearFormat::Bf16), 2 * elements);
        // One ue8m0 scale per 128x128 block: 2 x 4 blocks.
        assert_eq!(lin(LinearFormat::Fp8Block), elements + 8);
        assert_eq!(exp(ExpertFormat::Mxfp4), elements / 2 + elements / 32);
        // Plus the two f32 scalars.
        assert_eq!(exp(ExpertFormat::Nvfp4), elements / 2 + elements / 16 + 8);
        assert_eq!(
            stored_bytes(&TensorSpec::new("ids", &[10, 6], Storage::I32)),
            240
        );
        // A partial block gets its own scale.
        let odd = TensorSpec::new("w", &[129, 130], Storage::Linear(LinearFormat::Fp8Block));
        assert_eq!(stored_bytes(&odd), 129 * 130 + 4);
    }

    #[test]
    fn names_are_unique() {
        let config = crate::synth::Preset::Tiny.config(ExpertFormat::Nvfp4);
        let mut seen = std::collections::BTreeSet::new();
        for spec in tensors(&config) {
            for (name, _, _) in files_of(&spec) {
                assert!(seen.insert(name.clone()), "duplicate {name}");
            }
        }
        let mut config = config;
        config.draft_layers = vec![Attention::Sliding, Attention::Csa { ratio: 4 }];
        let draft = draft_tensors(&config);
        assert!(draft.iter().any(|s| s.name == "mtp.1.attn.indexer.wq_b"));
        for spec in draft {
            assert!(spec.name.starts_with("mtp."), "{}", spec.name);
            for (name, _, _) in files_of(&spec) {
                assert!(seen.insert(name.clone()), "duplicate {name}");
            }
        }
    }
}
