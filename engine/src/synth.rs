//! Deterministic synthetic checkpoints in the official on-disk layout (`pdctl gen-model`).
//! Values come from a seeded, arithmetic-only generator (no libm), so the same preset, seed and
//! expert format give identical bytes on every machine. Scales are chosen so activations stay
//! O(1) through the layers and logits are spread enough that the top token is well separated.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde_json::{Value, json};

use crate::{
    config::{ConfigError, ExpertFormat, LinearFormat, ModelConfig},
    formats, quant,
    safetensors::{self, Dtype, WriteTensor},
    schema::{self, Storage, TensorSpec},
};

mod flash;

pub use flash::{
    FLASH_COMPRESS_RATIOS, FLASH_HASH_LAYERS, FLASH_LAYERS, FLASH_ROUTED_EXPERTS, FLASH_TOP_K,
    FlashShape, FlashShapeError, MAX_SHARD_BYTES, shard_file, shard_plan, stored_bytes, weight_map,
};

/// Built-in model sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Seconds to generate and run; every layer kind, hash and top-k MoE.
    Tiny,
    /// Larger dims for benchmarks.
    Small,
    /// DeepSeek-V4-Flash's real dimensions, truncated in layers and routed experts; one shard
    /// per layer.
    FlashShape(FlashShape),
}

/// A preset name or size option that does not describe a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PresetError {
    #[error("unknown preset {0:?} (expected tiny, small or flash-shape)")]
    Unknown(String),
    #[error("--layers and --routed-experts apply only to --preset flash-shape, not {0}")]
    NotSizable(String),
    #[error(transparent)]
    FlashShape(#[from] FlashShapeError),
}

impl Preset {
    /// `tiny`, `small`, or `flash-shape` at its default size (4 layers, 16 routed experts).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::Tiny),
            "small" => Some(Self::Small),
            "flash-shape" => Some(Self::FlashShape(FlashShape::default())),
            _ => None,
        }
    }

    /// A preset with optional size overrides (`pdctl gen-model --layers --routed-experts`).
    /// Only `flash-shape` takes them; the fixed presets refuse them.
    pub fn resolve(
        name: &str,
        layers: Option<usize>,
        routed_experts: Option<usize>,
    ) -> Result<Self, PresetError> {
        match Self::parse(name).ok_or_else(|| PresetError::Unknown(name.to_owned()))? {
            Self::FlashShape(default) => Ok(Self::FlashShape(FlashShape::new(
                layers.unwrap_or(default.layers()),
                routed_experts.unwrap_or(default.routed_experts()),
            )?)),
            _ if layers.is_some() || routed_experts.is_some() => {
                Err(PresetError::NotSizable(name.to_owned()))
            }
            preset => Ok(preset),
        }
    }

    /// The `config.json` of this preset (native DeepSeek keys).
    pub fn config_json(self, experts: ExpertFormat) -> Value {
        let mut v = match self {
            Preset::Tiny => json!({
                "hidden_size": 64, "num_hidden_layers": 6,
                "compress_ratios": [0, 4, 128, 4, 128, 0], "num_hash_layers": 2,
                "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8,
                "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
                "index_n_heads": 8, "index_head_dim": 16, "index_topk": 4,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "sliding_window": 16,
            }),
            Preset::Small => json!({
                "hidden_size": 256, "num_hidden_layers": 8,
                "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0], "num_hash_layers": 2,
                "num_attention_heads": 8, "head_dim": 64, "qk_rope_head_dim": 16,
                "q_lora_rank": 128, "o_groups": 4, "o_lora_rank": 64,
                "index_n_heads": 16, "index_head_dim": 32, "index_topk": 16,
                "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
                "sliding_window": 64,
            }),
            Preset::FlashShape(shape) => return with_expert_format(shape.config_json(), experts),
        };
        let common = json!({
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": 129_280, "bos_token_id": 0, "eos_token_id": 1,
            "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
            "num_key_value_heads": 1, "n_shared_experts": 1, "norm_topk_prob": true,
            "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "routed_scaling_factor": 1.5,
            "swiglu_limit": 10.0, "hidden_act": "silu", "num_nextn_predict_layers": 0,
            "max_position_embeddings": 1_048_576, "rope_theta": 10000, "compress_rope_theta": 160_000,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "attention_bias": false, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        });
        if let (Value::Object(dst), Value::Object(src)) = (&mut v, common) {
            dst.extend(src);
        }
        with_expert_format(v, experts)
    }

    pub fn config(self, experts: ExpertFormat) -> ModelConfig {
        // The preset JSON is a constant of this file; a parse failure is a bug caught by tests.
        ModelConfig::from_json(&self.config_json(experts))
            .unwrap_or_else(|e| unreachable!("preset config must parse: {e}"))
    }
}

