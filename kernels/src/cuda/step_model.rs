//! The model's weights on the device for [`super::CudaStepOps`], uploaded once in their stored
//! forms (linears as `exact_gemv` takes them, routed experts stacked per projection as
//! `exact_pairs` takes them, the small vectors in f32), looked up by the step's ids.

use std::collections::HashMap;

use cudarc::driver::CudaSlice;
use engine::{
    backend::LinearId,
    config::ModelConfig,
    model::Model,
    tensor::{Matrix, Weight, WeightForm},
    weights::{CompressorWeights, ExpertWeights},
};

use super::{DeviceRows, Gpu, KernelError, StoredRows, non_empty};
use crate::step::{Comp, Lin, Proj, Sub, Vector};

/// One projection of every routed expert of a layer, stacked.
#[derive(Debug)]
pub(super) struct ExpertStack {
    pub kernel: &'static str,
    pub packed: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    /// One per expert (1 for MXFP4).
    pub scale_2: CudaSlice<f32>,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

/// A layer's routing: the selection bias or the hash table.
#[derive(Debug)]
pub(super) struct DeviceRouting {
    pub bias: Option<CudaSlice<f32>>,
    pub table: Option<CudaSlice<u32>>,
    pub table_rows: usize,
}

/// A compressor's shape and position bias.
#[derive(Debug)]
pub(super) struct DeviceCompressor {
    pub ratio: usize,
    pub d: usize,
    pub width: usize,
    pub overlap: bool,
    /// `[ratio, width]`.
    pub ape: CudaSlice<f32>,
}

/// The hyper-connection constants of a sublayer.
#[derive(Debug)]
pub(super) struct DeviceHyper {
    pub scale: CudaSlice<f32>,
    pub base: CudaSlice<f32>,
}

/// Every weight a decode step reads, on the device.
#[derive(Debug)]
pub(super) struct DeviceModel {
    pub linears: HashMap<Lin, DeviceRows>,
    pub vectors: HashMap<Vector, CudaSlice<f32>>,
    pub hyper: HashMap<(usize, Sub), DeviceHyper>,
    pub compressors: HashMap<(usize, Comp), DeviceCompressor>,
    pub sinks: Vec<CudaSlice<f32>>,
    pub experts: Vec<[ExpertStack; 3]>,
    pub routing: Vec<DeviceRouting>,
    pub head_mix: DeviceRows,
    pub head_base: CudaSlice<f32>,
    pub head_scale: f32,
    /// The embedding table's bytes: f32 or bf16 (`embed_bf16`).
    pub embed: CudaSlice<u8>,
    pub embed_bf16: bool,
    pub embed_rows: usize,
}

fn matrix(gpu: &Gpu, m: &Matrix) -> Result<DeviceRows, KernelError> {
    gpu.upload_rows(StoredRows::F32(&m.data), m.rows, m.cols)
}

fn linear(gpu: &Gpu, w: &Weight) -> Result<DeviceRows, KernelError> {
    gpu.upload_rows(StoredRows::of(w), w.rows, w.cols)
}

fn proj_of(e: &ExpertWeights, proj: Proj) -> &Weight {
    match proj {
        Proj::Gate => &e.w1,
        Proj::Down => &e.w2,
        Proj::Up => &e.w3,
    }
}

/// Every expert's `proj`, stacked into one upload (FP4 forms only: what `exact_pairs` reads).
fn stack(gpu: &Gpu, experts: &[ExpertWeights], proj: Proj) -> Result<ExpertStack, KernelError> {
    let first = experts
        .first()
        .map(|e| proj_of(e, proj))
        .ok_or_else(|| KernelError::Shape("a MoE layer without routed experts".into()))?;
    let (mut packed, mut scales, mut scale_2) = (Vec::new(), Vec::new(), Vec::new());
    let mut kernel = "";
    for e in experts {
        let w = proj_of(e, proj);
        if (w.rows, w.cols) != (first.rows, first.cols) {
            return Err(KernelError::Shape(
                "routed experts of different shapes".into(),
            ));
        }
        match w.form() {
            WeightForm::Nvfp4 {
                packed: p,
                scales: s,
                scale_2: s2,
            } => {
                kernel = "exact_pairs_nvfp4";
                packed.extend_from_slice(p.as_slice());
                scales.extend_from_slice(s.as_slice());
                scale_2.push(*s2);
            }
            WeightForm::Mxfp4 {
                packed: p,
                scales: s,
            } => {
                kernel = "exact_pairs_mxfp4";
                packed.extend_from_slice(p.as_slice());
                scales.extend_from_slice(s.as_slice());
                scale_2.push(1.0);
            }
            _ => {
                return Err(KernelError::Shape(
                    "the device decode step runs routed experts stored as NVFP4 or MXFP4 only"
                        .into(),
                ));
            }
        }
    }
    let s = &gpu.stream;
    Ok(ExpertStack {
        kernel,
        packed: s.clone_htod(&non_empty(&packed))?,
        scales: s.clone_htod(&non_empty(&scales))?,
        scale_2: s.clone_htod(&non_empty(&scale_2))?,
        experts: experts.len(),
        rows: first.rows,
        cols: first.cols,
    })
}

fn compressor(gpu: &Gpu, w: &CompressorWeights) -> Result<DeviceCompressor, KernelError> {
    Ok(DeviceCompressor {
        ratio: w.ratio,
        d: w.head_dim,
        width: w.wkv.rows,
        overlap: w.overlap,
        ape: gpu.stream.clone_htod(&non_empty(&w.ape.data))?,
    })
}

impl DeviceModel {
    /// Uploads every weight of `model` a decode step reads.
    pub fn upload(gpu: &Gpu, model: &Model) -> Result<Self, KernelError> {
        let w = &model.weights;
        let s = &gpu.stream;
        let vec = |v: &[f32]| s.clone_htod(&non_empty(v));
        let mut linears = HashMap::new();
        let mut vectors = HashMap::new();
        let mut hyper = HashMap::new();
        let mut compressors = HashMap::new();
        let (mut sinks, mut experts, mut routing) = (Vec::new(), Vec::new(), Vec::new());
        for (l, layer) in w.layers.iter().enumerate() {
            let a = &layer.attn;
            let comp = a.compressor.as_ref();
            let index = a.indexer.as_ref();
            let attn: [(LinearId, Option<&Weight>); 11] = [
                (LinearId::QA, Some(&a.wq_a)),
                (LinearId::QB, Some(&a.wq_b)),
                (LinearId::Kv, Some(&a.wkv)),
                (LinearId::OA, Some(&a.wo_a)),
                (LinearId::OB, Some(&a.wo_b)),
                (LinearId::CompressorKv, comp.map(|c| &c.wkv)),
                (LinearId::CompressorGate, comp.map(|c| &c.wgate)),
                (
                    LinearId::IndexerCompressorKv,
                    index.map(|i| &i.compressor.wkv),
                ),
                (
                    LinearId::IndexerCompressorGate,
                    index.map(|i| &i.compressor.wgate),
                ),
                (LinearId::IndexerQB, index.map(|i| &i.wq_b)),
                (LinearId::IndexerWeights, index.map(|i| &i.weights_proj)),
            ];
            for (id, weight) in attn {
                if let Some(weight) = weight {
                    linears.insert(Lin::Attn(l, id), linear(gpu, weight)?);
                }
            }
            for (sub, h) in [(Sub::Attn, &layer.hc_attn), (Sub::Ffn, &layer.hc_ffn)] {
                linears.insert(Lin::Mix(l, sub), matrix(gpu, &h.mix)?);
                hyper.insert(
                    (l, sub),
                    DeviceHyper {
                        scale: vec(&h.scale)?,
                        base: vec(&h.base)?,
                    },
                );
            }
            linears.insert(Lin::Gate(l), linear(gpu, &layer.moe.gate)?);
            for proj in [Proj::Gate, Proj::Up, Proj::Down] {
                linears.insert(
                    Lin::Shared(l, proj),
                    linear(gpu, proj_of(&layer.moe.shared, proj))?,
                );
            }
            vectors.insert(Vector::AttnNorm(l), vec(&layer.attn_norm)?);
            vectors.insert(Vector::FfnNorm(l), vec(&layer.ffn_norm)?);
            vectors.insert(Vector::QNorm(l), vec(&a.q_norm)?);
            vectors.insert(Vector::KvNorm(l), vec(&a.kv_norm)?);
            for (c, cw) in [
                (Comp::Attn, comp),
                (Comp::Index, index.map(|i| &i.compressor)),
            ] {
                if let Some(cw) = cw {
                    vectors.insert(Vector::CompressorNorm(l, c), vec(&cw.norm)?);
                    compressors.insert((l, c), compressor(gpu, cw)?);
                }
            }
            sinks.push(vec(&a.sink)?);
            let e = &layer.moe.experts;
            experts.push([
                stack(gpu, e, Proj::Gate)?,
                stack(gpu, e, Proj::Up)?,
                stack(gpu, e, Proj::Down)?,
            ]);
            let k = model.config.experts_per_token;
            routing.push(DeviceRouting {
                bias: layer.moe.bias.as_deref().map(vec).transpose()?,
                table: match &layer.moe.tid2eid {
                    Some(t) => Some(s.clone_htod(&non_empty(t))?),
                    None => None,
                },
                table_rows: layer.moe.tid2eid.as_ref().map_or(0, |t| t.len() / k.max(1)),
            });
        }
        linears.insert(Lin::Head, linear(gpu, &w.head)?);
        vectors.insert(Vector::FinalNorm, vec(&w.norm)?);
        let (embed, embed_bf16) = match w.embed.form() {
            WeightForm::F32(v) => (
                v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
                false,
            ),
            WeightForm::Bf16(b) => (b.as_slice().to_vec(), true),
            _ => {
                return Err(KernelError::Shape(
                    "the device decode step reads an f32 or bf16 embedding table".into(),
                ));
            }
        };
        Ok(Self {
            linears,
            vectors,
            hyper,
            compressors,
            sinks,
            experts,
            routing,
            head_mix: matrix(gpu, &w.hc_head.mix)?,
            head_base: vec(&w.hc_head.base)?,
            head_scale: w.hc_head.scale,
            embed: s.clone_htod(&non_empty(&embed))?,
            embed_bf16,
            embed_rows: w.embed.rows,
        })
    }

    pub fn linear(&self, w: Lin) -> Result<&DeviceRows, KernelError> {
        self.linears
            .get(&w)
            .ok_or_else(|| KernelError::Shape(format!("no weight {w:?} on the device")))
    }

    pub fn vector(&self, v: Vector) -> Result<&CudaSlice<f32>, KernelError> {
        self.vectors
            .get(&v)
            .ok_or_else(|| KernelError::Shape(format!("no vector {v:?} on the device")))
    }

    pub fn compressor(&self, l: usize, c: Comp) -> Result<&DeviceCompressor, KernelError> {
        self.compressors
            .get(&(l, c))
            .ok_or_else(|| KernelError::Shape(format!("layer {l} has no {c:?} compressor")))
    }
}

/// Layer `l`'s item of a per-layer list.
pub(super) fn at_layer<T>(items: &[T], l: usize) -> Result<&T, KernelError> {
    items
        .get(l)
        .ok_or_else(|| KernelError::Shape(format!("no layer {l}")))
}

/// Shapes [`super::CudaStepOps`] takes from the configuration.
pub(super) fn hc_dim(c: &ModelConfig) -> (usize, usize) {
    (c.hc_mult, c.hidden_size)
}
