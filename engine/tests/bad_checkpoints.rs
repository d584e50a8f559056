//! A damaged checkpoint is an error naming what is wrong, never a panic or a partial model:
//! truncated and corrupt files, missing, extra, mis-shaped and mis-typed tensors, non-finite
//! weights, out-of-range expert ids and inconsistent configs.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{collections::BTreeMap, path::Path};

use engine::{
    config::ExpertFormat,
    formats,
    model::Model,
    safetensors::{Dtype, SafetensorsFile, WriteTensor, write},
    synth::{GenerateOptions, Preset, generate},
};

fn tiny(experts: ExpertFormat) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 9, experts, dir.path());
    generate(&options).unwrap();
    dir
}

const SHARD: &str = "model-00001-of-00002.safetensors";

/// Rewrites a shard through `edit`, which may change, add or remove tensors, and updates the
/// index to match (so each test damages only what it means to).
fn rewrite(dir: &Path, shard: &str, edit: impl FnOnce(&mut Vec<WriteTensor>)) {
    rewrite_shard(dir, shard, edit);
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    map.retain(|_, file| file != shard);
    for name in SafetensorsFile::open(dir.join(shard)).unwrap().names() {
        map.insert(name.to_owned(), shard.into());
    }
    std::fs::write(&index_path, index.to_string()).unwrap();
}

/// Rewrites a shard through `edit` and leaves the index as it was.
fn rewrite_shard(dir: &Path, shard: &str, edit: impl FnOnce(&mut Vec<WriteTensor>)) {
    let path = dir.join(shard);
    let mut tensors: Vec<WriteTensor> = {
        let file = SafetensorsFile::open(&path).unwrap();
        file.names()
            .map(|name| {
                let view = file.get(name).unwrap();
                WriteTensor {
                    name: name.to_owned(),
                    dtype: view.dtype,
                    shape: view.shape.to_vec(),
                    data: view.data.to_vec(),
                }
            })
            .collect()
    };
    edit(&mut tensors);
    write(&path, &tensors, &BTreeMap::new()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("damaged checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

fn find<'a>(tensors: &'a mut [WriteTensor], name: &str) -> &'a mut WriteTensor {
    tensors.iter_mut().find(|t| t.name == name).expect(name)
}

#[test]
fn truncated_shard_names_the_tensor() {
    let dir = tiny(ExpertFormat::Bf16);
    let path = dir.path().join(SHARD);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() - 1, bytes.len() / 2, 100, 7, 0] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let msg = load_err(dir.path());
        assert!(msg.contains(SHARD), "cut {cut}: {msg}");
    }
}

#[test]
fn corrupt_header_is_an_error() {
    let dir = tiny(ExpertFormat::Bf16);
    let path = dir.path().join(SHARD);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8] = b'#';
    std::fs::write(&path, &bytes).unwrap();
    let msg = load_err(dir.path());
    assert!(
        msg.contains(SHARD) && msg.to_lowercase().contains("json"),
        "{msg}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let dir = tiny(ExpertFormat::Mxfp4);
    rewrite(dir.path(), SHARD, |t| {
        t.retain(|t| t.name != "layers.1.attn.indexer.wq_b.scale");
    });
    assert_eq!(
        load_err(dir.path()),
        "missing tensor layers.1.attn.indexer.wq_b.scale"
    );
}