/// Sets the `config.json` keys that choose the routed-expert format.
fn with_expert_format(mut v: Value, experts: ExpertFormat) -> Value {
    match experts {
        ExpertFormat::Bf16 => v["expert_dtype"] = json!("bf16"),
        ExpertFormat::Fp8Block => v["expert_dtype"] = json!("fp8"),
        ExpertFormat::Mxfp4 => v["expert_dtype"] = json!("fp4"),
        ExpertFormat::Nvfp4 => {
            v["expert_dtype"] = json!("fp4");
            v["quantization_config"]["moe_quant_algo"] = json!("NVFP4");
        }
    }
    v
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub preset: Preset,
    pub seed: u64,
    pub experts: ExpertFormat,
    pub out: PathBuf,
    /// Folder holding `tokenizer.json` and `tokenizer_config.json` to copy (the setup cache).
    pub tokenizer_dir: Option<PathBuf>,
}

impl GenerateOptions {
    /// `preset`'s checkpoint of `seed` with `experts` into `out`, without a tokenizer (tests
    /// and tools; the router's tokenizer tests copy one in).
    pub fn new(preset: Preset, seed: u64, experts: ExpertFormat, out: impl Into<PathBuf>) -> Self {
        Self {
            preset,
            seed,
            experts,
            out: out.into(),
            tokenizer_dir: None,
        }
    }
}

/// Failures writing a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("quantizing {name}: {message}")]
    Quant { name: String, message: String },
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> GenerateError + '_ {
    move |source| GenerateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a complete checkpoint folder; returns the files written.
pub fn generate(opts: &GenerateOptions) -> Result<Vec<PathBuf>, GenerateError> {
    let out = &opts.out;
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let config_json = opts.preset.config_json(opts.experts);
    let config = ModelConfig::from_json(&config_json)?;
    let mut written = Vec::new();
    let write_json = |name: &str, value: &Value, written: &mut Vec<PathBuf>| {
        let path = out.join(name);
        let text = serde_json::to_string_pretty(value).unwrap_or_default() + "\n";
        std::fs::write(&path, text).map_err(io_err(&path))?;
        written.push(path);
        Ok::<_, GenerateError>(())
    };
    write_json("config.json", &config_json, &mut written)?;
    if opts.experts == ExpertFormat::Nvfp4 {
        write_json(
            "hf_quant_config.json",
            &hf_quant_config(&config),
            &mut written,
        )?;
    }

    let weight_map = if matches!(opts.preset, Preset::FlashShape(_)) {
        flash::write_shards(out, &config, opts.seed, &mut written)?
    } else {
        two_shards(out, &config, opts.seed, &mut written)?
    };
    write_json(
        "model.safetensors.index.json",
        &json!({"metadata": {}, "weight_map": weight_map}),
        &mut written,
    )?;
    if let Some(dir) = &opts.tokenizer_dir {
        for name in ["tokenizer.json", "tokenizer_config.json"] {
            let (from, to) = (dir.join(name), out.join(name));
            std::fs::copy(&from, &to).map_err(io_err(&from))?;
            written.push(to);
        }
    }
    Ok(written)
}

