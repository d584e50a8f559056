//! The `flash-shape` preset: DeepSeek-V4-Flash's real per-layer dimensions (the shipped
//! `config.json` with `num_hidden_layers`, `compress_ratios`, `num_hash_layers` and
//! `n_routed_experts` cut down), written as a multi-shard checkpoint with an index.
//!
//! At these sizes drawing f32 normals and quantizing them would dominate, so the large
//! matrices are drawn directly in their stored encoding: bf16 bits, e4m3 codes under ue8m0 tile
//! scales, e2m1 codes under ue8m0 (MXFP4) or e4m3 x f32 (NVFP4) block scales. Every element
//! comes from 16 random bits through a lookup table of a triangular distribution (std 1, no
//! libm), and the scales are picked so the decoded weights have a standard deviation of about
//! `1/sqrt(fan_in)`, as the tiny and small presets do, which keeps activations O(1). Random
//! streams are per tensor and per fixed 1 MiB chunk of its bytes, so output is identical for any
//! number of threads. Vectors and small tensors (norms, biases, hyper-connection mixers,
//! compressor position biases, hash tables) use the same generator as the other presets.
//!
//! Shards are generated in parallel tensor by tensor and written one at a time, so peak memory
//! is about one shard.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use rayon::prelude::*;
use serde_json::{Value, json};

use super::{GenerateError, Rng, encode, io_err, layer_of, nvfp4_tensors, tensor};
use crate::{
    config::{ExpertFormat, LinearFormat, ModelConfig},
    formats::{self, e8m0_for_at_least, e8m0_to_f32, f32_to_e2m1, f32_to_e4m3},
    safetensors::{self, Dtype, WriteTensor},
    schema::{self, Storage, TensorSpec},
};

/// Layers of the shipped DeepSeek-V4-Flash.
pub const FLASH_LAYERS: usize = 43;
/// Routed experts of the shipped DeepSeek-V4-Flash.
pub const FLASH_ROUTED_EXPERTS: usize = 256;
/// Experts per token (top-k) of DeepSeek-V4-Flash.
pub const FLASH_TOP_K: usize = 6;
/// Hash-routed layers (`num_hash_layers`) of DeepSeek-V4-Flash.
pub const FLASH_HASH_LAYERS: usize = 3;

/// `compress_ratios` of `deepseek-ai/DeepSeek-V4-Flash` as shipped: 43 layers (0 and 1
/// sliding-window only, then 4 on even and 128 on odd layers, layer 42 is 4) and the MTP layer.
pub const FLASH_COMPRESS_RATIOS: [u64; FLASH_LAYERS + 1] = [
    0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
    4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0,
];

/// A shard grows past this many bytes only when it holds a single tensor.
pub const MAX_SHARD_BYTES: usize = 2 << 30;

/// Bytes of one random stream: each tensor's data is drawn in chunks of this size, each from
/// its own stream, so chunks can be filled in parallel with the same result.
const CHUNK_BYTES: usize = 1 << 20;

/// V4-Flash's dimensions truncated to `layers` layers with `routed_experts` routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashShape {
    layers: usize,
    routed_experts: usize,
}

/// A `flash-shape` size that is not a truncation of V4-Flash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlashShapeError {
    #[error(
        "--layers must be between 1 and {FLASH_LAYERS} (DeepSeek-V4-Flash has {FLASH_LAYERS} layers), got {0}"
    )]
    Layers(usize),
    #[error(
        "--routed-experts must be between {FLASH_TOP_K} (num_experts_per_tok) and {FLASH_ROUTED_EXPERTS} (DeepSeek-V4-Flash's n_routed_experts), got {0}"
    )]
    RoutedExperts(usize),
}

impl Default for FlashShape {
    fn default() -> Self {
        Self {
            layers: 4,
            routed_experts: 16,
        }
    }
}

impl FlashShape {
    pub fn new(layers: usize, routed_experts: usize) -> Result<Self, FlashShapeError> {
        if !(1..=FLASH_LAYERS).contains(&layers) {
            return Err(FlashShapeError::Layers(layers));
        }
        if !(FLASH_TOP_K..=FLASH_ROUTED_EXPERTS).contains(&routed_experts) {
            return Err(FlashShapeError::RoutedExperts(routed_experts));
        }
        Ok(Self {
            layers,
            routed_experts,
        })
    }

    pub fn layers(self) -> usize {
        self.layers
    }

    pub fn routed_experts(self) -> usize {
        self.routed_experts
    }

