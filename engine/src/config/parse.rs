//! Field-by-field parsing and cross-checks of `config.json`.

use serde_json::Value;

use super::{
    Attention, ConfigError, ExpertFormat, LayerSpec, LinearFormat, ModelConfig, Raw, Routing, Yarn,
    invalid,
};

/// Defaults follow `transformers`' `DeepseekV4Config` where a key may be absent.
pub(super) fn config(raw: &Raw<'_>) -> Result<ModelConfig, ConfigError> {
    unsupported_variants(raw)?;
    let num_layers = raw.usize("num_hidden_layers")?;
    let head_dim = raw.usize("head_dim")?;
    let num_nextn_predict_layers = raw.usize_or("num_nextn_predict_layers", Some(1))?;
    let (linear_format, expert_format) = formats(raw)?;
    let stages = draft_stages(raw, num_nextn_predict_layers)?;
    let (layers, draft_layers) = layers(raw, num_layers, stages)?;
    let config = ModelConfig {
        vocab_size: raw.usize("vocab_size")?,
        hidden_size: raw.usize("hidden_size")?,
        num_heads: raw.usize("num_attention_heads")?,
        head_dim,
        rope_dim: rope_dim(raw, head_dim)?,
        q_lora_rank: raw.usize("q_lora_rank")?,
        o_groups: raw.usize("o_groups")?,
        o_lora_rank: raw.usize("o_lora_rank")?,
        index_n_heads: raw.usize("index_n_heads")?,
        index_head_dim: raw.usize("index_head_dim")?,
        index_topk: raw.usize("index_topk")?,
        n_routed_experts: raw.usize("n_routed_experts")?,
        experts_per_token: raw.usize("num_experts_per_tok")?,
        moe_intermediate_size: raw.usize("moe_intermediate_size")?,
        routed_scaling_factor: raw.f64_or("routed_scaling_factor", Some(1.5))? as f32,
        swiglu_limit: raw.f64_or("swiglu_limit", Some(10.0))? as f32,
        hc_mult: raw.usize_or("hc_mult", Some(4))?,
        hc_sinkhorn_iters: raw.usize_or("hc_sinkhorn_iters", Some(20))?,
        hc_eps: raw.f64_or("hc_eps", Some(1e-6))? as f32,
        rms_norm_eps: raw.f64_or("rms_norm_eps", Some(1e-6))? as f32,
        sliding_window: raw.usize_or("sliding_window", Some(128))?,
        rope_theta: 0.0,
        compress_rope_theta: 0.0,
        yarn: None,
        layers,
        num_nextn_predict_layers,
        draft_layers,
        max_position_embeddings: raw.usize_or("max_position_embeddings", Some(1_048_576))?,
        bos_token_id: token_ids(raw, "bos_token_id")?.first().copied(),
        eos_token_ids: token_ids(raw, "eos_token_id")?,
        linear_format,
        expert_format,
    };
    let config = rope(raw, config)?;
    check(&config)?;
    Ok(config)
}

/// Keys whose other values select model variants this engine does not implement.
fn unsupported_variants(raw: &Raw<'_>) -> Result<(), ConfigError> {
    let expect_usize = |key: &'static str, want: usize| -> Result<(), ConfigError> {
        let got = raw.usize_or(key, Some(want))?;
        if got == want {
            Ok(())
        } else {
            Err(invalid(
                key,
                format!("must be {want} for DeepSeek-V4, got {got}"),
            ))
        }
    };
    expect_usize("num_key_value_heads", 1)?;
    expect_usize("n_shared_experts", 1)?;
    let expect_str = |key: &'static str, want: &str| -> Result<(), ConfigError> {
        let got = raw.str_or(key, want)?;
        if got == want {
            Ok(())
        } else {
            Err(invalid(
                key,
                format!("only {want:?} is supported, got {got:?}"),
            ))
        }
    };
    expect_str("hidden_act", "silu")?;
    expect_str("scoring_func", "sqrtsoftplus")?;
    let expect_bool = |key: &'static str, want: bool| -> Result<(), ConfigError> {
        if raw.bool_or(key, want)? == want {
            Ok(())
        } else {
            Err(invalid(key, format!("only {want} is supported")))
        }
    };
    expect_bool("norm_topk_prob", true)?;
    expect_bool("tie_word_embeddings", false)?;
    expect_bool("attention_bias", false)?;
    expect_bool("mlp_bias", false)?;
    Ok(())
}