/// The tiny and small presets: two shards, globals and the first half of the layers, then the
/// rest (multi-file loading is part of what the checkpoint exercises); f32 values quantized.
fn two_shards(
    out: &Path,
    config: &ModelConfig,
    seed: u64,
    written: &mut Vec<PathBuf>,
) -> Result<BTreeMap<String, String>, GenerateError> {
    let half = config.num_layers().div_ceil(2);
    let mut shards: [Vec<WriteTensor>; 2] = [Vec::new(), Vec::new()];
    let specs = schema::tensors(config);
    for spec in &specs {
        let shard = usize::from(layer_of(&spec.name).is_some_and(|l| l >= half));
        if spec.storage == Storage::Expert(ExpertFormat::Nvfp4) {
            // w1 and w3 of one NVFP4 expert share one global scale: quantize them together.
            match spec.name.rsplit('.').next() {
                Some("w1") => {
                    let w3 = TensorSpec {
                        name: format!("{}w3", &spec.name[..spec.name.len() - 2]),
                        ..spec.clone()
                    };
                    shards[shard].extend(nvfp4_pair(spec, &w3, seed)?);
                    continue;
                }
                Some("w3") => continue,
                _ => {}
            }
        }
        shards[shard].extend(encode(spec, config, seed)?);
    }
    let mut weight_map = BTreeMap::new();
    for (n, tensors) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-00002.safetensors", n + 1);
        for t in tensors {
            weight_map.insert(t.name.clone(), name.clone());
        }
        let path = out.join(&name);
        let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        safetensors::write(&path, tensors, &meta).map_err(io_err(&path))?;
        written.push(path);
    }
    Ok(weight_map)
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn hf_quant_config(config: &ModelConfig) -> Value {
    let mut layers = serde_json::Map::new();
    for l in 0..config.num_layers() {
        for e in 0..config.n_routed_experts {
            for w in ["w1", "w2", "w3"] {
                layers.insert(
                    format!("layers.{l}.ffn.experts.{e}.{w}"),
                    json!({"quant_algo": "NVFP4", "group_size": 16}),
                );
            }
        }
    }
    json!({
        "producer": {"name": "modelopt", "version": "pdserve-synthetic"},
        "quantization": {
            "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": null, "group_size": 16,
            "quantized_layers": layers,
            "exclude_modules": ["*.attn.*", "*.attn_norm.*", "*.ffn.shared_experts.*", "*.ffn.gate.*",
                "*.ffn_norm.*", "embed.weight", "head.weight", "*.hc_*", "norm.weight"]
        }
    })
}

