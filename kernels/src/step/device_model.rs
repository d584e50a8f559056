//! The model's weights on the device for [`super::device_ops::DeviceStepOps`], uploaded once
//! through [`Kernels`] in their stored forms (linears as `exact_gemv` takes them, routed
//! experts stacked per projection as `exact_pairs` takes them, the small vectors in f32),
//! looked up by the step's ids.

use std::collections::HashMap;

use engine::{
    backend::LinearId,
    model::Model,
    tensor::{Matrix, Weight},
    weights::{CompressorWeights, ExpertWeights},
};

use super::{Comp, Lin, Proj, Sub, Vector, kernels::Kernels};

/// A layer's routing: the selection bias or the hash table.
pub(crate) struct DeviceRouting<K: Kernels> {
    pub bias: Option<K::F>,
    pub hash: Option<K::Hash>,
    pub table_rows: usize,
}

/// A compressor's shape and position bias (`[ratio, width]`).
pub(crate) struct DeviceCompressor<K: Kernels> {
    pub ratio: usize,
    pub d: usize,
    pub width: usize,
    pub overlap: bool,
    pub ape: K::F,
}

/// The hyper-connection constants of a sublayer.
pub(crate) struct DeviceHyper<K: Kernels> {
    pub scale: K::F,
    pub base: K::F,
}

/// Every weight a decode step reads, on the device.
pub struct DeviceModel<K: Kernels> {
    pub(crate) linears: HashMap<Lin, K::Rows>,
    pub(crate) vectors: HashMap<Vector, K::F>,
    pub(crate) hyper: HashMap<(usize, Sub), DeviceHyper<K>>,
    pub(crate) compressors: HashMap<(usize, Comp), DeviceCompressor<K>>,
    pub(crate) sinks: Vec<K::F>,
    /// Per layer: gate, up, down.
    pub(crate) experts: Vec<[K::Stack; 3]>,
    pub(crate) routing: Vec<DeviceRouting<K>>,
    pub(crate) head_mix: K::Rows,
    pub(crate) head_base: K::F,
    pub(crate) head_scale: f32,
    pub(crate) embed: K::Table,
}

impl<K: Kernels> std::fmt::Debug for DeviceModel<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceModel")
            .field("linears", &self.linears.len())
            .field("layers", &self.sinks.len())
            .finish_non_exhaustive()
    }
}

fn proj_of(e: &ExpertWeights, proj: Proj) -> &Weight {
    match proj {
        Proj::Gate => &e.w1,
        Proj::Down => &e.w2,
        Proj::Up => &e.w3,
    }
}

fn matrix<K: Kernels>(k: &K, m: &Matrix) -> Result<K::Rows, K::Error> {
    k.upload_matrix(&m.data, m.rows, m.cols)
}

fn compressor<K: Kernels>(k: &K, w: &CompressorWeights) -> Result<DeviceCompressor<K>, K::Error> {
    Ok(DeviceCompressor {
        ratio: w.ratio,
        d: w.head_dim,
        width: w.wkv.rows,
        overlap: w.overlap,
        ape: k.upload(&w.ape.data)?,
    })
}