    /// The shipped V4-Flash `config.json` (April release) with the layer and expert counts cut
    /// down and no MTP layer (none is written). Expert-format keys are added by the caller.
    pub fn config_json(self) -> Value {
        let n = self.layers;
        // Two literals: one would exceed `json!`'s macro recursion limit.
        let mut v = json!({
            "architectures": ["DeepseekV4ForCausalLM"],
            "attention_bias": false, "attention_dropout": 0.0,
            "bos_token_id": 0, "eos_token_id": 1,
            "expert_dtype": "fp4",
            "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096,
            "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
            "initializer_range": 0.02, "max_position_embeddings": 1_048_576,
            "model_type": "deepseek_v4", "moe_intermediate_size": 2048,
            "n_routed_experts": self.routed_experts, "n_shared_experts": 1, "norm_topk_prob": true,
            "num_attention_heads": 64, "num_experts_per_tok": FLASH_TOP_K, "num_hidden_layers": n,
        });
        let rest = json!({
            "num_hash_layers": n.min(FLASH_HASH_LAYERS), "num_key_value_heads": 1,
            "num_nextn_predict_layers": 0,
            "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                             "original_max_position_embeddings": 65536, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
            "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": false,
            "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
            "use_cache": true, "vocab_size": 129_280, "compress_rope_theta": 160_000,
            "compress_ratios": &FLASH_COMPRESS_RATIOS[..n],
        });
        if let (Value::Object(dst), Value::Object(src)) = (&mut v, rest) {
            dst.extend(src);
        }
        v
    }
}

/// Bytes a logical tensor occupies on disk (all its stored tensors).
pub fn stored_bytes(spec: &TensorSpec) -> usize {
    schema::files_of(spec)
        .iter()
        .map(|(_, shape, dtypes)| {
            let size = dtypes
                .first()
                .and_then(|d| Dtype::from_name(d))
                .map_or(1, Dtype::size_bytes);
            shape.iter().product::<usize>() * size
        })
        .sum()
}

/// Which logical tensors go in which shard: the globals (embedding, final norm, hyper head)
/// first, one shard per layer, `head.weight` last; a group larger than [`MAX_SHARD_BYTES`] is
/// split in schema order.
pub fn shard_plan(c: &ModelConfig) -> Vec<Vec<TensorSpec>> {
    let layers = c.num_layers();
    let mut groups: Vec<Vec<TensorSpec>> = vec![Vec::new(); layers + 2];
    for spec in schema::tensors(c) {
        let group = match layer_of(&spec.name) {
            Some(l) => l + 1,
            None if spec.name == "head.weight" => layers + 1,
            None => 0,
        };
        groups[group].push(spec);
    }
    let mut shards = Vec::new();
    for group in groups {
        let (mut shard, mut bytes) = (Vec::new(), 0);
        for spec in group {
            let size = stored_bytes(&spec);
            if !shard.is_empty() && bytes + size > MAX_SHARD_BYTES {
                shards.push(std::mem::take(&mut shard));
                bytes = 0;
            }
            bytes += size;
            shard.push(spec);
        }
        if !shard.is_empty() {
            shards.push(shard);
        }
    }
    shards
}

/// File name of shard `i` (0-based) of `n`, as in the shipped checkpoints.
pub fn shard_file(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// `model.safetensors.index.json`'s `weight_map` for a plan: every stored tensor to its file.
pub fn weight_map(plan: &[Vec<TensorSpec>]) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for (i, shard) in plan.iter().enumerate() {
        let file = shard_file(i, plan.len());
        for spec in shard {
            for (name, _, _) in schema::files_of(spec) {
                map.insert(name, file.clone());
            }
        }
    }
    map
}

/// Generates and writes every shard of the plan in order; returns the index's weight map.
pub(super) fn write_shards(
    out: &Path,
    c: &ModelConfig,
    seed: u64,
    written: &mut Vec<PathBuf>,
) -> Result<BTreeMap<String, String>, GenerateError> {
    let plan = shard_plan(c);
    let map = weight_map(&plan);
    let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    for (i, specs) in plan.iter().enumerate() {
        let file = shard_file(i, plan.len());
        let tensors: Vec<WriteTensor> = specs
            .par_iter()
            .map(|spec| stored_tensors(spec, c, seed))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .flatten()
            .collect();
        // The index was written from the plan: the shard must hold exactly those names.
        let names: BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let planned: BTreeSet<&str> = map
            .iter()
            .filter(|(_, f)| **f == file)
            .map(|(n, _)| n.as_str())
            .collect();
        if names != planned || names.len() != tensors.len() {
            return Err(GenerateError::Quant {
                name: file,
                message: "generated tensors differ from the shard plan".to_owned(),
            });
        }
        let path = out.join(&file);
        safetensors::write(&path, &tensors, &meta).map_err(io_err(&path))?;
        written.push(path);
    }
    Ok(map)
}

