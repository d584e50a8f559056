//! Weights exactly as stored, borrowed from the checkpoint's mapping for device backends that
//! upload them: nothing is copied or widened on the host (the CPU model reads the same bytes in
//! place through `tensor::Weight`). A backend uploads a layer at a time and then
//! [`StoredWeights::release_resident`] drops the pages it read, so its host footprint stays the
//! mapping's untouched remainder plus one layer.

use std::{collections::BTreeMap, path::Path};

use super::{Checkpoint, LoadError};
use crate::{
    config::{ExpertFormat, LinearFormat, ModelConfig},
    schema::{self, Storage, TensorSpec},
};

/// A dense linear `[rows, cols]` as stored in the checkpoint's linear format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StoredLinear<'a> {
    /// bf16, little-endian, row-major (`2 * rows * cols` bytes).
    Bf16 {
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    },
    /// e4m3 codes, row-major, with ue8m0 scales per 128x128 tile
    /// (`[ceil(rows/128), ceil(cols/128)]`).
    Fp8Block {
        rows: usize,
        cols: usize,
        codes: &'a [u8],
        scales: &'a [u8],
    },
}

impl StoredLinear<'_> {
    pub fn shape(&self) -> (usize, usize) {
        match *self {
            Self::Bf16 { rows, cols, .. } | Self::Fp8Block { rows, cols, .. } => (rows, cols),
        }
    }

    /// Bytes as stored (codes and scales).
    pub fn stored_bytes(&self) -> usize {
        match self {
            Self::Bf16 { bytes, .. } => bytes.len(),
            Self::Fp8Block { codes, scales, .. } => codes.len() + scales.len(),
        }
    }
}

/// One routed expert's projection in its FP4 form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp4Expert<'a> {
    /// Two e2m1 codes per byte, low nibble first, `rows * cols / 2` bytes.
    pub packed: &'a [u8],
    /// e4m3 per 16 (NVFP4) or ue8m0 per 32 (MXFP4) values.
    pub scales: &'a [u8],
    /// NVFP4's global scale (`weight_scale_2`); `None` for MXFP4.
    pub scale_2: Option<f32>,
}

/// One projection (`w1`, `w2` or `w3`) of every routed expert of a layer, each `[rows, cols]`
/// in the checkpoint's FP4 format, in expert order.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp4Stack<'a> {
    /// `ExpertFormat::Nvfp4` or `ExpertFormat::Mxfp4`.
    pub format: ExpertFormat,
    pub rows: usize,
    pub cols: usize,
    pub experts: Vec<Fp4Expert<'a>>,
}

impl Fp4Stack<'_> {
    /// Values per scale byte.
    pub fn block(&self) -> usize {
        if self.format == ExpertFormat::Nvfp4 {
            16
        } else {
            32
        }
    }

    /// Packed bytes of one expert.
    pub fn packed_per_expert(&self) -> usize {
        self.rows * self.cols / 2
    }

    /// Scale bytes of one expert.
    pub fn scales_per_expert(&self) -> usize {
        self.rows * self.cols / self.block()
    }

    /// Bytes as stored, every expert (codes, scales and global scales).
    pub fn stored_bytes(&self) -> usize {
        let scale_2 = if self.format == ExpertFormat::Nvfp4 {
            4
        } else {
            0
        };
        self.experts.len() * (self.packed_per_expert() + self.scales_per_expert() + scale_2)
    }

    /// The experts stacked `[experts, rows, cols]` into owned buffers (packed, scales, global
    /// scales), for CPU references that take one contiguous stack.
    pub fn concat(&self) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
        let mut packed = Vec::with_capacity(self.experts.len() * self.packed_per_expert());
        let mut scales = Vec::with_capacity(self.experts.len() * self.scales_per_expert());
        let mut scale_2 = Vec::new();
        for e in &self.experts {
            packed.extend_from_slice(e.packed);
            scales.extend_from_slice(e.scales);
            scale_2.extend(e.scale_2);
        }
        (packed, scales, scale_2)
    }
}

/// The routed experts of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerFp4Experts<'a> {
    pub layer: usize,
    /// Gate `[inter, hidden]` per expert.
    pub w1: Fp4Stack<'a>,
    /// Down `[hidden, inter]` per expert.
    pub w2: Fp4Stack<'a>,
    /// Up `[inter, hidden]` per expert.
    pub w3: Fp4Stack<'a>,
}

