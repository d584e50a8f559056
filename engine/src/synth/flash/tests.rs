use super::*;
use crate::{
    config::{Attention, Routing},
    quant,
    synth::{Preset, PresetError},
};

fn flash(layers: usize, experts: usize, format: ExpertFormat) -> ModelConfig {
    Preset::FlashShape(FlashShape::new(layers, experts).unwrap()).config(format)
}

#[test]
fn flash_shape_config_has_v4_flash_dims() {
    for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4, ExpertFormat::Bf16] {
        let json = Preset::parse("flash-shape").unwrap().config_json(format);
        let c = ModelConfig::from_json(&json).unwrap();
        assert_eq!(c.expert_format, format);
        assert_eq!(c.linear_format, LinearFormat::Fp8Block);
        assert_eq!(c.num_layers(), 4);
        assert_eq!(c.n_routed_experts, 16);
        assert_eq!(c.experts_per_token, 6);
        assert_eq!(c.hidden_size, 4096);
        assert_eq!((c.num_heads, c.head_dim, c.rope_dim), (64, 512, 64));
        assert_eq!(c.q_lora_rank, 1024);
        assert_eq!((c.o_groups, c.o_lora_rank), (8, 1024));
        assert_eq!(
            (c.index_n_heads, c.index_head_dim, c.index_topk),
            (64, 128, 512)
        );
        assert_eq!(c.moe_intermediate_size, 2048);
        assert_eq!(c.sliding_window, 128);
        assert_eq!(c.hc_mult, 4);
        assert_eq!(c.hc_sinkhorn_iters, 20);
        assert_eq!(c.vocab_size, 129_280);
        assert_eq!(c.num_nextn_predict_layers, 0);
        assert_eq!(c.max_position_embeddings, 1_048_576);
        assert_eq!(c.eos_token_ids, vec![1]);
        assert!((c.routed_scaling_factor - 1.5).abs() < 1e-6);
        assert!((c.swiglu_limit - 10.0).abs() < 1e-6);
        assert!((c.rope_theta - 10_000.0).abs() < 1e-9);
        assert!((c.compress_rope_theta - 160_000.0).abs() < 1e-9);
        let yarn = c.yarn.unwrap();
        assert!((yarn.factor - 16.0).abs() < 1e-12);
        assert!((yarn.original_max_position_embeddings - 65536.0).abs() < 1e-12);
        assert!((yarn.beta_fast - 32.0).abs() < 1e-12 && (yarn.beta_slow - 1.0).abs() < 1e-12);
        assert_eq!(json["scoring_func"], "sqrtsoftplus");
        assert_eq!(json["topk_method"], "noaux_tc");
        assert_eq!(
            json["quantization_config"]["weight_block_size"],
            json!([128, 128])
        );
        assert_eq!(
            json["quantization_config"].get("moe_quant_algo").is_some(),
            format == ExpertFormat::Nvfp4
        );
    }
}