#[test]
fn extra_tensor_is_named_and_mtp_is_accepted() {
    let dir = tiny(ExpertFormat::Bf16);
    rewrite(dir.path(), SHARD, |t| {
        t.push(WriteTensor {
            name: "mtp.0.enorm.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![64],
            data: vec![0; 128],
        });
    });
    Model::load(dir.path()).expect("mtp tensors are ignored");
    rewrite(dir.path(), SHARD, |t| {
        t.push(WriteTensor {
            name: "layers.0.attn.wq_c.weight".into(),
            dtype: Dtype::F32,
            shape: vec![1],
            data: vec![0; 4],
        });
    });
    let msg = load_err(dir.path());
    assert!(
        msg.starts_with("unexpected tensor layers.0.attn.wq_c.weight"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_and_dtype_are_named() {
    let dir = tiny(ExpertFormat::Bf16);
    rewrite(dir.path(), SHARD, |t| {
        let norm = find(t, "layers.0.attn.q_norm.weight");
        norm.shape = vec![16, 2];
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("layers.0.attn.q_norm.weight") && msg.contains("shape [16, 2]"),
        "{msg}"
    );

    let dir = tiny(ExpertFormat::Bf16);
    rewrite(dir.path(), SHARD, |t| {
        let sink = find(t, "layers.0.attn.attn_sink");
        sink.dtype = Dtype::I32;
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("layers.0.attn.attn_sink") && msg.contains("dtype I32"),
        "{msg}"
    );
}

#[test]
fn non_finite_norm_weight_is_refused() {
    let dir = tiny(ExpertFormat::Bf16);
    rewrite(dir.path(), SHARD, |t| {
        let norm = find(t, "layers.1.ffn_norm.weight");
        let nan = formats::f32_to_bf16(f32::NAN).to_le_bytes();
        norm.data[6..8].copy_from_slice(&nan);
    });
    assert_eq!(
        load_err(dir.path()),
        "tensor layers.1.ffn_norm.weight: non-finite value at index 3"
    );
}

#[test]
fn nan_fp8_code_is_refused() {
    let dir = tiny(ExpertFormat::Nvfp4);
    rewrite(dir.path(), SHARD, |t| {
        let w = find(t, "layers.0.attn.wkv.weight");
        w.data[0] = 0x7F;
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("layers.0.attn.wkv.weight") && msg.contains("non-finite"),
        "{msg}"
    );
}

#[test]
fn expert_id_out_of_range_is_refused() {
    let dir = tiny(ExpertFormat::Bf16);
    rewrite(dir.path(), SHARD, |t| {
        let ids = find(t, "layers.0.ffn.gate.tid2eid");
        ids.data[4..8].copy_from_slice(&99i32.to_le_bytes());
    });
    let msg = load_err(dir.path());
    assert!(msg.contains("tid2eid") && msg.contains("99"), "{msg}");
}

#[test]
fn config_that_disagrees_with_weights_is_refused() {
    let dir = tiny(ExpertFormat::Mxfp4);
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace(
            "\"moe_intermediate_size\": 32",
            "\"moe_intermediate_size\": 64",
        ),
    )
    .unwrap();
    let msg = load_err(dir.path());
    assert!(msg.contains("shape"), "{msg}");
    std::fs::write(&path, "{\"model_type\": \"llama\"}").unwrap();
    assert!(load_err(dir.path()).contains("unsupported architecture"));
    std::fs::write(&path, "{not json").unwrap();
    assert!(load_err(dir.path()).contains("not valid JSON"));
}

const SHARD_2: &str = "model-00002-of-00002.safetensors";

fn index_err(dir: &Path) -> String {
    let msg = load_err(dir);
    assert!(msg.contains("model.safetensors.index.json"), "{msg}");
    msg
}

#[test]
fn index_naming_a_missing_shard_is_refused() {
    let dir = tiny(ExpertFormat::Mxfp4);
    std::fs::remove_file(dir.path().join(SHARD_2)).unwrap();
    let msg = index_err(dir.path());
    assert!(
        msg.contains(SHARD_2) && msg.contains("not in the folder"),
        "{msg}"
    );
}

#[test]
fn tensor_moved_to_another_shard_than_the_index_says_is_refused() {
    let dir = tiny(ExpertFormat::Mxfp4);
    let mut moved = None;
    rewrite_shard(dir.path(), SHARD, |t| {
        let i = t.iter().position(|t| t.name == "norm.weight").unwrap();
        moved = Some(t.remove(i));
    });
    rewrite_shard(dir.path(), SHARD_2, |t| t.push(moved.take().unwrap()));
    let msg = index_err(dir.path());
    assert!(
        msg.contains("norm.weight") && msg.contains(SHARD) && msg.contains(SHARD_2),
        "{msg}"
    );
}

#[test]
fn tensor_missing_from_the_index_or_its_shard_is_refused() {
    let dir = tiny(ExpertFormat::Nvfp4);
    rewrite_shard(dir.path(), SHARD, |t| {
        t.retain(|t| t.name != "layers.0.attn.wkv.scale");
    });
    let msg = index_err(dir.path());
    assert!(
        msg.contains("layers.0.attn.wkv.scale") && msg.contains("does not hold it"),
        "{msg}"
    );
    let dir = tiny(ExpertFormat::Nvfp4);
    rewrite_shard(dir.path(), SHARD, |t| {
        let mut extra = find(t, "norm.weight").clone();
        extra.name = "norm.extra".into();
        t.push(extra);
    });
    let msg = index_err(dir.path());
    assert!(
        msg.contains("norm.extra") && msg.contains("does not list"),
        "{msg}"
    );
}

#[test]
fn stray_shard_and_bad_index_are_refused() {
    let dir = tiny(ExpertFormat::Mxfp4);
    std::fs::copy(
        dir.path().join(SHARD_2),
        dir.path().join("model-00003-of-00003.safetensors"),
    )
    .unwrap();
    // The copy duplicates every tensor of shard 2: named as a duplicate before the index.
    let msg = load_err(dir.path());
    assert!(msg.contains("appears in both"), "{msg}");
    let dir = tiny(ExpertFormat::Mxfp4);
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index, "{\"weight_map\": [}").unwrap();
    assert!(index_err(dir.path()).contains("not valid JSON"));
    std::fs::write(
        &index,
        "{\"weight_map\": {\"norm.weight\": \"../x.safetensors\"}}",
    )
    .unwrap();
    assert!(index_err(dir.path()).contains("not a shard file name"));
}

#[test]
fn a_tensor_in_two_shards_is_refused() {
    let dir = tiny(ExpertFormat::Bf16);
    let mut copy = None;
    rewrite_shard(dir.path(), SHARD, |t| {
        copy = Some(find(t, "norm.weight").clone());
    });
    rewrite_shard(dir.path(), SHARD_2, |t| t.push(copy.take().unwrap()));
    let msg = load_err(dir.path());
    assert!(
        msg.contains("norm.weight") && msg.contains(SHARD) && msg.contains(SHARD_2),
        "{msg}"
    );
}

#[test]
fn bad_scales_are_refused() {
    // An FP8 scale of the wrong shape, an NVFP4 block scale that is NaN, an MXFP4 scale that
    // is NaN, a missing NVFP4 global scale: each named.
    let dir = tiny(ExpertFormat::Nvfp4);
    rewrite(dir.path(), SHARD, |t| {
        let s = find(t, "layers.0.attn.wq_a.scale");
        s.shape = vec![s.data.len()];
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("layers.0.attn.wq_a.scale") && msg.contains("shape"),
        "{msg}"
    );
    let dir = tiny(ExpertFormat::Nvfp4);
    rewrite(dir.path(), SHARD, |t| {
        find(t, "layers.0.ffn.experts.1.w2.weight_scale").data[5] = 0x7F;
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("layers.0.ffn.experts.1.w2.weight") && msg.contains("non-finite"),
        "{msg}"
    );
    let dir = tiny(ExpertFormat::Nvfp4);
    rewrite(dir.path(), SHARD, |t| {
        t.retain(|t| t.name != "layers.0.ffn.experts.0.w1.weight_scale_2");
    });
    assert_eq!(
        load_err(dir.path()),
        "missing tensor layers.0.ffn.experts.0.w1.weight_scale_2"
    );
    let dir = tiny(ExpertFormat::Mxfp4);
    rewrite(dir.path(), SHARD, |t| {
        find(t, "layers.0.ffn.experts.3.w1.scale").data[2] = 0xFF;
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("layers.0.ffn.experts.3.w1.weight") && msg.contains("non-finite"),
        "{msg}"
    );
}