/// An opened checkpoint with the tensor list of its configuration, handing out tensors as
/// stored (dtype and shape checked against that list).
#[derive(Debug)]
pub struct StoredWeights {
    checkpoint: Checkpoint,
    specs: BTreeMap<String, TensorSpec>,
    expert_format: ExpertFormat,
    layers: usize,
    hidden: usize,
    inter: usize,
    experts: usize,
}

impl StoredWeights {
    /// Maps the checkpoint at `dir` (headers validated) for the configuration `config`.
    pub fn open(dir: &Path, config: &ModelConfig) -> Result<Self, LoadError> {
        Ok(Self {
            checkpoint: Checkpoint::open(dir)?,
            specs: schema::tensors(config)
                .into_iter()
                .map(|s| (s.name.clone(), s))
                .collect(),
            expert_format: config.expert_format,
            layers: config.num_layers(),
            hidden: config.hidden_size,
            inter: config.moe_intermediate_size,
            experts: config.n_routed_experts,
        })
    }

    /// Whether the routed experts are stored in an FP4 format (NVFP4 or MXFP4).
    pub fn has_fp4_experts(&self) -> bool {
        matches!(
            self.expert_format,
            ExpertFormat::Nvfp4 | ExpertFormat::Mxfp4
        )
    }

    /// Whether the configuration has a tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.specs.contains_key(name)
    }

    fn spec(&self, name: &str) -> Result<&TensorSpec, LoadError> {
        self.specs
            .get(name)
            .ok_or_else(|| LoadError::Missing(name.to_owned()))
    }

    /// The files of `spec` (data, then scales), each checked for dtype and shape.
    fn parts(&self, spec: &TensorSpec) -> Result<Vec<&[u8]>, LoadError> {
        schema::files_of(spec)
            .iter()
            .map(|(n, shape, dtypes)| Ok(self.checkpoint.checked(n, shape, dtypes)?.data))
            .collect()
    }

    /// A bf16 tensor (e.g. `head.weight`): little-endian bits, row-major.
    pub fn bf16(&self, name: &str) -> Result<&[u8], LoadError> {
        let spec = self.spec(name)?;
        if spec.storage != Storage::Bf16 {
            return Err(LoadError::Decode {
                name: name.to_owned(),
                message: format!("stored as {:?}, not bf16", spec.storage),
            });
        }
        Ok(self.parts(spec)?[0])
    }

    /// The linear `name` (e.g. `layers.0.ffn.shared_experts.w1`, or a 2-D bf16 tensor such
    /// as `layers.0.attn.compressor.wkv.weight`).
    pub fn linear(&self, name: &str) -> Result<StoredLinear<'_>, LoadError> {
        let spec = self.spec(name)?;
        let (rows, cols) = (spec.shape[0], spec.shape.get(1).copied().unwrap_or(1));
        match spec.storage {
            Storage::Linear(LinearFormat::Bf16) | Storage::Bf16 if spec.shape.len() == 2 => {
                Ok(StoredLinear::Bf16 {
                    rows,
                    cols,
                    bytes: self.parts(spec)?[0],
                })
            }
            Storage::Linear(LinearFormat::Fp8Block) => {
                let parts = self.parts(spec)?;
                Ok(StoredLinear::Fp8Block {
                    rows,
                    cols,
                    codes: parts[0],
                    scales: parts[1],
                })
            }
            other => Err(LoadError::Decode {
                name: name.to_owned(),
                message: format!("stored as {other:?}, not a dense linear"),
            }),
        }
    }

    /// Layer `layer`'s routed experts in their FP4 form; an error when they are stored
    /// otherwise.
    pub fn fp4_layer(&self, layer: usize) -> Result<LayerFp4Experts<'_>, LoadError> {
        let format = self.expert_format;
        if !self.has_fp4_experts() || layer >= self.layers {
            return Err(LoadError::Missing(format!(
                "{}ffn.experts as FP4 (the experts are {format:?}, {} layers)",
                schema::layer(layer),
                self.layers
            )));
        }
        let stack = |w: &str, rows: usize, cols: usize| -> Result<Fp4Stack<'_>, LoadError> {
            let mut experts = Vec::with_capacity(self.experts);
            for x in 0..self.experts {
                let name = format!("{}ffn.experts.{x}.{w}", schema::layer(layer));
                let spec = self.spec(&name)?;
                if spec.storage != Storage::Expert(format) || spec.shape != [rows, cols] {
                    return Err(LoadError::Missing(format!(
                        "{name} as {format:?} {rows}x{cols}"
                    )));
                }
                let parts = self.parts(spec)?;
                let scale_2 = if format == ExpertFormat::Nvfp4 {
                    let s = parts[2]
                        .get(..4)
                        .and_then(|b| b.try_into().ok())
                        .map(f32::from_le_bytes)
                        .filter(|s| s.is_finite())
                        .ok_or_else(|| LoadError::Decode {
                            name: format!("{name}.weight_scale_2"),
                            message: "bad weight_scale_2".into(),
                        })?;
                    Some(s)
                } else {
                    None
                };
                experts.push(Fp4Expert {
                    packed: parts[0],
                    scales: parts[1],
                    scale_2,
                });
            }
            Ok(Fp4Stack {
                format,
                rows,
                cols,
                experts,
            })
        };
        let (d, inter) = (self.hidden, self.inter);
        Ok(LayerFp4Experts {
            layer,
            w1: stack("w1", inter, d)?,
            w2: stack("w2", d, inter)?,
            w3: stack("w3", inter, d)?,
        })
    }

    /// Drops this process's resident pages of the mapping (what was read so far); see
    /// [`Checkpoint::release_resident`].
    pub fn release_resident(&self) -> Result<(), LoadError> {
        self.checkpoint.release_resident()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{GenerateOptions, Preset, generate};

    fn tiny(experts: ExpertFormat) -> (tempfile::TempDir, crate::model::Model) {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 3, experts, dir.path());
        generate(&options).unwrap();
        let model = crate::model::Model::load(dir.path()).unwrap();
        (dir, model)
    }

    fn bf16_bits(bytes: &[u8]) -> Vec<u16> {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    /// The stored codes decode to exactly the f32 weights the CPU reference loaded.
    #[test]
    fn stored_experts_match_the_loaded_weights() {
        for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
            let (dir, model) = tiny(format);
            let stored = StoredWeights::open(dir.path(), &model.config).unwrap();
            assert!(stored.has_fp4_experts());
            for layer in 0..model.config.num_layers() {
                let l = stored.fp4_layer(layer).unwrap();
                assert_eq!(l.layer, layer);
                let experts = &model.weights.layers[layer].moe.experts;
                for (stack, pick) in [(&l.w1, 0usize), (&l.w2, 1), (&l.w3, 2)] {
                    assert_eq!(stack.experts.len(), experts.len());
                    for (x, (e, expert)) in stack.experts.iter().zip(experts).enumerate() {
                        let want = [&expert.w1, &expert.w2, &expert.w3][pick];
                        assert_eq!(e.packed.len(), stack.packed_per_expert());
                        assert_eq!(e.scales.len(), stack.scales_per_expert());
                        let got = if format == ExpertFormat::Nvfp4 {
                            crate::quant::dequant_nvfp4(
                                e.packed,
                                e.scales,
                                e.scale_2.unwrap(),
                                stack.rows,
                                stack.cols,
                            )
                        } else {
                            assert_eq!(e.scale_2, None);
                            crate::quant::dequant_mxfp4(e.packed, e.scales, stack.rows, stack.cols)
                        }
                        .unwrap();
                        assert!(got == want.to_f32(), "{format:?} layer {layer} expert {x}");
                    }
                    let (packed, scales, scale_2) = stack.concat();
                    assert_eq!(packed.len(), experts.len() * stack.packed_per_expert());
                    assert_eq!(scales.len(), experts.len() * stack.scales_per_expert());
                    assert_eq!(
                        scale_2.len(),
                        l.w1.experts.iter().filter_map(|e| e.scale_2).count()
                    );
                    assert_eq!(
                        stack.stored_bytes(),
                        packed.len() + scales.len() + 4 * scale_2.len()
                    );
                }
            }
            let err = stored.fp4_layer(model.config.num_layers()).unwrap_err();
            assert!(err.to_string().contains("layers"), "{err}");
        }
    }

    #[test]
    fn stored_head_decodes_to_the_loaded_head() {
        let (dir, model) = tiny(ExpertFormat::Mxfp4);
        let stored = StoredWeights::open(dir.path(), &model.config).unwrap();
        let bits = bf16_bits(stored.bf16("head.weight").unwrap());
        assert_eq!(
            crate::formats::bf16_slice_to_f32(&bits),
            model.weights.head.to_f32()
        );
        let err = stored.bf16("hc_head_fn").unwrap_err();
        assert!(err.to_string().contains("not bf16"), "{err}");
        let err = stored.bf16("no.such.tensor").unwrap_err();
        assert!(err.to_string().contains("no.such.tensor"), "{err}");
    }

    /// Both linear formats decode to exactly the loaded shared expert (FP4-expert checkpoints
    /// store linears as FP8 blocks, bf16-expert ones as bf16).
    #[test]
    fn stored_linears_decode_to_the_loaded_weights() {
        for experts in [ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
            let (dir, model) = tiny(experts);
            let stored = StoredWeights::open(dir.path(), &model.config).unwrap();
            let name = format!("{}ffn.shared_experts.w2", schema::layer(1));
            let linear = stored.linear(&name).unwrap();
            let w2 = &model.weights.layers[1].moe.shared.w2;
            assert_eq!(linear.shape(), (w2.rows, w2.cols));
            let decoded = match linear {
                StoredLinear::Bf16 { bytes, .. } => {
                    assert_eq!(linear.stored_bytes(), 2 * w2.rows * w2.cols);
                    crate::formats::bf16_slice_to_f32(&bf16_bits(bytes))
                }
                StoredLinear::Fp8Block {
                    rows,
                    cols,
                    codes,
                    scales,
                } => crate::quant::dequant_fp8_block(codes, scales, rows, cols).unwrap(),
            };
            assert!(decoded == w2.to_f32(), "{experts:?}");
            let err = stored.linear("norm.weight").unwrap_err();
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
            assert!(stored.contains(&name));
            match stored.linear(&name).unwrap() {
                StoredLinear::Bf16 { bytes, .. } => assert!(
                    crate::formats::bf16_slice_to_f32(&bf16_bits(bytes))
                        == indexer.weights_proj.to_f32()
                ),
                other @ StoredLinear::Fp8Block { .. } => panic!("{other:?}"),
            }
            let err = stored.linear("hc_head_fn").unwrap_err();
            assert!(err.to_string().contains("not a dense linear"), "{err}");
        }
    }

    #[test]
    fn non_fp4_experts_are_reported_as_such() {
        let (dir, model) = tiny(ExpertFormat::Bf16);
        let stored = StoredWeights::open(dir.path(), &model.config).unwrap();
        assert!(!stored.has_fp4_experts());
        let err = stored.fp4_layer(0).unwrap_err();
        assert!(err.to_string().contains("Bf16"), "{err}");
    }

    /// Resident bytes of the mappings of files under `dir`, from /proc/self/smaps.
    fn resident_under(dir: &Path) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let dir = dir.to_str().unwrap();
        let mut inside = false;
        let mut kb = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                inside = line.trim_end().ends_with(".safetensors") && line.contains(dir);
            } else if inside && let Some(v) = line.strip_prefix("Rss:") {
                kb += v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap();
            }
        }
        kb * 1024
    }

    /// Reading through the mapping makes pages resident; releasing drops them while the bytes
    /// stay readable and unchanged.
    #[test]
    fn release_drops_the_resident_pages() {
        let (dir, model) = tiny(ExpertFormat::Nvfp4);
        drop(model);
        let stored = StoredWeights::open(
            dir.path(),
            &crate::config::ModelConfig::from_dir(dir.path()).unwrap(),
        )
        .unwrap();
        // Reads every packed byte of the first two layers' experts.
        let checksum = || -> u64 {
            (0..2)
                .map(|layer| {
                    let l = stored.fp4_layer(layer).unwrap();
                    [&l.w1, &l.w2, &l.w3]
                        .iter()
                        .flat_map(|stack| &stack.experts)
                        .flat_map(|e| e.packed)
                        .map(|&b| u64::from(b))
                        .sum::<u64>()
                })
                .sum()
        };
        let sum = checksum();
        let before = resident_under(dir.path());
        assert!(
            before > 64 * 1024,
            "{before} bytes resident after reading two layers"
        );
        stored.release_resident().unwrap();
        let after = resident_under(dir.path());
        assert!(after < before / 4, "{before} -> {after} bytes resident");
        assert_eq!(sum, checksum());
    }
}
