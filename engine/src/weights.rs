//! Loading a checkpoint. Shards are memory-mapped; large tensors (linears, experts, embedding,
//! head) stay in their stored form as ranges of the mapping ([`Weight`]), and only small ones
//! (norms, biases, sinks, hyper-connection parameters, positional biases) are expanded to
//! f32. Every tensor the configuration needs is checked for presence, dtype and shape, every
//! file tensor must be one the model uses (or `mtp.*`), and every element must decode to a
//! finite value; any problem is an error naming the tensor, and nothing is returned from a
//! partial load.

mod fingerprint;
pub mod index;
pub mod progress;
pub mod stored;

pub use fingerprint::fingerprint;
pub use progress::{LoadProgress, ShardLoaded};

use std::{
    cell::RefCell,
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    backend::LinearId,
    config::{Attention, ConfigError, ExpertFormat, LinearFormat, ModelConfig, Routing},
    formats, quant,
    safetensors::{Dtype, SafetensorsError, SafetensorsFile, TensorView},
    schema::{self, Storage, TensorSpec},
    tensor::{Matrix, SharedBytes, Weight},
};

/// Why a checkpoint cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    File(#[from] SafetensorsError),
    #[error("cannot list {path}: {source}")]
    ReadDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no *.safetensors files in {0}")]
    NoFiles(PathBuf),
    #[error("tensor {name} appears in both {first} and {second}")]
    Duplicate {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("missing tensor {0}")]
    Missing(String),
    #[error("unexpected tensor {name} in {file} (not used by this configuration)")]
    Unexpected { name: String, file: PathBuf },
    #[error("tensor {name}: dtype {found}, expected {expected}")]
    Dtype {
        name: String,
        found: &'static str,
        expected: String,
    },
    #[error("tensor {name}: shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor {name}: {message}")]
    Decode { name: String, message: String },
    #[error("{}: {message}", path.display())]
    Index { path: PathBuf, message: String },
    #[error("tensor {name}: non-finite value at index {index}")]
    NonFinite { name: String, index: usize },
    #[error("cannot release the mapped pages of {}: {source}", path.display())]
    Release {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tensor {name}: expert id {id} at index {index} is outside 0..{experts}")]
    ExpertId {
        name: String,
        id: i64,
        index: usize,
        experts: usize,
    },
}

