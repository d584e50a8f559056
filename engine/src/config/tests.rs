use serde_json::{Value, json};

use super::*;

/// `deepseek-ai/DeepSeek-V4-Flash` (April preview) config.json as shipped: 43 layers, one MTP
/// layer, so `compress_ratios` has 44 entries.
fn flash() -> Value {
    let mut ratios = vec![0, 0];
    for i in 2..43 {
        ratios.push(if i % 2 == 0 { 4 } else { 128 });
    }
    ratios.push(0);
    let mut v: Value = serde_json::from_str(
        r#"{
      "architectures": ["DeepseekV4ForCausalLM"],
      "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 0, "eos_token_id": 1,
      "expert_dtype": "fp4",
      "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
      "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096,
      "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
      "initializer_range": 0.02, "max_position_embeddings": 1048576,
      "model_type": "deepseek_v4", "moe_intermediate_size": 2048,
      "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
      "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
      "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1,
      "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
      "rms_norm_eps": 1e-06,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                       "original_max_position_embeddings": 65536, "type": "yarn"},
      "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
      "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": false,
      "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
      "use_cache": true, "vocab_size": 129280, "compress_rope_theta": 160000,
      "compress_ratios": []
    }"#,
    )
    .unwrap();
    v["compress_ratios"] = json!(ratios);
    v
}

fn with(mut v: Value, key: &str, value: Value) -> Value {
    v[key] = value;
    v
}

fn without(mut v: Value, key: &str) -> Value {
    v.as_object_mut().unwrap().remove(key);
    v
}

#[test]
fn official_flash_config() {
    let c = ModelConfig::from_json(&flash()).unwrap();
    assert_eq!(c.num_layers(), 43);
    assert_eq!(c.rope_dim, 64);
    assert_eq!(c.layers[0].attention, Attention::Sliding);
    assert_eq!(c.layers[1].attention, Attention::Sliding);
    assert_eq!(c.layers[2].attention, Attention::Csa { ratio: 4 });
    assert_eq!(c.layers[3].attention, Attention::Hca { ratio: 128 });
    assert_eq!(c.layers[42].attention, Attention::Csa { ratio: 4 });
    assert_eq!(c.layers[2].routing, Routing::Hash);
    assert_eq!(c.layers[3].routing, Routing::TopK);
    assert_eq!(c.linear_format, LinearFormat::Fp8Block);
    assert_eq!(c.expert_format, ExpertFormat::Mxfp4);
    assert_eq!(c.eos_token_ids, vec![1]);
    assert_eq!(c.hc_mix_dim(), 24);
    let yarn = c.yarn.unwrap();
    assert!((yarn.factor - 16.0).abs() < 1e-12);
    assert!((yarn.original_max_position_embeddings - 65536.0).abs() < 1e-12);
    assert!((c.rope_theta - 10_000.0).abs() < 1e-9);
    assert!((c.compress_rope_theta - 160_000.0).abs() < 1e-9);
}

#[test]
fn nvfp4_from_config_or_hf_quant_config() {
    let mut v = flash();
    v["quantization_config"]["moe_quant_algo"] = json!("NVFP4");
    assert_eq!(
        ModelConfig::from_json(&v).unwrap().expert_format,
        ExpertFormat::Nvfp4
    );

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), flash().to_string()).unwrap();
    std::fs::write(
        dir.path().join("hf_quant_config.json"),
        json!({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"layers.0.ffn.experts.0.w1": {"quant_algo": "NVFP4", "group_size": 16}}}})
        .to_string(),
    )
    .unwrap();
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(c.expert_format, ExpertFormat::Nvfp4);
}

#[test]
fn transformers_spelling_matches_native() {
    let native = ModelConfig::from_json(&flash()).unwrap();
    let types: Vec<&str> = native
        .layers
        .iter()
        .map(|l| match l.attention {
            Attention::Sliding => "sliding_attention",
            Attention::Csa { .. } => "compressed_sparse_attention",
            Attention::Hca { .. } => "heavily_compressed_attention",
        })
        .collect();
    let mlp: Vec<&str> = native
        .layers
        .iter()
        .map(|l| match l.routing {
            Routing::Hash => "hash_moe",
            Routing::TopK => "moe",
        })
        .collect();
    let mut v = flash();
    for key in [
        "compress_ratios",
        "num_hash_layers",
        "qk_rope_head_dim",
        "rope_scaling",
    ] {
        v = without(v, key);
    }
    v["layer_types"] = json!(types);
    v["mlp_layer_types"] = json!(mlp);
    v["compress_rates"] =
        json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128});
    v["partial_rotary_factor"] = json!(0.125);
    v["rope_parameters"] = json!({
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "rope_theta": 160_000.0, "factor": 16,
                     "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
                     "attention_factor": 1.0, "partial_rotary_factor": 0.125}
    });
    let tf = ModelConfig::from_json(&v).unwrap();
    assert_eq!(tf, native);
}