fn rope_dim(raw: &Raw<'_>, head_dim: usize) -> Result<usize, ConfigError> {
    if raw.get("qk_rope_head_dim").is_some() {
        return raw.usize("qk_rope_head_dim");
    }
    let factor = raw.f64_or("partial_rotary_factor", Some(64.0 / 512.0))?;
    let dims = head_dim as f64 * factor;
    if dims.fract() != 0.0 || dims <= 0.0 {
        return Err(invalid(
            "partial_rotary_factor",
            format!("{factor} x head_dim {head_dim} is not a whole number of dims"),
        ));
    }
    Ok(dims as usize)
}

/// Draft stages stored beside the decoder (`mtp.{i}.*`): DSpark's (one per
/// `dspark_target_layer_ids` entry, as in the 0731 checkpoints) or the multi-token-prediction
/// layers of `num_nextn_predict_layers`.
fn draft_stages(raw: &Raw<'_>, nextn: usize) -> Result<usize, ConfigError> {
    let Some(targets) = raw.get("dspark_target_layer_ids") else {
        return Ok(nextn);
    };
    let targets = targets
        .as_array()
        .ok_or_else(|| invalid("dspark_target_layer_ids", "expected a list"))?;
    if targets.iter().any(|t| t.as_u64().is_none()) {
        return Err(invalid(
            "dspark_target_layer_ids",
            "expected non-negative layer indices",
        ));
    }
    Ok(targets.len())
}

/// The decoder layers' kinds and the draft stages' attention kinds.
fn layers(
    raw: &Raw<'_>,
    num_layers: usize,
    stages: usize,
) -> Result<(Vec<LayerSpec>, Vec<Attention>), ConfigError> {
    let (attention, draft) = attention_kinds(raw, num_layers, stages)?;
    let routing = routing_kinds(raw, num_layers)?;
    let layers = attention
        .into_iter()
        .zip(routing)
        .map(|(attention, routing)| LayerSpec { attention, routing })
        .collect();
    Ok((layers, draft))
}

fn compress_rates(raw: &Raw<'_>) -> Result<(usize, usize), ConfigError> {
    let mut csa = 4;
    let mut hca = 128;
    if let Some(rates) = raw.get("compress_rates") {
        let rates = rates
            .as_object()
            .ok_or_else(|| invalid("compress_rates", "expected an object"))?;
        for (name, value) in rates {
            let rate = value
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .filter(|v| *v > 0)
                .ok_or_else(|| invalid("compress_rates", format!("{name}: bad rate {value}")))?;
            match name.as_str() {
                "compressed_sparse_attention" => csa = rate,
                "heavily_compressed_attention" => hca = rate,
                other => {
                    return Err(invalid(
                        "compress_rates",
                        format!("unknown layer type {other:?}"),
                    ));
                }
            }
        }
    }
    if raw.get("compress_rate_csa").is_some() {
        csa = raw.usize("compress_rate_csa")?;
    }
    if raw.get("compress_rate_hca").is_some() {
        hca = raw.usize("compress_rate_hca")?;
    }
    Ok((csa, hca))
}