/// The opened checkpoint files, indexed by tensor name.
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<SafetensorsFile>,
    index: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Opens (memory-maps) every `*.safetensors` in `dir` and validates their headers.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|source| LoadError::ReadDir {
                path: dir.to_path_buf(),
                source,
            })?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(LoadError::NoFiles(dir.to_path_buf()));
        }
        let mut files = Vec::with_capacity(paths.len());
        let mut index = BTreeMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = SafetensorsFile::open(path)?;
            for name in file.names() {
                if let Some(&prev) = index.get(name) {
                    let prev: usize = prev;
                    return Err(LoadError::Duplicate {
                        name: name.to_owned(),
                        first: paths[prev].clone(),
                        second: path.clone(),
                    });
                }
                index.insert(name.to_owned(), i);
            }
            files.push(file);
        }
        if let Some(map) = index::read(dir)? {
            let holders = index
                .iter()
                .map(|(name, &i)| (name.clone(), paths[i].clone()))
                .collect();
            index::check(dir, &map, &paths, &holders)?;
        }
        Ok(Self { files, index })
    }

    /// Drops this process's resident pages of every shard's mapping (see
    /// [`SafetensorsFile::release_resident`]).
    pub fn release_resident(&self) -> Result<(), LoadError> {
        for file in &self.files {
            file.release_resident()
                .map_err(|source| LoadError::Release {
                    path: file.path().to_path_buf(),
                    source,
                })?;
        }
        Ok(())
    }

    fn view(&self, name: &str) -> Result<TensorView<'_>, LoadError> {
        let file = self
            .index
            .get(name)
            .ok_or_else(|| LoadError::Missing(name.to_owned()))?;
        self.files[*file]
            .get(name)
            .ok_or_else(|| LoadError::Missing(name.to_owned()))
    }

    /// The view of `name`, checked against the accepted dtypes and the expected shape.
    fn checked(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[&str],
    ) -> Result<TensorView<'_>, LoadError> {
        let view = self.view(name)?;
        if !dtypes.contains(&view.dtype.name()) {
            return Err(LoadError::Dtype {
                name: name.to_owned(),
                found: view.dtype.name(),
                expected: dtypes.join(" or "),
            });
        }
        // Scalars are written as [] or [1].
        let scalar_ok = shape.is_empty() && view.shape == [1];
        if view.shape != shape && !scalar_ok {
            return Err(LoadError::Shape {
                name: name.to_owned(),
                found: view.shape.to_vec(),
                expected: shape.to_vec(),
            });
        }
        Ok(view)
    }

    /// Decodes one logical tensor to f32 (dequantizing as its storage says).
    pub fn load_f32(&self, spec: &TensorSpec) -> Result<Vec<f32>, LoadError> {
        let parts = schema::files_of(spec);
        let views = parts
            .iter()
            .map(|(name, shape, dtypes)| self.checked(name, shape, dtypes))
            .collect::<Result<Vec<_>, _>>()?;
        let (rows, cols) = (spec.shape[0], spec.shape.get(1).copied().unwrap_or(1));
        let decode_err = |message: String| LoadError::Decode {
            name: parts[0].0.clone(),
            message,
        };
        let values = match spec.storage {
            Storage::F32 | Storage::Bf16 => views[0]
                .to_f32_vec()
                .ok_or_else(|| decode_err("not a float tensor".into()))?,
            Storage::I32 => return Err(decode_err("integer tensor read as floats".into())),
            Storage::Linear(LinearFormat::Bf16) | Storage::Expert(ExpertFormat::Bf16) => views[0]
                .to_f32_vec()
                .ok_or_else(|| decode_err("not a float tensor".into()))?,
            Storage::Linear(LinearFormat::Fp8Block) | Storage::Expert(ExpertFormat::Fp8Block) => {
                quant::dequant_fp8_block(views[0].data, views[1].data, rows, cols)
                    .map_err(|e| decode_err(e.to_string()))?
            }
            Storage::Expert(ExpertFormat::Mxfp4) => {
                quant::dequant_mxfp4(views[0].data, views[1].data, rows, cols)
                    .map_err(|e| decode_err(e.to_string()))?
            }
            Storage::Expert(ExpertFormat::Nvfp4) => {
                let scale_2 =
                    scalar_f32(&views[2]).ok_or_else(|| decode_err("bad weight_scale_2".into()))?;
                quant::dequant_nvfp4(views[0].data, views[1].data, scale_2, rows, cols)
                    .map_err(|e| decode_err(e.to_string()))?
            }
        };
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(LoadError::NonFinite {
                name: parts[0].0.clone(),
                index,
            });
        }
        Ok(values)
    }

    /// A weight matrix in its stored form, borrowing the mapping (no element is copied);
    /// checked for shape, dtype, scale layout and finiteness of every element.
    pub fn load_weight(&self, spec: &TensorSpec) -> Result<Weight, LoadError> {
        let parts = schema::files_of(spec);
        let views = parts
            .iter()
            .map(|(name, shape, dtypes)| self.checked(name, shape, dtypes))
            .collect::<Result<Vec<_>, _>>()?;
        let (rows, cols) = (spec.shape[0], spec.shape.get(1).copied().unwrap_or(1));
        let name = &parts[0].0;
        let decode_err = |message: String| LoadError::Decode {
            name: name.clone(),
            message,
        };
        let bytes = |i: usize| {
            self.shared(&parts[i].0)
                .ok_or_else(|| LoadError::Missing(parts[i].0.clone()))
        };
        let weight = match spec.storage {
            Storage::F32 | Storage::I32 => {
                return Err(decode_err(format!(
                    "stored as {:?}, not a weight matrix",
                    spec.storage
                )));
            }
            Storage::Bf16
            | Storage::Linear(LinearFormat::Bf16)
            | Storage::Expert(ExpertFormat::Bf16) => Weight::bf16(rows, cols, bytes(0)?),
            Storage::Linear(LinearFormat::Fp8Block) | Storage::Expert(ExpertFormat::Fp8Block) => {
                Weight::fp8_block(rows, cols, bytes(0)?, views[1].data)
            }
            Storage::Expert(ExpertFormat::Mxfp4) => Weight::mxfp4(rows, cols, bytes(0)?, bytes(1)?),
            Storage::Expert(ExpertFormat::Nvfp4) => {
                let scale_2 =
                    scalar_f32(&views[2]).ok_or_else(|| decode_err("bad weight_scale_2".into()))?;
                Weight::nvfp4(rows, cols, bytes(0)?, bytes(1)?, scale_2)
            }
        }
        .map_err(|e| decode_err(e.to_string()))?;
        if let Some(index) = weight.first_non_finite() {
            return Err(LoadError::NonFinite {
                name: name.clone(),
                index,
            });
        }
        Ok(weight)
    }

    /// The bytes of tensor `name` as a range of its shard's mapping.
    fn shared(&self, name: &str) -> Option<SharedBytes> {
        self.files[*self.index.get(name)?].shared(name)
    }

    /// Decodes an integer tensor (expert ids) and checks every id is below `limit`.
    pub fn load_ids(&self, spec: &TensorSpec, limit: usize) -> Result<Vec<u32>, LoadError> {
        let (name, shape, dtypes) = &schema::files_of(spec)[0];
        let view = self.checked(name, shape, dtypes)?;
        let width = view.dtype.size_bytes();
        let mut out = Vec::with_capacity(view.data.len() / width);
        for (index, chunk) in view.data.chunks_exact(width).enumerate() {
            let id = match view.dtype {
                Dtype::I32 => {
                    i64::from(i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
                }
                _ => i64::from_le_bytes([
                    chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7],
                ]),
            };
            let ok = u32::try_from(id).ok().filter(|&v| (v as usize) < limit);
            out.push(ok.ok_or_else(|| LoadError::ExpertId {
                name: name.clone(),
                id,
                index,
                experts: limit,
            })?);
        }
        Ok(out)
    }

    /// Tensors in the files that the configuration does not use (`mtp.*` is allowed).
    fn check_no_extra(&self, specs: &[TensorSpec]) -> Result<(), LoadError> {
        let expected: std::collections::BTreeSet<String> = specs
            .iter()
            .flat_map(|s| schema::files_of(s).into_iter().map(|(n, _, _)| n))
            .collect();
        for (name, &file) in &self.index {
            if !expected.contains(name) && !name.starts_with("mtp.") {
                return Err(LoadError::Unexpected {
                    name: name.clone(),
                    file: self.files[file].path().to_path_buf(),
                });
            }
        }
        Ok(())
    }
}