#[test]
fn compress_ratios_and_hash_layers_are_the_shipped_prefix() {
    // The shipped pattern: layers 0-1 sliding only, even layers from 2 ratio 4, odd layers from
    // 3 ratio 128, layer 42 ratio 4, then 0 for the MTP layer; 3 hash layers.
    let mut shipped = vec![0u64, 0];
    shipped.extend((2..43).map(|i| if i % 2 == 0 { 4 } else { 128 }));
    shipped.push(0);
    assert_eq!(FLASH_COMPRESS_RATIOS.to_vec(), shipped);
    for n in 1..=FLASH_LAYERS {
        let json = FlashShape::new(n, 6).unwrap().config_json();
        assert_eq!(json["compress_ratios"], json!(shipped[..n]));
        assert_eq!(json["num_hash_layers"], json!(n.min(3)));
        let c = flash(n, 6, ExpertFormat::Mxfp4);
        for (i, layer) in c.layers.iter().enumerate() {
            let want = match shipped[i] {
                0 => Attention::Sliding,
                4 => Attention::Csa { ratio: 4 },
                _ => Attention::Hca { ratio: 128 },
            };
            assert_eq!(layer.attention, want, "layer {i} of {n}");
            let routing = if i < 3 { Routing::Hash } else { Routing::TopK };
            assert_eq!(layer.routing, routing, "layer {i} of {n}");
        }
    }
    // The default 4 layers hold every kind: sliding, CSA, HCA, hash and top-k routing.
    let c = flash(4, 16, ExpertFormat::Nvfp4);
    let kinds: Vec<_> = c.layers.iter().map(|l| (l.attention, l.routing)).collect();
    assert_eq!(
        kinds,
        [
            (Attention::Sliding, Routing::Hash),
            (Attention::Sliding, Routing::Hash),
            (Attention::Csa { ratio: 4 }, Routing::Hash),
            (Attention::Hca { ratio: 128 }, Routing::TopK),
        ]
    );
}

#[test]
fn size_options_are_validated() {
    assert_eq!(
        Preset::resolve("flash-shape", None, None).unwrap(),
        Preset::FlashShape(FlashShape::default())
    );
    let p = Preset::resolve("flash-shape", Some(2), Some(6)).unwrap();
    assert_eq!(p, Preset::FlashShape(FlashShape::new(2, 6).unwrap()));
    assert_eq!(
        Preset::resolve("flash-shape", Some(43), Some(256)).unwrap(),
        Preset::FlashShape(FlashShape::new(43, 256).unwrap())
    );
    assert_eq!(Preset::resolve("tiny", None, None).unwrap(), Preset::Tiny);
    assert_eq!(Preset::resolve("small", None, None).unwrap(), Preset::Small);
    let err = |name, l, e| Preset::resolve(name, l, e).unwrap_err();
    assert_eq!(
        err("tiny", Some(2), None),
        PresetError::NotSizable("tiny".into())
    );
    assert_eq!(
        err("small", None, Some(8)),
        PresetError::NotSizable("small".into())
    );
    assert_eq!(err("huge", None, None), PresetError::Unknown("huge".into()));
    assert_eq!(
        err("flash-shape", Some(0), None),
        PresetError::FlashShape(FlashShapeError::Layers(0))
    );
    assert_eq!(
        err("flash-shape", Some(44), None),
        PresetError::FlashShape(FlashShapeError::Layers(44))
    );
    assert_eq!(
        err("flash-shape", None, Some(5)),
        PresetError::FlashShape(FlashShapeError::RoutedExperts(5))
    );
    assert_eq!(
        err("flash-shape", None, Some(257)),
        PresetError::FlashShape(FlashShapeError::RoutedExperts(257))
    );
    let message = err("flash-shape", None, Some(2)).to_string();
    assert!(
        message.contains("--routed-experts") && message.contains('6'),
        "{message}"
    );
    let message = err("flash-shape", Some(0), None).to_string();
    assert!(message.contains("--layers"), "{message}");
}

fn spec(name: &str, shape: [usize; 2], storage: Storage) -> TensorSpec {
    TensorSpec {
        name: name.to_owned(),
        shape: shape.to_vec(),
        storage,
    }
}