/// The stored tensors of one logical tensor: matrices drawn directly in their encoding, the
/// rest through the shared generator.
fn stored_tensors(
    spec: &TensorSpec,
    c: &ModelConfig,
    seed: u64,
) -> Result<Vec<WriteTensor>, GenerateError> {
    Ok(match (spec.storage, spec.shape.len()) {
        (Storage::Bf16, 2) => vec![bf16_matrix(spec.name.clone(), spec, seed)],
        (Storage::Linear(LinearFormat::Bf16) | Storage::Expert(ExpertFormat::Bf16), _) => {
            vec![bf16_matrix(format!("{}.weight", spec.name), spec, seed)]
        }
        (Storage::Linear(LinearFormat::Fp8Block) | Storage::Expert(ExpertFormat::Fp8Block), _) => {
            fp8_block_matrix(spec, seed)
        }
        (Storage::Expert(ExpertFormat::Mxfp4), _) => mxfp4_matrix(spec, seed),
        (Storage::Expert(ExpertFormat::Nvfp4), _) => nvfp4_matrix(spec, seed),
        _ => encode(spec, c, seed)?,
    })
}

/// Standard deviation of a matrix's decoded values (as the other presets draw them).
fn sigma(spec: &TensorSpec) -> f32 {
    let fan_in = spec.shape.get(1).copied().unwrap_or(1) as f32;
    match spec.name.as_str() {
        "embed.weight" => 1.0,
        "head.weight" => 2.0 / fan_in.sqrt(),
        _ => 1.0 / fan_in.sqrt(),
    }
}

/// `sqrt(6)`: scales the triangular draw to standard deviation 1.
const SQRT_6: f32 = 2.449_489_8;

/// Triangular on (-sqrt 6, sqrt 6), standard deviation ~1, from 16 random bits (the sum of two
/// uniform bytes).
fn triangular(bits: u16) -> f32 {
    let sum = f32::from(bits & 0xFF) + f32::from(bits >> 8) - 255.0;
    sum / 256.0 * SQRT_6
}

/// A lookup table from 16 random bits to an encoded triangular draw times `k`.
fn table<T>(k: f32, encode: impl Fn(f32) -> T) -> Vec<T> {
    (0..=u16::MAX).map(|b| encode(triangular(b) * k)).collect()
}

/// Fills `out` from per-chunk streams of `name`; `fill` writes [`STEP`] bytes at a time.
fn fill(out: &mut [u8], seed: u64, name: &str, fill: impl Fn(&mut Rng, &mut [u8]) + Sync) {
    out.par_chunks_mut(CHUNK_BYTES)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = Rng::for_tensor(seed, &format!("{name}#{i}"));
            let mut pieces = chunk.chunks_exact_mut(STEP);
            for piece in &mut pieces {
                fill(&mut rng, piece);
            }
            let rest = pieces.into_remainder();
            if !rest.is_empty() {
                let mut buf = [0u8; STEP];
                fill(&mut rng, &mut buf);
                rest.copy_from_slice(&buf[..rest.len()]);
            }
        });
}

/// Bytes one `fill` call writes.
const STEP: usize = 8;

/// The four 16-bit draws of one u64.
fn draws(r: u64) -> [usize; 4] {
    [
        (r & 0xFFFF) as usize,
        ((r >> 16) & 0xFFFF) as usize,
        ((r >> 32) & 0xFFFF) as usize,
        (r >> 48) as usize,
    ]
}

/// Random bf16 bits, standard deviation [`sigma`].
fn bf16_matrix(name: String, spec: &TensorSpec, seed: u64) -> WriteTensor {
    let t = table(sigma(spec), formats::f32_to_bf16);
    let n: usize = spec.shape.iter().product();
    let mut data = vec![0u8; 2 * n];
    // Four elements per u64: 8 bytes.
    fill(&mut data, seed, &name, |rng, out| {
        for (dst, d) in out.chunks_exact_mut(2).zip(draws(rng.next_u64())) {
            dst.copy_from_slice(&t[d].to_le_bytes());
        }
    });
    tensor(name, Dtype::BF16, spec.shape.clone(), data)
}

