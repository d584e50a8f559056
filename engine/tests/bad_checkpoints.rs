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
    generate(&GenerateOptions {
        preset: Preset::Tiny,
        seed: 9,
        experts,
        out: dir.path().to_path_buf(),
        tokenizer_dir: None,
    })
    .unwrap();
    dir
}

const SHARD: &str = "model-00001-of-00002.safetensors";

/// Rewrites a shard through `edit`, which may change, add or remove tensors.
fn rewrite(dir: &Path, shard: &str, edit: impl FnOnce(&mut Vec<WriteTensor>)) {
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