/// Decodes the stored tensors of a matrix with the loader's dequantizers.
fn decode(spec: &TensorSpec, stored: &[WriteTensor]) -> Vec<f32> {
    let (rows, cols) = (spec.shape[0], spec.shape[1]);
    let get = |suffix: &str| {
        let name = format!("{}{suffix}", spec.name);
        &stored.iter().find(|t| t.name == name).unwrap().data
    };
    match spec.storage {
        Storage::Bf16 => get("")
            .chunks_exact(2)
            .map(|b| formats::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        Storage::Linear(LinearFormat::Fp8Block) | Storage::Expert(ExpertFormat::Fp8Block) => {
            quant::dequant_fp8_block(get(".weight"), get(".scale"), rows, cols).unwrap()
        }
        Storage::Expert(ExpertFormat::Mxfp4) => {
            quant::dequant_mxfp4(get(".weight"), get(".scale"), rows, cols).unwrap()
        }
        Storage::Expert(ExpertFormat::Nvfp4) => {
            let s2 = f32::from_le_bytes(get(".weight_scale_2")[..4].try_into().unwrap());
            quant::dequant_nvfp4(get(".weight"), get(".weight_scale"), s2, rows, cols).unwrap()
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn direct_codes_are_deterministic_finite_and_scaled() {
    let c = flash(1, 6, ExpertFormat::Nvfp4);
    let cases = [
        spec(
            "layers.0.attn.wq_a",
            [256, 384],
            Storage::Linear(LinearFormat::Fp8Block),
        ),
        spec(
            "layers.0.ffn.experts.1.w1",
            [64, 256],
            Storage::Expert(ExpertFormat::Fp8Block),
        ),
        spec(
            "layers.0.ffn.experts.0.w1",
            [64, 256],
            Storage::Expert(ExpertFormat::Mxfp4),
        ),
        spec(
            "layers.0.ffn.experts.0.w2",
            [64, 512],
            Storage::Expert(ExpertFormat::Nvfp4),
        ),
        spec(
            "layers.0.attn.compressor.wkv.weight",
            [96, 256],
            Storage::Bf16,
        ),
    ];
    for spec in &cases {
        let a = stored_tensors(spec, &c, 5).unwrap();
        assert_eq!(a, stored_tensors(spec, &c, 5).unwrap(), "{}", spec.name);
        assert_ne!(a, stored_tensors(spec, &c, 6).unwrap(), "{}", spec.name);
        // Exactly the stored tensors the schema (and so the loader) expects.
        let want: Vec<_> = schema::files_of(spec)
            .into_iter()
            .map(|(n, shape, dtypes)| (n, shape, dtypes[0].to_owned()))
            .collect();
        let mut got: Vec<_> = a
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.dtype.name().to_owned()))
            .collect();
        got.sort();
        let mut want_sorted = want.clone();
        want_sorted.sort();
        assert_eq!(got, want_sorted);
        let v = decode(spec, &a);
        assert_eq!(v.len(), spec.shape[0] * spec.shape[1]);
        assert!(v.iter().all(|x| x.is_finite()), "{}", spec.name);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let std = (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / n).sqrt();
        let sigma = 1.0 / (spec.shape[1] as f64).sqrt();
        assert!(mean.abs() < 0.1 * sigma, "{}: mean {mean}", spec.name);
        assert!(
            (0.4 * sigma..2.0 * sigma).contains(&std),
            "{}: std {std}, want about {sigma}",
            spec.name
        );
        // Values are spread over many codes and scales, not a handful (MXFP4: e2m1's 15
        // values under two scales).
        let distinct: BTreeSet<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert!(
            distinct.len() > 15,
            "{}: {} values",
            spec.name,
            distinct.len()
        );
    }
    // w1 and w3 of one NVFP4 expert share weight_scale_2.
    let scale_2 = |name: &str| {
        let s = spec(name, [64, 256], Storage::Expert(ExpertFormat::Nvfp4));
        let t = stored_tensors(&s, &c, 5).unwrap();
        t.into_iter()
            .find(|t| t.name.ends_with("weight_scale_2"))
            .unwrap()
            .data
    };
    assert_eq!(
        scale_2("layers.0.ffn.experts.3.w1"),
        scale_2("layers.0.ffn.experts.3.w3")
    );
}

#[test]
fn output_does_not_depend_on_the_thread_count() {
    // 3 MiB of bf16: three random-stream chunks.
    let s = spec("embed.weight", [1536, 1024], Storage::Bf16);
    let c = flash(1, 6, ExpertFormat::Mxfp4);
    let many = stored_tensors(&s, &c, 9).unwrap();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| stored_tensors(&s, &c, 9).unwrap());
    assert_eq!(many, one);
    let v = decode(&s, &many);
    let std = (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!((0.9..1.1).contains(&std), "embedding std {std}");
}

#[test]
fn shard_plan_places_every_tensor_once_and_the_index_names_all() {
    for (layers, experts, format) in [
        (4, 16, ExpertFormat::Nvfp4),
        (1, 6, ExpertFormat::Mxfp4),
        (43, 256, ExpertFormat::Mxfp4),
    ] {
        let c = flash(layers, experts, format);
        let plan = shard_plan(&c);
        let planned: Vec<&str> = plan.iter().flatten().map(|s| s.name.as_str()).collect();
        let specs = schema::tensors(&c);
        let unique: BTreeSet<&str> = planned.iter().copied().collect();
        assert_eq!(unique.len(), planned.len(), "a tensor is in two shards");
        assert_eq!(
            unique,
            specs
                .iter()
                .map(|s| s.name.as_str())
                .collect::<BTreeSet<_>>()
        );
        let map = weight_map(&plan);
        let stored: BTreeSet<String> = specs
            .iter()
            .flat_map(schema::files_of)
            .map(|(n, _, _)| n)
            .collect();
        assert_eq!(map.keys().cloned().collect::<BTreeSet<_>>(), stored);
        let files: BTreeSet<&String> = map.values().collect();
        assert_eq!(files.len(), plan.len(), "every shard is named by the index");
        assert!(plan.len() >= layers + 2);
        assert_eq!(plan[0][0].name, "embed.weight");
        assert_eq!(plan[plan.len() - 1][0].name, "head.weight");
        for shard in &plan {
            let bytes: usize = shard.iter().map(stored_bytes).sum();
            assert!(
                shard.len() == 1 || bytes <= MAX_SHARD_BYTES,
                "{bytes} bytes"
            );
            // A shard holds one layer or only globals.
            let owners: BTreeSet<Option<usize>> = shard.iter().map(|s| layer_of(&s.name)).collect();
            assert_eq!(owners.len(), 1, "{owners:?}");
        }
        if experts == 256 {
            // Full-size layers (~3.4 GB with MXFP4 experts) are split.
            assert!(plan.len() > layers + 2);
        } else {
            assert_eq!(plan.len(), layers + 2);
        }
    }
    assert_eq!(shard_file(0, 6), "model-00001-of-00006.safetensors");
}

#[test]
fn default_flash_shape_is_a_few_gigabytes() {
    let c = flash(4, 16, ExpertFormat::Nvfp4);
    let total: usize = schema::tensors(&c).iter().map(stored_bytes).sum();
    // bf16 embedding and head: 2 x 129280 x 4096 x 2 bytes.
    let globals = 2 * 129_280 * 4096 * 2;
    assert!(total > globals + 4 * 300_000_000, "{total}");
    assert!(total < 4_000_000_000, "{total}");
}

#[test]
#[ignore = "writes a ~2.5 GB checkpoint (bf16 embedding and head at full vocab) and loads it \
            (~6 GB RAM); run by hand: cargo test -p engine --release flash_shape_loads -- --ignored"]
fn flash_shape_loads_and_runs() {
    use crate::model::{Logits, Model};
    for experts in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
        let dir = tempfile::tempdir().unwrap();
        let preset = Preset::FlashShape(FlashShape::new(1, 6).unwrap());
        let options = super::super::GenerateOptions::new(preset, 1, experts, dir.path());
        super::super::generate(&options).unwrap();
        let model = Model::load(dir.path()).unwrap();
        let mut state = model.new_state();
        let logits = model
            .forward(&mut state, &[5, 100, 7], Logits::Last)
            .unwrap();
        assert!(logits[0].iter().all(|v| v.is_finite()));
    }
}