/// Each decoder layer's attention kind, then each draft stage's (sliding where the config
/// lists none: every shipped draft stage is).
fn attention_kinds(
    raw: &Raw<'_>,
    num_layers: usize,
    stages: usize,
) -> Result<(Vec<Attention>, Vec<Attention>), ConfigError> {
    let (csa, hca) = compress_rates(raw)?;
    if let Some(types) = raw.get("layer_types") {
        let types = types
            .as_array()
            .ok_or_else(|| invalid("layer_types", "expected a list"))?;
        if types.len() != num_layers {
            return Err(invalid(
                "layer_types",
                format!(
                    "has {} entries for num_hidden_layers {num_layers}",
                    types.len()
                ),
            ));
        }
        let kinds = types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(Attention::Sliding),
                Some("compressed_sparse_attention") => Ok(Attention::Csa { ratio: csa }),
                Some("heavily_compressed_attention") => Ok(Attention::Hca { ratio: hca }),
                _ => Err(invalid("layer_types", format!("unknown layer type {t}"))),
            })
            .collect::<Result<_, _>>()?;
        return Ok((kinds, vec![Attention::Sliding; stages]));
    }
    let ratios = raw
        .get("compress_ratios")
        .ok_or(ConfigError::Missing("compress_ratios"))?
        .as_array()
        .ok_or_else(|| invalid("compress_ratios", "expected a list"))?;
    // Shipped configs list one entry per layer plus one per draft stage.
    if ratios.len() != num_layers && ratios.len() != num_layers + stages {
        return Err(invalid(
            "compress_ratios",
            format!(
                "has {} entries; expected num_hidden_layers ({num_layers}) or that plus the draft stages ({stages}: num_nextn_predict_layers, or dspark_target_layer_ids when present)",
                ratios.len()
            ),
        ));
    }
    let kinds: Vec<Attention> = ratios
        .iter()
        .map(|r| match r.as_u64() {
            Some(0) => Ok(Attention::Sliding),
            Some(4) => Ok(Attention::Csa { ratio: csa }),
            Some(128) => Ok(Attention::Hca { ratio: hca }),
            _ => Err(invalid(
                "compress_ratios",
                format!("entries must be 0, 4 or 128, got {r}"),
            )),
        })
        .collect::<Result<_, _>>()?;
    let mut draft = kinds[num_layers..].to_vec();
    draft.resize(stages, Attention::Sliding);
    Ok((kinds[..num_layers].to_vec(), draft))
}

fn routing_kinds(raw: &Raw<'_>, num_layers: usize) -> Result<Vec<Routing>, ConfigError> {
    if let Some(types) = raw.get("mlp_layer_types") {
        let types = types
            .as_array()
            .ok_or_else(|| invalid("mlp_layer_types", "expected a list"))?;
        if types.len() != num_layers {
            return Err(invalid(
                "mlp_layer_types",
                format!(
                    "has {} entries for num_hidden_layers {num_layers}",
                    types.len()
                ),
            ));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("hash_moe") => Ok(Routing::Hash),
                Some("moe") => Ok(Routing::TopK),
                _ => Err(invalid("mlp_layer_types", format!("unknown MLP type {t}"))),
            })
            .collect();
    }
    let hash = raw.usize_or("num_hash_layers", Some(3))?;
    if hash > num_layers {
        return Err(invalid(
            "num_hash_layers",
            format!("{hash} exceeds num_hidden_layers {num_layers}"),
        ));
    }
    Ok((0..num_layers)
        .map(|i| {
            if i < hash {
                Routing::Hash
            } else {
                Routing::TopK
            }
        })
        .collect())
}

