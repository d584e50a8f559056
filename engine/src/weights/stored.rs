//! Weights exactly as stored, gathered for device backends that upload them (the CPU
//! model reads the same bytes in place through `tensor::Weight`; a device keeps 4-bit experts and bf16
//! matrices). The routed experts are read one layer at a time so a backend can upload a layer
//! and drop the host copy.

use std::path::Path;

use super::{Checkpoint, LoadError};
use crate::{
    config::{ExpertFormat, ModelConfig},
    schema::{self, Storage},
};

/// A bf16 tensor of the checkpoint (e.g. `head.weight`) as raw bits, row-major, checked
/// against the shape and dtype the configuration expects.
pub fn stored_bf16(dir: &Path, config: &ModelConfig, name: &str) -> Result<Vec<u16>, LoadError> {
    let spec = schema::tensors(config)
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| LoadError::Missing(name.to_owned()))?;
    if spec.storage != Storage::Bf16 {
        return Err(LoadError::Decode {
            name: name.to_owned(),
            message: format!("stored as {:?}, not bf16", spec.storage),
        });
    }
    let checkpoint = Checkpoint::open(dir)?;
    let (file, shape, dtypes) = &schema::files_of(&spec)[0];
    let view = checkpoint.checked(file, shape, dtypes)?;
    Ok(view
        .data
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect())
}

/// A dense linear `[rows, cols]` as stored in the checkpoint's linear format.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredLinear {
    /// bf16 bits, row-major.
    Bf16 {
        rows: usize,
        cols: usize,
        bits: Vec<u16>,
    },
    /// e4m3 codes, row-major, with ue8m0 scales per 128x128 tile
    /// (`[ceil(rows/128), ceil(cols/128)]`).
    Fp8Block {
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<u8>,
    },
}

/// The linear `name` (e.g. `layers.0.ffn.shared_experts.w1`, or a 2-D bf16 tensor such as
/// `layers.0.attn.compressor.wkv.weight`) of an opened checkpoint as stored.
pub fn stored_linear(
    checkpoint: &Checkpoint,
    config: &ModelConfig,
    name: &str,
) -> Result<StoredLinear, LoadError> {
    let spec = schema::tensors(config)
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| LoadError::Missing(name.to_owned()))?;
    let (rows, cols) = (spec.shape[0], spec.shape.get(1).copied().unwrap_or(1));
    let parts = schema::files_of(&spec);
    let views = parts
        .iter()
        .map(|(n, shape, dtypes)| checkpoint.checked(n, shape, dtypes))
        .collect::<Result<Vec<_>, _>>()?;
    match spec.storage {
        Storage::Linear(crate::config::LinearFormat::Bf16) | Storage::Bf16
            if spec.shape.len() == 2 =>
        {
            Ok(StoredLinear::Bf16 {
                rows,
                cols,
                bits: views[0]
                    .data
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            })
        }
        Storage::Linear(crate::config::LinearFormat::Fp8Block) => Ok(StoredLinear::Fp8Block {
            rows,
            cols,
            codes: views[0].data.to_vec(),
            scales: views[1].data.to_vec(),
        }),
        other => Err(LoadError::Decode {
            name: name.to_owned(),
            message: format!("stored as {other:?}, not a dense linear"),
        }),
    }
}

/// One projection (`w1`, `w2` or `w3`) of every routed expert of a layer, stacked
/// `[experts, rows, cols]` in the checkpoint's FP4 format.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp4Stack {
    /// `ExpertFormat::Nvfp4` or `ExpertFormat::Mxfp4`.
    pub format: ExpertFormat,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// Two e2m1 codes per byte, low nibble first, `experts * rows * cols / 2` bytes.
    pub packed: Vec<u8>,
    /// e4m3 per 16 (NVFP4) or ue8m0 per 32 (MXFP4) values.
    pub scales: Vec<u8>,
    /// NVFP4: each expert's global scale (`weight_scale_2`); empty for MXFP4.
    pub scale_2: Vec<f32>,
}

/// The routed experts of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerFp4Experts {
    pub layer: usize,
    /// Gate `[experts, inter, hidden]`.
    pub w1: Fp4Stack,
    /// Down `[experts, hidden, inter]`.
    pub w2: Fp4Stack,
    /// Up `[experts, inter, hidden]`.
    pub w3: Fp4Stack,
}

