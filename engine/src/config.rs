//! DeepSeek-V4 model configuration, parsed from `config.json` as shipped (DeepSeek's native
//! keys) or in the `transformers` spelling. Everything the forward pass needs is resolved and
//! cross-checked here once, so the model code never re-reads raw keys.

use std::path::Path;

use serde_json::{Map, Value};

/// Attention kind of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// Sliding window only (compress ratio 0).
    Sliding,
    /// Compressed sparse attention: overlapping ratio-4 compressor plus lightning indexer.
    Csa { ratio: usize },
    /// Heavily compressed attention: non-overlapping ratio-128 compressor, no indexer.
    Hca { ratio: usize },
}

impl Attention {
    /// Tokens per compressed row (0 for sliding-only layers).
    pub fn ratio(self) -> usize {
        match self {
            Attention::Sliding => 0,
            Attention::Csa { ratio } | Attention::Hca { ratio } => ratio,
        }
    }
}

/// How a layer's MoE picks experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Fixed `tid2eid[token]` table.
    Hash,
    /// Top-k over sqrt-softplus scores plus a selection-only bias.
    TopK,
}

/// One decoder layer's kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub attention: Attention,
    pub routing: Routing,
}

/// Storage format of the attention, shared-expert and other dense linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearFormat {
    Bf16,
    /// FP8 e4m3 weights with a ue8m0 scale per 128x128 block (`.scale`).
    Fp8Block,
}

/// Storage format of the routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFormat {
    Bf16,
    /// FP8 e4m3 with ue8m0 128x128 block scales (DeepSeek `*-Base`).
    Fp8Block,
    /// Packed e2m1 with a ue8m0 scale per 32 inputs (DeepSeek native `expert_dtype: fp4`).
    Mxfp4,
    /// NVIDIA ModelOpt NVFP4: packed e2m1, e4m3 scale per 16, f32 global scale.
    Nvfp4,
}

/// YaRN parameters of the compressed layers' RoPE (attention factor is always 1: V4 never
/// rescales cos/sin).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// The resolved model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    /// Trailing dims of each head (and of indexer/compressed rows) that carry RoPE.
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_routed_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate_size: usize,
    pub routed_scaling_factor: f32,
    pub swiglu_limit: f32,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_norm_eps: f32,
    pub sliding_window: usize,
    /// RoPE base of sliding-only layers (no YaRN).
    pub rope_theta: f64,
    /// RoPE base of compressed layers and their compressors / indexer.
    pub compress_rope_theta: f64,
    /// YaRN of the compressed layers' RoPE; `None` means plain RoPE.
    pub yarn: Option<Yarn>,
    pub layers: Vec<LayerSpec>,
    pub num_nextn_predict_layers: usize,
    /// Attention kind of each draft stage stored beside the decoder as `mtp.{i}.*` (the
    /// multi-token-prediction layers, or DSpark's stages in the 0731 checkpoints). The engine
    /// does not run them; `plan` sizes them.
    pub draft_layers: Vec<Attention>,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub linear_format: LinearFormat,
    pub expert_format: ExpertFormat,
}

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {message}")]
    Json { path: String, message: String },
    #[error("config.json must be a JSON object")]
    NotObject,
    #[error(
        "unsupported architecture {found:?}: expected DeepseekV4ForCausalLM (model_type deepseek_v4)"
    )]
    Architecture { found: String },
    #[error("config.json: missing `{0}`")]
    Missing(&'static str),
    #[error("config.json: `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
}

fn invalid(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// Typed access to the raw JSON object with key-naming errors.
struct Raw<'a>(&'a Map<String, Value>);

impl Raw<'_> {
    fn get(&self, key: &'static str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &'static str) -> Result<usize, ConfigError> {
        self.usize_or(key, None)
    }

    fn usize_or(&self, key: &'static str, default: Option<usize>) -> Result<usize, ConfigError> {
        match self.get(key) {
            None => default.ok_or(ConfigError::Missing(key)),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| invalid(key, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn f64_or(&self, key: &'static str, default: Option<f64>) -> Result<f64, ConfigError> {
        match self.get(key) {
            None => default.ok_or(ConfigError::Missing(key)),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| invalid(key, format!("expected a finite number, got {v}"))),
        }
    }

    fn str_or<'s>(&'s self, key: &'static str, default: &'s str) -> Result<&'s str, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| invalid(key, format!("expected a string, got {v}"))),
        }
    }

    fn bool_or(&self, key: &'static str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| invalid(key, format!("expected true or false, got {v}"))),
        }
    }
}

fn read_json(path: &Path) -> Result<Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ConfigError::Json {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

impl ModelConfig {
    /// Reads `<dir>/config.json` (and, when NVFP4 experts are declared only there,
    /// `<dir>/hf_quant_config.json`).
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        Self::from_file(&dir.join("config.json"))
    }

    /// Reads a `config.json` file, and the `hf_quant_config.json` beside it when NVFP4 experts
    /// are declared only there.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let mut config = Self::from_json(&read_json(path)?)?;
        let quant = path.with_file_name("hf_quant_config.json");
        if config.expert_format != ExpertFormat::Nvfp4
            && quant.is_file()
            && hf_quant_declares_nvfp4_experts(&read_json(&quant)?)
        {
            config.expert_format = ExpertFormat::Nvfp4;
        }
        Ok(config)
    }

    /// Parses a `config.json` value.
    pub fn from_json(value: &Value) -> Result<Self, ConfigError> {
        let map = value.as_object().ok_or(ConfigError::NotObject)?;
        let raw = Raw(map);
        check_architecture(&raw)?;
        parse::config(&raw)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Width of the hyper-connection mixing vector: pre (hc) + post (hc) + comb (hc*hc).
    pub fn hc_mix_dim(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }
}

fn check_architecture(raw: &Raw<'_>) -> Result<(), ConfigError> {
    let model_type = raw.str_or("model_type", "")?;
    let archs: Vec<&str> = raw
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let known_arch = archs.contains(&"DeepseekV4ForCausalLM");
    if model_type == "deepseek_v4" && (archs.is_empty() || known_arch) {
        return Ok(());
    }
    let found = if model_type.is_empty() {
        archs.join(",")
    } else {
        format!("{model_type} ({})", archs.join(","))
    };
    Err(ConfigError::Architecture { found })
}

fn hf_quant_declares_nvfp4_experts(value: &Value) -> bool {
    let quant = &value["quantization"];
    let algo = quant["quant_algo"].as_str().unwrap_or("");
    if algo == "NVFP4" {
        return true;
    }
    quant["quantized_layers"].as_object().is_some_and(|layers| {
        layers
            .iter()
            .any(|(name, v)| name.contains(".experts.") && v["quant_algo"] == "NVFP4")
    })
}

mod parse;

#[cfg(test)]
mod tests;