fn token_ids(raw: &Raw<'_>, key: &'static str) -> Result<Vec<u32>, ConfigError> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid(key, format!("expected a token id, got {v}")))
    };
    match raw.get(key) {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

/// Two RoPE tables: "main" (sliding layers, plain RoPE at `rope_theta`) and "compress"
/// (CSA/HCA layers and their compressors, `compress_rope_theta`, YaRN when configured).
fn rope(raw: &Raw<'_>, mut config: ModelConfig) -> Result<ModelConfig, ConfigError> {
    config.rope_theta = raw.f64_or("rope_theta", Some(10_000.0))?;
    config.compress_rope_theta = raw.f64_or("compress_rope_theta", Some(160_000.0))?;
    let params = raw
        .get("rope_parameters")
        .or_else(|| raw.get("rope_scaling"));
    let Some(params) = params else {
        return Ok(config);
    };
    let params = params
        .as_object()
        .ok_or_else(|| invalid("rope_scaling", "expected an object"))?;
    let scaling = if let (Some(main), Some(compress)) = (params.get("main"), params.get("compress"))
    {
        let main = main
            .as_object()
            .ok_or_else(|| invalid("rope_parameters", "`main` must be an object"))?;
        if let Some(theta) = main.get("rope_theta").and_then(Value::as_f64) {
            config.rope_theta = theta;
        }
        let main_type = rope_type(main);
        if main_type != "default" {
            return Err(invalid(
                "rope_parameters",
                format!("main rope_type {main_type:?} unsupported: sliding layers use plain RoPE"),
            ));
        }
        let compress = compress
            .as_object()
            .ok_or_else(|| invalid("rope_parameters", "`compress` must be an object"))?;
        if let Some(theta) = compress.get("rope_theta").and_then(Value::as_f64) {
            config.compress_rope_theta = theta;
        }
        compress
    } else {
        params
    };
    match rope_type(scaling) {
        "default" => {}
        "yarn" => {
            let num = |key: &str| scaling.get(key).and_then(Value::as_f64);
            let original = num("original_max_position_embeddings")
                .unwrap_or(config.max_position_embeddings as f64);
            let factor = num("factor").unwrap_or(config.max_position_embeddings as f64 / original);
            // `transformers` reads these with `or`, so 0 also means the default.
            let beta_fast = num("beta_fast").filter(|b| *b != 0.0).unwrap_or(32.0);
            let beta_slow = num("beta_slow").filter(|b| *b != 0.0).unwrap_or(1.0);
            if let Some(af) = num("attention_factor")
                && (af - 1.0).abs() > f64::EPSILON
            {
                return Err(invalid(
                    "rope_scaling",
                    format!("attention_factor {af} unsupported: DeepSeek-V4 uses 1.0"),
                ));
            }
            if !(factor > 0.0 && original > 0.0) {
                return Err(invalid(
                    "rope_scaling",
                    "YaRN factor and original length must be > 0",
                ));
            }
            config.yarn = Some(Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast,
                beta_slow,
            });
        }
        other => {
            return Err(invalid(
                "rope_scaling",
                format!("rope type {other:?} unsupported (expected yarn or default)"),
            ));
        }
    }
    Ok(config)
}

fn rope_type(params: &serde_json::Map<String, Value>) -> &str {
    params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default")
}

fn formats(raw: &Raw<'_>) -> Result<(LinearFormat, ExpertFormat), ConfigError> {
    let quant = raw.get("quantization_config");
    let expert_dtype = raw
        .get("expert_dtype")
        .or_else(|| quant.and_then(|q| q.get("expert_dtype")))
        .map(|v| {
            v.as_str()
                .ok_or_else(|| invalid("expert_dtype", format!("expected a string, got {v}")))
        })
        .transpose()?;
    let Some(quant) = quant else {
        let experts = match expert_dtype {
            None | Some("bf16") => ExpertFormat::Bf16,
            Some(other) => {
                return Err(invalid(
                    "expert_dtype",
                    format!("{other:?} needs a quantization_config (fp8 block scales)"),
                ));
            }
        };
        return Ok((LinearFormat::Bf16, experts));
    };
    let method = quant["quant_method"].as_str().unwrap_or("");
    if method != "fp8" {
        return Err(invalid(
            "quantization_config",
            format!("quant_method {method:?} unsupported (expected \"fp8\")"),
        ));
    }
    if let Some(block) = quant.get("weight_block_size")
        && block != &serde_json::json!([128, 128])
    {
        return Err(invalid(
            "quantization_config",
            format!("weight_block_size {block} unsupported (expected [128, 128])"),
        ));
    }
    for (key, want) in [("fmt", "e4m3"), ("scale_fmt", "ue8m0")] {
        if let Some(got) = quant.get(key).and_then(Value::as_str)
            && got != want
        {
            return Err(invalid(
                "quantization_config",
                format!("{key} {got:?} unsupported (expected {want:?})"),
            ));
        }
    }
    let experts = if quant["moe_quant_algo"].as_str() == Some("NVFP4") {
        ExpertFormat::Nvfp4
    } else {
        match expert_dtype {
            Some("fp4") => ExpertFormat::Mxfp4,
            Some("fp8") | None => ExpertFormat::Fp8Block,
            Some("bf16") => ExpertFormat::Bf16,
            Some(other) => {
                return Err(invalid(
                    "expert_dtype",
                    format!("{other:?} unsupported (expected fp4, fp8 or bf16)"),
                ));
            }
        }
    };
    Ok((LinearFormat::Fp8Block, experts))
}