fn scalar_f32(view: &TensorView<'_>) -> Option<f32> {
    let bytes: [u8; 4] = view.data.get(..4)?.try_into().ok()?;
    Some(f32::from_le_bytes(bytes))
}

/// Hyper-connection mixing weights around one sublayer.
#[derive(Debug, Clone)]
pub struct HyperWeights {
    /// `[(2+hc)*hc, hc*D]`.
    pub mix: Matrix,
    pub base: Vec<f32>,
    pub scale: [f32; 3],
}

/// A compressor (attention or indexer side).
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    pub wkv: Weight,
    pub wgate: Weight,
    /// Position bias `[ratio, width]` added to the gate scores.
    pub ape: Matrix,
    pub norm: Vec<f32>,
    pub ratio: usize,
    /// Output row width.
    pub head_dim: usize,
    /// CSA: two overlapping series (width 2 * head_dim).
    pub overlap: bool,
}

/// The lightning indexer of a CSA layer.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    pub wq_b: Weight,
    pub weights_proj: Weight,
    pub compressor: CompressorWeights,
}

/// Attention of one layer.
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    pub wq_a: Weight,
    pub q_norm: Vec<f32>,
    pub wq_b: Weight,
    pub wkv: Weight,
    pub kv_norm: Vec<f32>,
    pub wo_a: Weight,
    pub wo_b: Weight,
    pub sink: Vec<f32>,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
}

impl AttentionWeights {
    /// The weight of attention linear `which`, where this layer has it.
    pub fn linear(&self, which: LinearId) -> Option<&Weight> {
        let (compressor, indexer) = (self.compressor.as_ref(), self.indexer.as_ref());
        match which {
            LinearId::QA => Some(&self.wq_a),
            LinearId::QB => Some(&self.wq_b),
            LinearId::Kv => Some(&self.wkv),
            LinearId::OA => Some(&self.wo_a),
            LinearId::OB => Some(&self.wo_b),
            LinearId::CompressorKv => compressor.map(|c| &c.wkv),
            LinearId::CompressorGate => compressor.map(|c| &c.wgate),
            LinearId::IndexerCompressorKv => indexer.map(|i| &i.compressor.wkv),
            LinearId::IndexerCompressorGate => indexer.map(|i| &i.compressor.wgate),
            LinearId::IndexerQB => indexer.map(|i| &i.wq_b),
            LinearId::IndexerWeights => indexer.map(|i| &i.weights_proj),
        }
    }
}

/// One SwiGLU expert.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    pub w1: Weight,
    pub w2: Weight,
    pub w3: Weight,
}