/// Packed e2m1 codes (two per byte, even element low) of a triangular draw with std ~2.
fn e2m1_bytes(n: usize, seed: u64, name: &str) -> Vec<u8> {
    let t = table(2.0, f32_to_e2m1);
    let mut data = vec![0u8; n / 2];
    // Four codes per u64: two bytes.
    fill(&mut data, seed, name, |rng, out| {
        for pair in out.chunks_exact_mut(2) {
            let d = draws(rng.next_u64());
            pair[0] = t[d[0]] | (t[d[1]] << 4);
            pair[1] = t[d[2]] | (t[d[3]] << 4);
        }
    });
    data
}

/// A one-bit-per-block scale pattern: `base` or `base - 1` (ue8m0: half the scale).
fn e8m0_scales(n: usize, base: u8, seed: u64, name: &str) -> Vec<u8> {
    let mut rng = Rng::for_tensor(seed, name);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let r = rng.next_u64();
        out.extend((0..64.min(n - out.len())).map(|i| base - ((r >> i) & 1) as u8));
    }
    out
}

/// e4m3 codes with ue8m0 128x128 tile scales; decoded std between sigma/2 and sigma.
fn fp8_block_matrix(spec: &TensorSpec, seed: u64) -> Vec<WriteTensor> {
    let (n, shape) = (&spec.name, spec.shape.clone());
    let (rows, cols) = (shape[0], shape[1]);
    let base = e8m0_for_at_least(sigma(spec) / 48.0);
    let t = table(sigma(spec) / e8m0_to_f32(base), f32_to_e4m3);
    let mut data = vec![0u8; rows * cols];
    let name = format!("{n}.weight");
    // Four codes per u64.
    fill(&mut data, seed, &name, |rng, out| {
        for four in out.chunks_exact_mut(4) {
            for (dst, d) in four.iter_mut().zip(draws(rng.next_u64())) {
                *dst = t[d];
            }
        }
    });
    let scale_shape = vec![rows.div_ceil(128), cols.div_ceil(128)];
    let scale_name = format!("{n}.scale");
    let scales = e8m0_scales(scale_shape.iter().product(), base, seed, &scale_name);
    vec![
        tensor(name, Dtype::F8E4M3, shape, data),
        tensor(scale_name, Dtype::F8E8M0, scale_shape, scales),
    ]
}

/// MXFP4: e2m1 codes with ue8m0 per-32 scales; decoded std between sigma/2 and 2 sigma.
fn mxfp4_matrix(spec: &TensorSpec, seed: u64) -> Vec<WriteTensor> {
    let (n, (rows, cols)) = (&spec.name, (spec.shape[0], spec.shape[1]));
    let name = format!("{n}.weight");
    let data = e2m1_bytes(rows * cols, seed, &name);
    let scale_name = format!("{n}.scale");
    let base = e8m0_for_at_least(sigma(spec) / 2.0);
    let scales = e8m0_scales(rows * cols / 32, base, seed, &scale_name);
    vec![
        tensor(name, Dtype::I8, vec![rows, cols / 2], data),
        tensor(scale_name, Dtype::F8E8M0, vec![rows, cols / 32], scales),
    ]
}

/// NVFP4: e2m1 codes, e4m3 per-16 block scales in [32, 64] and a `weight_scale_2` that
/// depends only on the shape (so w1 and w3 of an expert share it, as ModelOpt requires).
fn nvfp4_matrix(spec: &TensorSpec, seed: u64) -> Vec<WriteTensor> {
    let (n, (rows, cols)) = (&spec.name, (spec.shape[0], spec.shape[1]));
    let data = e2m1_bytes(rows * cols, seed, &format!("{n}.weight"));
    let blocks = rows * cols / 16;
    let codes: Vec<u8> = (0..=u8::MAX)
        .map(|b| f32_to_e4m3(32.0 + f32::from(b) / 8.0))
        .collect();
    let mut scales = vec![0u8; blocks];
    fill(
        &mut scales,
        seed,
        &format!("{n}.weight_scale"),
        |rng, out| {
            for (dst, b) in out.iter_mut().zip(rng.next_u64().to_le_bytes()) {
                *dst = codes[usize::from(b)];
            }
        },
    );
    let scale_2 = sigma(spec) / (2.0 * 48.0);
    nvfp4_tensors(n, rows, cols, data, scales, scale_2)
}

#[cfg(test)]
mod tests;