fn check(c: &ModelConfig) -> Result<(), ConfigError> {
    let positive: [(&'static str, usize); 16] = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_attention_heads", c.num_heads),
        ("head_dim", c.head_dim),
        ("q_lora_rank", c.q_lora_rank),
        ("o_groups", c.o_groups),
        ("o_lora_rank", c.o_lora_rank),
        ("index_n_heads", c.index_n_heads),
        ("index_head_dim", c.index_head_dim),
        ("index_topk", c.index_topk),
        ("n_routed_experts", c.n_routed_experts),
        ("num_experts_per_tok", c.experts_per_token),
        ("moe_intermediate_size", c.moe_intermediate_size),
        ("hc_mult", c.hc_mult),
        ("hc_sinkhorn_iters", c.hc_sinkhorn_iters),
        ("sliding_window", c.sliding_window),
    ];
    for (key, value) in positive {
        if value == 0 {
            return Err(invalid(key, "must be at least 1"));
        }
    }
    if c.layers.is_empty() {
        return Err(invalid("num_hidden_layers", "must be at least 1"));
    }
    if c.rope_dim == 0 || !c.rope_dim.is_multiple_of(2) {
        return Err(invalid(
            "qk_rope_head_dim",
            format!("{} must be even and > 0", c.rope_dim),
        ));
    }
    if c.rope_dim > c.head_dim || c.rope_dim > c.index_head_dim {
        return Err(invalid(
            "qk_rope_head_dim",
            format!(
                "{} exceeds head_dim {} or index_head_dim {}",
                c.rope_dim, c.head_dim, c.index_head_dim
            ),
        ));
    }
    if !c.num_heads.is_multiple_of(c.o_groups) {
        return Err(invalid(
            "o_groups",
            format!(
                "{} does not divide num_attention_heads {}",
                c.o_groups, c.num_heads
            ),
        ));
    }
    if c.experts_per_token > c.n_routed_experts {
        return Err(invalid(
            "num_experts_per_tok",
            format!(
                "{} exceeds n_routed_experts {}",
                c.experts_per_token, c.n_routed_experts
            ),
        ));
    }
    for (key, eps) in [("rms_norm_eps", c.rms_norm_eps), ("hc_eps", c.hc_eps)] {
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(invalid(key, format!("{eps} must be a positive number")));
        }
    }
    if c.swiglu_limit.is_nan() || c.swiglu_limit <= 0.0 {
        return Err(invalid("swiglu_limit", "must be > 0"));
    }
    if c.rope_theta <= 1.0 || c.compress_rope_theta <= 1.0 {
        return Err(invalid("rope_theta", "RoPE bases must be > 1"));
    }
    let block = match c.expert_format {
        ExpertFormat::Mxfp4 => 32,
        ExpertFormat::Nvfp4 => 16,
        ExpertFormat::Bf16 | ExpertFormat::Fp8Block => 1,
    };
    for (key, dim) in [
        ("hidden_size", c.hidden_size),
        ("moe_intermediate_size", c.moe_intermediate_size),
    ] {
        if !dim.is_multiple_of(block) {
            return Err(invalid(
                key,
                format!("{dim} is not a multiple of the FP4 expert block size {block}"),
            ));
        }
    }
    if let Some(&eos) = c
        .eos_token_ids
        .iter()
        .find(|&&t| t as usize >= c.vocab_size)
    {
        return Err(invalid(
            "eos_token_id",
            format!("{eos} is outside the vocabulary"),
        ));
    }
    Ok(())
}