/// The MoE of one layer.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    pub gate: Weight,
    /// Selection-only score bias (top-k layers).
    pub bias: Option<Vec<f32>>,
    /// `[vocab, k]` expert ids (hash layers).
    pub tid2eid: Option<Vec<u32>>,
    pub shared: ExpertWeights,
    pub experts: Vec<ExpertWeights>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: HyperWeights,
    pub hc_ffn: HyperWeights,
    pub attn: AttentionWeights,
    pub moe: MoeWeights,
}

/// The hyper head collapsing the streams before the final norm.
#[derive(Debug, Clone)]
pub struct HeadWeights {
    pub mix: Matrix,
    pub base: Vec<f32>,
    pub scale: f32,
}

/// All weights: large ones as stored, small ones in f32.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub embed: Weight,
    pub head: Weight,
    pub norm: Vec<f32>,
    pub hc_head: HeadWeights,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// The same weights with every large tensor decoded to owned f32, as the loader produced
    /// them before weights stayed in their stored form: the reference that stored-form
    /// products are checked against bit for bit (tests and tools; about 4-8x the memory).
    #[must_use]
    pub fn expanded(&self) -> Self {
        let f = |w: &Weight| Weight::from(w.to_matrix());
        let compressor = |c: &CompressorWeights| CompressorWeights {
            wkv: f(&c.wkv),
            wgate: f(&c.wgate),
            ..c.clone()
        };
        let expert = |e: &ExpertWeights| ExpertWeights {
            w1: f(&e.w1),
            w2: f(&e.w2),
            w3: f(&e.w3),
        };
        let mut out = self.clone();
        out.embed = f(&self.embed);
        out.head = f(&self.head);
        for l in &mut out.layers {
            let a = &mut l.attn;
            a.wq_a = f(&a.wq_a);
            a.wq_b = f(&a.wq_b);
            a.wkv = f(&a.wkv);
            a.wo_a = f(&a.wo_a);
            a.wo_b = f(&a.wo_b);
            a.compressor = a.compressor.as_ref().map(compressor);
            if let Some(i) = &mut a.indexer {
                i.wq_b = f(&i.wq_b);
                i.weights_proj = f(&i.weights_proj);
                i.compressor = compressor(&i.compressor);
            }
            l.moe.gate = f(&l.moe.gate);
            l.moe.shared = expert(&l.moe.shared);
            l.moe.experts = l.moe.experts.iter().map(expert).collect();
        }
        out
    }

    /// Weight bytes one decode token reads: everything held except the embedding (one row of
    /// it is read) and the routed experts it is not routed to (`experts_per_token` of them
    /// are, in every layer).
    pub fn decode_bytes_per_token(&self, experts_per_token: usize) -> usize {
        let routed: usize = self
            .layers
            .iter()
            .map(|l| {
                let all: usize = l
                    .moe
                    .experts
                    .iter()
                    .map(|e| e.w1.stored_bytes() + e.w2.stored_bytes() + e.w3.stored_bytes())
                    .sum();
                let n = l.moe.experts.len().max(1);
                all - all * experts_per_token.min(n) / n
            })
            .sum();
        let embed_row = self.embed.stored_bytes() / self.embed.rows.max(1);
        self.held_bytes() - self.embed.stored_bytes() + embed_row - routed
    }

    /// Bytes of every weight as held (stored bytes for large tensors, f32 for small ones).
    pub fn held_bytes(&self) -> usize {
        let v = |x: &[f32]| 4 * x.len();
        let m = |x: &Matrix| 4 * x.data.len();
        let compressor = |c: &CompressorWeights| {
            c.wkv.stored_bytes() + c.wgate.stored_bytes() + m(&c.ape) + v(&c.norm)
        };
        let expert =
            |e: &ExpertWeights| e.w1.stored_bytes() + e.w2.stored_bytes() + e.w3.stored_bytes();
        let hyper = |h: &HyperWeights| m(&h.mix) + v(&h.base) + 12;
        let mut total = self.embed.stored_bytes()
            + self.head.stored_bytes()
            + v(&self.norm)
            + m(&self.hc_head.mix)
            + v(&self.hc_head.base)
            + 4;
        for l in &self.layers {
            let a = &l.attn;
            total += v(&l.attn_norm) + v(&l.ffn_norm) + hyper(&l.hc_attn) + hyper(&l.hc_ffn);
            total += [&a.wq_a, &a.wq_b, &a.wkv, &a.wo_a, &a.wo_b]
                .iter()
                .map(|w| w.stored_bytes())
                .sum::<usize>();
            total += v(&a.q_norm) + v(&a.kv_norm) + v(&a.sink);
            total += a.compressor.as_ref().map_or(0, compressor);
            total += a.indexer.as_ref().map_or(0, |i| {
                i.wq_b.stored_bytes() + i.weights_proj.stored_bytes() + compressor(&i.compressor)
            });
            total += l.moe.gate.stored_bytes()
                + l.moe.bias.as_ref().map_or(0, |b| v(b))
                + l.moe.tid2eid.as_ref().map_or(0, |t| 4 * t.len())
                + expert(&l.moe.shared)
                + l.moe.experts.iter().map(expert).sum::<usize>();
        }
        total
    }
}