fn err(v: &Value) -> String {
    ModelConfig::from_json(v).unwrap_err().to_string()
}

#[test]
fn unknown_architecture_is_refused() {
    let msg = err(&with(flash(), "model_type", json!("deepseek_v3")));
    assert!(
        msg.contains("unsupported architecture") && msg.contains("deepseek_v3"),
        "{msg}"
    );
    let msg = err(&with(flash(), "architectures", json!(["LlamaForCausalLM"])));
    assert!(msg.contains("LlamaForCausalLM"), "{msg}");
    assert!(err(&json!([1, 2])).contains("object"));
}

#[test]
fn inconsistent_fields_are_refused() {
    let cases: Vec<(Value, &str)> = vec![
        (
            with(flash(), "compress_ratios", json!([0, 4])),
            "compress_ratios",
        ),
        (
            with(flash(), "compress_ratios", json!(vec![3; 43])),
            "entries must be 0, 4 or 128",
        ),
        (
            with(flash(), "num_hash_layers", json!(50)),
            "num_hash_layers",
        ),
        (
            with(flash(), "qk_rope_head_dim", json!(1024)),
            "qk_rope_head_dim",
        ),
        (
            with(flash(), "qk_rope_head_dim", json!(63)),
            "qk_rope_head_dim",
        ),
        (with(flash(), "o_groups", json!(7)), "o_groups"),
        (
            with(flash(), "num_experts_per_tok", json!(300)),
            "num_experts_per_tok",
        ),
        (
            with(flash(), "num_key_value_heads", json!(8)),
            "num_key_value_heads",
        ),
        (
            with(flash(), "n_shared_experts", json!(2)),
            "n_shared_experts",
        ),
        (
            with(flash(), "scoring_func", json!("softmax")),
            "scoring_func",
        ),
        (
            with(flash(), "hidden_size", json!(4100)),
            "FP4 expert block",
        ),
        (
            with(flash(), "eos_token_id", json!(200_000)),
            "eos_token_id",
        ),
        (with(flash(), "hidden_size", json!("big")), "hidden_size"),
        (without(flash(), "head_dim"), "missing `head_dim`"),
        (with(flash(), "expert_dtype", json!("int3")), "expert_dtype"),
        (
            with(
                flash(),
                "rope_scaling",
                json!({"type": "longrope", "factor": 2}),
            ),
            "rope type",
        ),
        (
            with(
                flash(),
                "quantization_config",
                json!({"quant_method": "fp8", "weight_block_size": [64, 64]}),
            ),
            "weight_block_size",
        ),
        (
            with(flash(), "tie_word_embeddings", json!(true)),
            "tie_word_embeddings",
        ),
    ];
    for (value, needle) in cases {
        let msg = err(&value);
        assert!(msg.contains(needle), "expected {needle:?} in {msg:?}");
    }
}

#[test]
fn unquantized_config_is_bf16() {
    let v = without(without(flash(), "quantization_config"), "expert_dtype");
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(c.linear_format, LinearFormat::Bf16);
    assert_eq!(c.expert_format, ExpertFormat::Bf16);
    let v = without(flash(), "quantization_config");
    assert!(err(&v).contains("expert_dtype"));
}

#[test]
fn draft_stages_from_nextn_or_dspark_targets() {
    let c = ModelConfig::from_json(&flash()).unwrap();
    assert_eq!(c.draft_layers, vec![Attention::Sliding]);

    // The 0731 checkpoints list three DSpark stages and one ratio per layer and stage.
    let mut v = with(flash(), "dspark_target_layer_ids", json!([10, 20, 30]));
    let mut ratios = v["compress_ratios"].as_array().unwrap().clone();
    ratios.extend([json!(0), json!(0)]);
    v["compress_ratios"] = json!(ratios);
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(c.num_layers(), 43);
    assert_eq!(c.draft_layers, vec![Attention::Sliding; 3]);

    // One ratio per decoder layer only is also accepted; the stages are sliding.
    let mut v = with(flash(), "dspark_target_layer_ids", json!([10, 20]));
    let ratios = v["compress_ratios"].as_array().unwrap()[..43].to_vec();
    v["compress_ratios"] = json!(ratios);
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(c.draft_layers, vec![Attention::Sliding; 2]);
}

#[test]
fn draft_stage_counts_that_disagree_are_refused() {
    // 44 ratios but three stages: neither 43 nor 46.
    let v = with(flash(), "dspark_target_layer_ids", json!([10, 20, 30]));
    let e = err(&v);
    assert!(
        e.contains("compress_ratios") && e.contains("draft stages"),
        "{e}"
    );
    let v = with(flash(), "dspark_target_layer_ids", json!("10,20"));
    assert!(err(&v).contains("dspark_target_layer_ids"));
    let v = with(flash(), "dspark_target_layer_ids", json!([-1]));
    assert!(err(&v).contains("dspark_target_layer_ids"));
}