/// Calls `each` with every layer's routed experts in their stored FP4 form, in layer order.
/// `Ok(false)` without calling it when the checkpoint's experts are not FP4.
pub fn for_each_fp4_layer(
    dir: &Path,
    config: &ModelConfig,
    each: &mut dyn FnMut(LayerFp4Experts) -> Result<(), String>,
) -> Result<bool, LoadError> {
    let format = config.expert_format;
    if !matches!(format, ExpertFormat::Nvfp4 | ExpertFormat::Mxfp4) {
        return Ok(false);
    }
    let checkpoint = Checkpoint::open(dir)?;
    let specs: std::collections::BTreeMap<String, schema::TensorSpec> = schema::tensors(config)
        .into_iter()
        .map(|s| (s.name.clone(), s))
        .collect();
    let (d, inter, e) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
    );
    for layer in 0..config.num_layers() {
        let stack = |w: &str, rows: usize, cols: usize| -> Result<Fp4Stack, LoadError> {
            let mut out = Fp4Stack {
                format,
                experts: e,
                rows,
                cols,
                packed: Vec::with_capacity(e * rows * cols / 2),
                scales: Vec::new(),
                scale_2: Vec::new(),
            };
            for x in 0..e {
                let name = format!("{}ffn.experts.{x}.{w}", schema::layer(layer));
                let spec = specs
                    .get(&name)
                    .ok_or_else(|| LoadError::Missing(name.clone()))?;
                if spec.storage != Storage::Expert(format) || spec.shape != [rows, cols] {
                    return Err(LoadError::Missing(format!(
                        "{name} as {format:?} {rows}x{cols}"
                    )));
                }
                let parts = schema::files_of(spec);
                let views = parts
                    .iter()
                    .map(|(n, shape, dtypes)| checkpoint.checked(n, shape, dtypes))
                    .collect::<Result<Vec<_>, _>>()?;
                out.packed.extend_from_slice(views[0].data);
                out.scales.extend_from_slice(views[1].data);
                if format == ExpertFormat::Nvfp4 {
                    let scale_2 = super::scalar_f32(&views[2])
                        .filter(|s| s.is_finite())
                        .ok_or_else(|| LoadError::Decode {
                            name: parts[2].0.clone(),
                            message: "bad weight_scale_2".into(),
                        })?;
                    out.scale_2.push(scale_2);
                }
            }
            Ok(out)
        };
        let experts = LayerFp4Experts {
            layer,
            w1: stack("w1", inter, d)?,
            w2: stack("w2", d, inter)?,
            w3: stack("w3", inter, d)?,
        };
        each(experts).map_err(|message| LoadError::Decode {
            name: format!("{}ffn.experts", schema::layer(layer)),
            message,
        })?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{GenerateOptions, Preset, generate};

    /// The stored codes decode to exactly the f32 weights the CPU reference loaded.
    #[test]
    fn stored_experts_match_the_loaded_weights() {
        for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
            let dir = tempfile::tempdir().unwrap();
            generate(&GenerateOptions {
                preset: Preset::Tiny,
                seed: 3,
                experts: format,
                out: dir.path().to_path_buf(),
                tokenizer_dir: None,
            })
            .unwrap();
            let model = crate::model::Model::load(dir.path()).unwrap();
            let mut layers = 0;
            let fp4 = for_each_fp4_layer(dir.path(), &model.config, &mut |l| {
                let experts = &model.weights.layers[l.layer].moe.experts;
                for (stack, pick) in [(&l.w1, 0usize), (&l.w2, 1), (&l.w3, 2)] {
                    let per = stack.rows * stack.cols;
                    let block = if format == ExpertFormat::Nvfp4 {
                        16
                    } else {
                        32
                    };
                    for (x, expert) in experts.iter().enumerate() {
                        let want = [&expert.w1, &expert.w2, &expert.w3][pick];
                        let codes = &stack.packed[x * per / 2..(x + 1) * per / 2];
                        let scales = &stack.scales[x * per / block..(x + 1) * per / block];
                        let got = match format {
                            ExpertFormat::Nvfp4 => crate::quant::dequant_nvfp4(
                                codes,
                                scales,
                                stack.scale_2[x],
                                stack.rows,
                                stack.cols,
                            ),
                            _ => crate::quant::dequant_mxfp4(codes, scales, stack.rows, stack.cols),
                        }
                        .map_err(|e| e.to_string())?;
                        if got != want.to_f32() {
                            return Err(format!("layer {} expert {x} differs", l.layer));
                        }
                    }
                }
                layers += 1;
                Ok(())
            })
            .unwrap();
            assert!(fp4);
            assert_eq!(layers, model.config.num_layers());
        }
    }

    #[test]
    fn stored_head_decodes_to_the_loaded_head() {
        let dir = tempfile::tempdir().unwrap();
        generate(&GenerateOptions {
            preset: Preset::Tiny,
            seed: 3,
            experts: ExpertFormat::Mxfp4,
            out: dir.path().to_path_buf(),
            tokenizer_dir: None,
        })
        .unwrap();
        let model = crate::model::Model::load(dir.path()).unwrap();
        let bits = stored_bf16(dir.path(), &model.config, "head.weight").unwrap();
        assert_eq!(
            crate::formats::bf16_slice_to_f32(&bits),
            model.weights.head.to_f32()
        );
        let err = stored_bf16(dir.path(), &model.config, "hc_head_fn").unwrap_err();
        assert!(err.to_string().contains("not bf16"), "{err}");
    }

    /// Both linear formats decode to exactly the loaded shared expert (FP4-expert checkpoints
    /// store linears as FP8 blocks, bf16-expert ones as bf16).
    #[test]
    fn stored_linears_decode_to_the_loaded_weights() {
        for experts in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
            let dir = tempfile::tempdir().unwrap();
            generate(&GenerateOptions {
                preset: Preset::Tiny,
                seed: 3,
                experts,
                out: dir.path().to_path_buf(),
                tokenizer_dir: None,
            })
            .unwrap();
            let model = crate::model::Model::load(dir.path()).unwrap();
            let name = format!("{}ffn.shared_experts.w2", schema::layer(1));
            let checkpoint = Checkpoint::open(dir.path()).unwrap();
            let decoded = match stored_linear(&checkpoint, &model.config, &name).unwrap() {
                StoredLinear::Bf16 { bits, .. } => crate::formats::bf16_slice_to_f32(&bits),
                StoredLinear::Fp8Block {
                    rows,
                    cols,
                    codes,
                    scales,
                } => crate::quant::dequant_fp8_block(&codes, &scales, rows, cols).unwrap(),
            };
            assert_eq!(
                decoded,
                model.weights.layers[1].moe.shared.w2.to_f32(),
                "{experts:?}"
            );
            let err = stored_linear(&checkpoint, &model.config, "norm.weight").unwrap_err();
            assert!(err.to_string().contains("not a dense linear"), "{err}");
            // A 2-D bf16 tensor outside the linear format (the indexer's head weights).
            let (l, indexer) = model
                .weights
                .layers
                .iter()
                .enumerate()
                .find_map(|(l, w)| w.attn.indexer.as_ref().map(|i| (l, i)))
                .unwrap();
            let name = format!("{}attn.indexer.weights_proj.weight", schema::layer(l));
            match stored_linear(&checkpoint, &model.config, &name).unwrap() {
                StoredLinear::Bf16 { bits, .. } => assert_eq!(
                    crate::formats::bf16_slice_to_f32(&bits),
                    indexer.weights_proj.to_f32()
                ),
                other @ StoredLinear::Fp8Block { .. } => panic!("{other:?}"),
            }
            let err = stored_linear(&checkpoint, &model.config, "hc_head_fn").unwrap_err();
            assert!(err.to_string().contains("not a dense linear"), "{err}");
        }
    }

    #[test]
    fn non_fp4_experts_are_reported_as_such() {
        let dir = tempfile::tempdir().unwrap();
        generate(&GenerateOptions {
            preset: Preset::Tiny,
            seed: 3,
            experts: ExpertFormat::Bf16,
            out: dir.path().to_path_buf(),
            tokenizer_dir: None,
        })
        .unwrap();
        let config = crate::config::ModelConfig::from_dir(dir.path()).unwrap();
        let called = for_each_fp4_layer(dir.path(), &config, &mut |_| Err("called".into()));
        assert!(!called.unwrap());
    }
}