/// Loads and checks every tensor of `config` from `dir`.
pub fn load(dir: &Path, config: &ModelConfig) -> Result<ModelWeights, LoadError> {
    load_with_progress(dir, config, &Arc::new(LoadProgress::new()))
}

/// [`load`], counting what has been checked in `progress` (readable from other threads while
/// this runs) and logging each shard as it completes.
pub fn load_with_progress(
    dir: &Path,
    config: &ModelConfig,
    progress: &Arc<LoadProgress>,
) -> Result<ModelWeights, LoadError> {
    let checkpoint = Checkpoint::open(dir)?;
    let specs = schema::tensors(config);
    checkpoint.check_no_extra(&specs)?;
    let tracker = checkpoint.tracker(&specs, progress);
    let assembler = Assembler {
        checkpoint: &checkpoint,
        specs: specs.iter().map(|s| (s.name.clone(), s)).collect(),
        config,
        tracker: RefCell::new(tracker),
    };
    let weights = assembler.model()?;
    assembler.tracker.borrow_mut().finish();
    Ok(weights)
}

impl Checkpoint {
    /// Progress accounting for loading `specs`: every shard with its size on disk, every file
    /// tensor the specs name with the shard it is in and its bytes.
    fn tracker(&self, specs: &[TensorSpec], progress: &Arc<LoadProgress>) -> progress::Tracker {
        let shards = self
            .files
            .iter()
            .map(|f| {
                let name = f.path().file_name().map_or_else(
                    || f.path().display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                );
                (name, f.file_len() as u64)
            })
            .collect();
        let tensors = specs
            .iter()
            .flat_map(|s| schema::files_of(s).into_iter().map(|(n, _, _)| n))
            .filter_map(|name| {
                let shard = *self.index.get(&name)?;
                let bytes = self.files[shard].get(&name)?.data.len() as u64;
                Some((name, shard, bytes))
            });
        progress::Tracker::start(Arc::clone(progress), shards, tensors)
    }
}

struct Assembler<'a> {
    checkpoint: &'a Checkpoint,
    specs: BTreeMap<String, &'a TensorSpec>,
    config: &'a ModelConfig,
    /// Credits each checked tensor to its shard (the loader is single-threaded, hence a cell).
    tracker: RefCell<progress::Tracker>,
}