impl<K: Kernels> DeviceModel<K> {
    /// Uploads every weight of `model` a decode step reads; of the routed experts, those of
    /// its rank where it is a rank of an expert-parallel group (a step's pairs name them by
    /// their index among the rank's).
    pub fn upload(k: &K, model: &Model) -> Result<Self, K::Error> {
        let w = &model.weights;
        let held = model
            .expert_parallel()
            .map_or(0..model.config.n_routed_experts, |ep| {
                ep.split().held_by(ep.rank())
            });
        let mut linears = HashMap::new();
        let mut vectors = HashMap::new();
        let mut hyper = HashMap::new();
        let mut compressors = HashMap::new();
        let (mut sinks, mut experts, mut routing) = (Vec::new(), Vec::new(), Vec::new());
        for (l, layer) in w.layers.iter().enumerate() {
            let a = &layer.attn;
            let comp = a.compressor.as_ref();
            let index = a.indexer.as_ref();
            for id in LinearId::ALL {
                if let Some(weight) = a.linear(id) {
                    linears.insert(Lin::Attn(l, id), k.upload_rows(weight)?);
                }
            }
            for (sub, h) in [(Sub::Attn, &layer.hc_attn), (Sub::Ffn, &layer.hc_ffn)] {
                linears.insert(Lin::Mix(l, sub), matrix(k, &h.mix)?);
                hyper.insert(
                    (l, sub),
                    DeviceHyper {
                        scale: k.upload(&h.scale)?,
                        base: k.upload(&h.base)?,
                    },
                );
            }
            linears.insert(Lin::Gate(l), k.upload_rows(&layer.moe.gate)?);
            for proj in [Proj::Gate, Proj::Up, Proj::Down] {
                let weight = proj_of(&layer.moe.shared, proj);
                linears.insert(Lin::Shared(l, proj), k.upload_rows(weight)?);
            }
            vectors.insert(Vector::AttnNorm(l), k.upload(&layer.attn_norm)?);
            vectors.insert(Vector::FfnNorm(l), k.upload(&layer.ffn_norm)?);
            vectors.insert(Vector::QNorm(l), k.upload(&a.q_norm)?);
            vectors.insert(Vector::KvNorm(l), k.upload(&a.kv_norm)?);
            for (c, cw) in [
                (Comp::Attn, comp),
                (Comp::Index, index.map(|i| &i.compressor)),
            ] {
                if let Some(cw) = cw {
                    vectors.insert(Vector::CompressorNorm(l, c), k.upload(&cw.norm)?);
                    compressors.insert((l, c), compressor(k, cw)?);
                }
            }
            sinks.push(k.upload(&a.sink)?);
            let e = layer
                .moe
                .experts
                .get(held.clone())
                .ok_or_else(|| format!("layer {l} has no experts {held:?}"))?;
            experts.push([
                k.upload_stack(e, Proj::Gate)?,
                k.upload_stack(e, Proj::Up)?,
                k.upload_stack(e, Proj::Down)?,
            ]);
            let per = model.config.experts_per_token.max(1);
            routing.push(DeviceRouting {
                bias: layer.moe.bias.as_deref().map(|b| k.upload(b)).transpose()?,
                hash: k.upload_hash(&layer.moe)?,
                table_rows: layer.moe.tid2eid.as_ref().map_or(0, |t| t.len() / per),
            });
        }
        linears.insert(Lin::Head, k.upload_rows(&w.head)?);
        vectors.insert(Vector::FinalNorm, k.upload(&w.norm)?);
        Ok(Self {
            linears,
            vectors,
            hyper,
            compressors,
            sinks,
            experts,
            routing,
            head_mix: matrix(k, &w.hc_head.mix)?,
            head_base: k.upload(&w.hc_head.base)?,
            head_scale: w.hc_head.scale,
            embed: k.upload_table(&w.embed)?,
        })
    }

    pub fn linear(&self, w: Lin) -> Result<&K::Rows, K::Error> {
        self.linears
            .get(&w)
            .ok_or_else(|| format!("no weight {w:?} on the device").into())
    }

    pub fn vector(&self, v: Vector) -> Result<&K::F, K::Error> {
        self.vectors
            .get(&v)
            .ok_or_else(|| format!("no vector {v:?} on the device").into())
    }

    pub(crate) fn compressor(&self, l: usize, c: Comp) -> Result<&DeviceCompressor<K>, K::Error> {
        self.compressors
            .get(&(l, c))
            .ok_or_else(|| format!("layer {l} has no {c:?} compressor").into())
    }

    pub(crate) fn hyper(&self, l: usize, sub: Sub) -> Result<&DeviceHyper<K>, K::Error> {
        self.hyper
            .get(&(l, sub))
            .ok_or_else(|| format!("layer {l} has no {sub:?} hyper-connections").into())
    }
}

/// Layer `l`'s item of a per-layer list.
pub fn at_layer<T, E: From<String>>(items: &[T], l: usize) -> Result<&T, E> {
    items.get(l).ok_or_else(|| format!("no layer {l}").into())
}