/// SplitMix64: tiny, fast, and fully specified.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A stream for one tensor: seed mixed with the tensor's name.
    pub fn for_tensor(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Self(seed ^ h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 24 random bits (exact in f32).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Approximately standard normal: a scaled sum of four uniforms (no libm, so portable).
    pub fn normal(&mut self) -> f32 {
        let s = self.uniform() + self.uniform() + self.uniform() + self.uniform();
        (s - 2.0) * 3f32.sqrt()
    }
}

/// The f32 values of a tensor (before storage encoding).
fn values(spec: &TensorSpec, seed: u64) -> Vec<f32> {
    let mut rng = Rng::for_tensor(seed, &spec.name);
    let n: usize = spec.shape.iter().product();
    let name = spec.name.as_str();
    let fan_in = spec.shape.get(1).copied().unwrap_or(1) as f32;
    let gauss = |rng: &mut Rng, mean: f32, std: f32| -> Vec<f32> {
        (0..n).map(|_| mean + std * rng.normal()).collect()
    };
    if name.ends_with("norm.weight") {
        gauss(&mut rng, 1.0, 0.1)
    } else if name.ends_with("_scale") {
        gauss(&mut rng, 1.0, 0.2)
    } else if name.ends_with("_base") || name.rsplit('.').next() == Some("ape") {
        gauss(&mut rng, 0.0, 0.5)
    } else if name.ends_with("_fn") {
        gauss(&mut rng, 0.0, 0.5 / fan_in.sqrt())
    } else if name.ends_with("attn_sink") || name == "embed.weight" {
        gauss(&mut rng, 0.0, 1.0)
    } else if name == "head.weight" {
        gauss(&mut rng, 0.0, 2.0 / fan_in.sqrt())
    } else if name.ends_with("gate.bias") {
        gauss(&mut rng, 0.0, 0.1)
    } else {
        gauss(&mut rng, 0.0, 1.0 / fan_in.sqrt())
    }
}

fn tid2eid(c: &ModelConfig, seed: u64, name: &str) -> Vec<u8> {
    let mut rng = Rng::for_tensor(seed, name);
    let mut out = Vec::with_capacity(c.vocab_size * c.experts_per_token * 4);
    let mut ids: Vec<i32> = (0..c.n_routed_experts as i32).collect();
    for _ in 0..c.vocab_size {
        // Partial Fisher-Yates: k distinct experts per token.
        for j in 0..c.experts_per_token {
            let pick = j + (rng.next_u64() % (ids.len() - j) as u64) as usize;
            ids.swap(j, pick);
            out.extend_from_slice(&ids[j].to_le_bytes());
        }
    }
    out
}

fn tensor(name: String, dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> WriteTensor {
    WriteTensor {
        name,
        dtype,
        shape,
        data,
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| formats::f32_to_bf16(x).to_le_bytes())
        .collect()
}

/// Encodes one logical tensor into its on-disk tensors.
fn encode(
    spec: &TensorSpec,
    c: &ModelConfig,
    seed: u64,
) -> Result<Vec<WriteTensor>, GenerateError> {
    let v = &values(spec, seed);
    let quant_err = |e: quant::QuantError| GenerateError::Quant {
        name: spec.name.clone(),
        message: e.to_string(),
    };
    let n = &spec.name;
    let shape = spec.shape.clone();
    let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
    Ok(match spec.storage {
        Storage::F32 => vec![tensor(n.clone(), Dtype::F32, shape, f32_bytes(v))],
        Storage::Bf16 => vec![tensor(n.clone(), Dtype::BF16, shape, bf16_bytes(v))],
        Storage::I32 => vec![tensor(n.clone(), Dtype::I32, shape, tid2eid(c, seed, n))],
        Storage::Linear(LinearFormat::Bf16) | Storage::Expert(ExpertFormat::Bf16) => {
            vec![tensor(
                format!("{n}.weight"),
                Dtype::BF16,
                shape,
                bf16_bytes(v),
            )]
        }
        Storage::Linear(LinearFormat::Fp8Block) | Storage::Expert(ExpertFormat::Fp8Block) => {
            let (w, s) = quant::quant_fp8_block(v, rows, cols).map_err(quant_err)?;
            vec![
                tensor(format!("{n}.weight"), Dtype::F8E4M3, shape, w),
                tensor(
                    format!("{n}.scale"),
                    Dtype::F8E8M0,
                    vec![rows.div_ceil(128), cols.div_ceil(128)],
                    s,
                ),
            ]
        }
        Storage::Expert(ExpertFormat::Mxfp4) => {
            let (w, s) = quant::quant_mxfp4(v, rows, cols).map_err(quant_err)?;
            vec![
                tensor(format!("{n}.weight"), Dtype::I8, vec![rows, cols / 2], w),
                tensor(
                    format!("{n}.scale"),
                    Dtype::F8E8M0,
                    vec![rows, cols / 32],
                    s,
                ),
            ]
        }
        Storage::Expert(ExpertFormat::Nvfp4) => {
            let (w, s, s2) = quant::quant_nvfp4(v, rows, cols).map_err(quant_err)?;
            nvfp4_tensors(n, rows, cols, w, s, s2)
        }
    })
}

fn nvfp4_tensors(
    n: &str,
    rows: usize,
    cols: usize,
    w: Vec<u8>,
    s: Vec<u8>,
    scale_2: f32,
) -> Vec<WriteTensor> {
    // A plausible calibrated activation scale: amax 4 over the e2m1 x e4m3 range.
    let input_scale = 4.0f32 / (6.0 * 448.0);
    vec![
        tensor(format!("{n}.weight"), Dtype::U8, vec![rows, cols / 2], w),
        tensor(
            format!("{n}.weight_scale"),
            Dtype::F8E4M3,
            vec![rows, cols / 16],
            s,
        ),
        tensor(
            format!("{n}.weight_scale_2"),
            Dtype::F32,
            vec![],
            f32_bytes(&[scale_2]),
        ),
        tensor(
            format!("{n}.input_scale"),
            Dtype::F32,
            vec![],
            f32_bytes(&[input_scale]),
        ),
    ]
}

/// w1 and w3 of one NVFP4 expert, quantized as one matrix so they share `weight_scale_2`.
fn nvfp4_pair(
    w1: &TensorSpec,
    w3: &TensorSpec,
    seed: u64,
) -> Result<Vec<WriteTensor>, GenerateError> {
    let (rows, cols) = (w1.shape[0], w1.shape[1]);
    let mut both = values(w1, seed);
    both.extend(values(w3, seed));
    let (w, s, s2) =
        quant::quant_nvfp4(&both, 2 * rows, cols).map_err(|e| GenerateError::Quant {
            name: w1.name.clone(),
            message: e.to_string(),
        })?;
    let (wb, sb) = (rows * cols / 2, rows * cols / 16);
    let mut out = nvfp4_tensors(&w1.name, rows, cols, w[..wb].to_vec(), s[..sb].to_vec(), s2);
    out.extend(nvfp4_tensors(
        &w3.name,
        rows,
        cols,
        w[wb..].to_vec(),
        s[sb..].to_vec(),
        s2,
    ));
    Ok(out)
}

#[cfg(test)]
mod tests;