impl Assembler<'_> {
    fn spec(&self, name: &str) -> Result<&TensorSpec, LoadError> {
        self.specs
            .get(name)
            .copied()
            .ok_or_else(|| LoadError::Missing(name.to_owned()))
    }

    /// `spec` was checked: its file tensors count as loaded.
    fn checked(&self, spec: &TensorSpec) {
        let parts = schema::files_of(spec);
        self.tracker
            .borrow_mut()
            .checked(parts.iter().map(|(n, _, _)| n.as_str()));
    }

    fn vec(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let spec = self.spec(name)?;
        let values = self.checkpoint.load_f32(spec)?;
        self.checked(spec);
        Ok(values)
    }

    fn matrix(&self, name: &str) -> Result<Matrix, LoadError> {
        let spec = self.spec(name)?;
        let data = self.checkpoint.load_f32(spec)?;
        self.checked(spec);
        Ok(Matrix::new(spec.shape[0], spec.shape[1], data))
    }

    fn weight(&self, name: &str) -> Result<Weight, LoadError> {
        let spec = self.spec(name)?;
        let weight = self.checkpoint.load_weight(spec)?;
        self.checked(spec);
        Ok(weight)
    }

    fn model(&self) -> Result<ModelWeights, LoadError> {
        let scale = self.vec("hc_head_scale")?;
        Ok(ModelWeights {
            embed: self.weight("embed.weight")?,
            head: self.weight("head.weight")?,
            norm: self.vec("norm.weight")?,
            hc_head: HeadWeights {
                mix: self.matrix("hc_head_fn")?,
                base: self.vec("hc_head_base")?,
                scale: scale[0],
            },
            layers: (0..self.config.num_layers())
                .map(|i| self.layer(i))
                .collect::<Result<_, _>>()?,
        })
    }

    fn hyper(&self, p: &str, part: &str) -> Result<HyperWeights, LoadError> {
        let scale = self.vec(&format!("{p}hc_{part}_scale"))?;
        Ok(HyperWeights {
            mix: self.matrix(&format!("{p}hc_{part}_fn"))?,
            base: self.vec(&format!("{p}hc_{part}_base"))?,
            scale: [scale[0], scale[1], scale[2]],
        })
    }

    fn compressor(
        &self,
        prefix: &str,
        ratio: usize,
        head_dim: usize,
        overlap: bool,
    ) -> Result<CompressorWeights, LoadError> {
        Ok(CompressorWeights {
            wkv: self.weight(&format!("{prefix}wkv.weight"))?,
            wgate: self.weight(&format!("{prefix}wgate.weight"))?,
            ape: self.matrix(&format!("{prefix}ape"))?,
            norm: self.vec(&format!("{prefix}norm.weight"))?,
            ratio,
            head_dim,
            overlap,
        })
    }

    fn expert(&self, prefix: &str) -> Result<ExpertWeights, LoadError> {
        Ok(ExpertWeights {
            w1: self.weight(&format!("{prefix}w1"))?,
            w2: self.weight(&format!("{prefix}w2"))?,
            w3: self.weight(&format!("{prefix}w3"))?,
        })
    }

    fn layer(&self, i: usize) -> Result<LayerWeights, LoadError> {
        let c = self.config;
        let p = schema::layer(i);
        let a = format!("{p}attn.");
        let spec = c.layers[i];
        let (compressor, indexer) = match spec.attention {
            Attention::Sliding => (None, None),
            Attention::Hca { ratio } => (
                Some(self.compressor(&format!("{a}compressor."), ratio, c.head_dim, false)?),
                None,
            ),
            Attention::Csa { ratio } => (
                Some(self.compressor(&format!("{a}compressor."), ratio, c.head_dim, true)?),
                Some(IndexerWeights {
                    wq_b: self.weight(&format!("{a}indexer.wq_b"))?,
                    weights_proj: self.weight(&format!("{a}indexer.weights_proj.weight"))?,
                    compressor: self.compressor(
                        &format!("{a}indexer.compressor."),
                        ratio,
                        c.index_head_dim,
                        true,
                    )?,
                }),
            ),
        };
        let f = format!("{p}ffn.");
        let (bias, tid2eid) = match spec.routing {
            Routing::TopK => (Some(self.vec(&format!("{f}gate.bias"))?), None),
            Routing::Hash => {
                let spec = self.spec(&format!("{f}gate.tid2eid"))?;
                let ids = self.checkpoint.load_ids(spec, c.n_routed_experts)?;
                self.checked(spec);
                (None, Some(ids))
            }
        };
        Ok(LayerWeights {
            attn_norm: self.vec(&format!("{p}attn_norm.weight"))?,
            ffn_norm: self.vec(&format!("{p}ffn_norm.weight"))?,
            hc_attn: self.hyper(&p, "attn")?,
            hc_ffn: self.hyper(&p, "ffn")?,
            attn: AttentionWeights {
                wq_a: self.weight(&format!("{a}wq_a"))?,
                q_norm: self.vec(&format!("{a}q_norm.weight"))?,
                wq_b: self.weight(&format!("{a}wq_b"))?,
                wkv: self.weight(&format!("{a}wkv"))?,
                kv_norm: self.vec(&format!("{a}kv_norm.weight"))?,
                wo_a: self.weight(&format!("{a}wo_a"))?,
                wo_b: self.weight(&format!("{a}wo_b"))?,
                sink: self.vec(&format!("{a}attn_sink"))?,
                compressor,
                indexer,
            },
            moe: MoeWeights {
                gate: self.weight(&format!("{f}gate.weight"))?,
                bias,
                tid2eid,
                shared: self.expert(&format!("{f}shared_experts."))?,
                experts: (0..c.n_routed_experts)
                    .map(|x| self.expert(&format!("{f}experts.{x}.")))
                    .collect::<Result<_, _>>()?,
            },
        })
    }
}

/// Decodes a bf16 little-endian byte slice (used by tests and tools).
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| formats::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
        .collect()
}
