//! The model's weights on the device for [`super::device_ops::DeviceStepOps`], uploaded once
//! through [`Kernels`] in their stored forms (linears as `exact_gemv` takes them, routed
//! experts stacked per projection as `exact_pairs` takes them, the small vectors in f32),
//! looked up by the step's ids.

use std::{borrow::Cow, collections::HashMap};

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
    /// The first row of the weights the device holds a row block of (a tensor-parallel rank's
    /// share of `wq_b` and `wo_a`): the step's row ranges are of the whole weight.
    pub(crate) row_offsets: HashMap<Lin, usize>,
}

/// The weight a device holds for layer `l`'s attention linear `id`, with its first row: a
/// rank of a tensor-parallel group holds its share of `wq_b`'s rows (its heads) and of
/// `wo_a`'s (its output groups), where the weight's form cuts there exactly; else the whole.
fn attention_linear<'a>(
    model: &Model,
    id: LinearId,
    weight: &'a Weight,
) -> (Cow<'a, Weight>, usize) {
    let c = &model.config;
    let share = model.tensor_parallel().and_then(|tp| match id {
        LinearId::QB => Some((tp.heads().start * c.head_dim, tp.heads().end * c.head_dim)),
        LinearId::OA => Some((
            tp.groups().start * c.o_lora_rank,
            tp.groups().end * c.o_lora_rank,
        )),
        _ => None,
    });
    match share.and_then(|(from, to)| Some((weight.row_block(from..to)?, from))) {
        Some((block, from)) => (Cow::Owned(block), from),
        None => (Cow::Borrowed(weight), 0),
    }
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
    /// their index among the rank's), its slice of each where it is a rank of an expert-slice
    /// group (`SlicedExperts::held`: rows of `w1`/`w3`, columns of `w2`).
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
        let mut row_offsets = HashMap::new();
        let (mut sinks, mut experts, mut routing) = (Vec::new(), Vec::new(), Vec::new());
        for (l, layer) in w.layers.iter().enumerate() {
            let a = &layer.attn;
            let comp = a.compressor.as_ref();
            let index = a.indexer.as_ref();
            for id in LinearId::ALL {
                if let Some(weight) = a.linear(id) {
                    let (held, from) = attention_linear(model, id, weight);
                    linears.insert(Lin::Attn(l, id), k.upload_rows(&held)?);
                    if from > 0 {
                        row_offsets.insert(Lin::Attn(l, id), from);
                    }
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
            // A rank of a tensor-parallel group attends over its share of the heads.
            let sink = match model.tensor_parallel() {
                Some(tp) => a
                    .sink
                    .get(tp.heads())
                    .ok_or_else(|| format!("layer {l}: {} sinks", a.sink.len()))?,
                None => &a.sink,
            };
            sinks.push(k.upload(sink)?);
            let e = layer
                .moe
                .experts
                .get(held.clone())
                .ok_or_else(|| format!("layer {l} has no experts {held:?}"))?;
            // A rank of an expert-slice group holds its slice of each (a layer's at a time).
            let slices = model
                .sliced_experts()
                .map(|s| e.iter().map(|w| s.held(w)).collect::<Result<Vec<_>, _>>())
                .transpose()
                .map_err(|err| format!("layer {l}: {err}"))?;
            let e = slices.as_deref().unwrap_or(e);
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
            row_offsets,
        })
    }

    /// The first row of `w` the device holds (0 but for a tensor-parallel rank's share).
    pub fn row_offset(&self, w: Lin) -> usize {
        self.row_offsets.get(&w).copied().unwrap_or(0)
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

/// Bytes of the weights [`DeviceModel::upload`] puts on the device for `model`, as stored (the
/// linears, routed experts of the rank, output head and embedding table in their stored forms;
/// the mixing matrices, norms and other vectors in f32): counted before uploading, so a GPU
/// without room refuses with the numbers instead of failing an allocation halfway. A lower
/// bound: a kernel's own forms of the scales and the step's buffers come on top.
pub fn weight_bytes(model: &Model) -> usize {
    let w = &model.weights;
    let held = model
        .expert_parallel()
        .map_or(0..model.config.n_routed_experts, |ep| {
            ep.split().held_by(ep.rank())
        });
    let f32s = |n: usize| 4 * n;
    let mut bytes = w.head.stored_bytes()
        + w.embed.stored_bytes()
        + f32s(w.hc_head.mix.data.len() + w.hc_head.base.len() + w.norm.len());
    for layer in &w.layers {
        let a = &layer.attn;
        bytes += LinearId::ALL
            .iter()
            .filter_map(|&id| {
                a.linear(id)
                    .map(|w| attention_linear(model, id, w).0.stored_bytes())
            })
            .sum::<usize>();
        for h in [&layer.hc_attn, &layer.hc_ffn] {
            bytes += f32s(h.mix.data.len() + h.base.len());
        }
        let shared = &layer.moe.shared;
        bytes += layer.moe.gate.stored_bytes()
            + [&shared.w1, &shared.w2, &shared.w3]
                .iter()
                .map(|w| w.stored_bytes())
                .sum::<usize>();
        // A rank of an expert-slice group holds 1/N of each (FP8 scale tiles aside).
        let slices = model
            .sliced_experts()
            .map_or(1, engine::parallel::sliced::SlicedExperts::size);
        bytes += layer
            .moe
            .experts
            .get(held.clone())
            .into_iter()
            .flatten()
            .map(|e| e.w1.stored_bytes() + e.w2.stored_bytes() + e.w3.stored_bytes())
            .sum::<usize>()
            / slices;
        bytes += f32s(layer.attn_norm.len() + layer.ffn_norm.len() + a.sink.len());
        for c in [
            a.compressor.as_ref(),
            a.indexer.as_ref().map(|i| &i.compressor),
        ]
        .into_iter()
        .flatten()
        {
            bytes += f32s(c.ape.data.len() + c.norm.len());
        }
        bytes += f32s(layer.moe.bias.as_ref().map_or(0, Vec::len));
        bytes += 4 * layer.moe.tid2eid.as_ref().map_or(0, Vec::len);
    }
    bytes
}

/// Refuses a device step whose weights (`needed` bytes, [`weight_bytes`]) do not fit the
/// `free` bytes of GPU `ordinal` (`total` in all), with the numbers and what to do.
pub fn check_weight_room(
    ordinal: usize,
    needed: usize,
    (free, total): (usize, usize),
) -> Result<(), String> {
    let gb = |b: usize| b as f64 / 1e9;
    if needed > free {
        return Err(format!(
            "GPU {ordinal}: the device step's weights need at least {:.2} GB and {:.2} GB of \
             its {:.2} GB are free; spread the routed experts over more GPUs (--ep N \
             --dp-attention, or --tp N --ep N: each holds 1/N of them; or --tp N --moe-tp: \
             each holds 1/N of every one; pdctl plan shows a group's bytes per GPU)",
            gb(needed),
            gb(free),
            gb(total)
        ));
    }
    Ok(())
}

/// Layer `l`'s item of a per-layer list.
pub fn at_layer<T, E: From<String>>(items: &[T], l: usize) -> Result<&T, E> {
    items.get(l).ok_or_else(|| format!("no layer {l}").into())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use std::{sync::Arc, time::Duration};

    use engine::{
        config::ExpertFormat,
        parallel::{collective::InProcessGroup, expert::ExpertParallel},
        synth::{GenerateOptions, Preset, generate},
    };

    use super::*;

    /// A synthetic checkpoint of `preset` with NVFP4 experts (seed 3).
    fn nvfp4_checkpoint(preset: Preset) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(preset, 3, ExpertFormat::Nvfp4, dir.path());
        generate(&options).unwrap();
        dir
    }

    /// The weights counted are the stored ones the upload takes: at least the linears, the
    /// routed experts, the head and the table; a rank of an expert-parallel group counts its
    /// share of the routed experts only; a GPU without the room is refused with the numbers.
    #[test]
    fn weight_bytes_count_the_ranks_share_and_too_little_room_is_refused() {
        let dir = nvfp4_checkpoint(Preset::Tiny);
        let mut model = Model::load(dir.path()).unwrap();
        let w = &model.weights;
        let experts: usize = w
            .layers
            .iter()
            .flat_map(|l| &l.moe.experts)
            .map(|e| e.w1.stored_bytes() + e.w2.stored_bytes() + e.w3.stored_bytes())
            .sum();
        let whole = weight_bytes(&model);
        assert!(whole > experts + w.head.stored_bytes() + w.embed.stored_bytes());
        let mut ranks = InProcessGroup::new(2, Duration::from_secs(5));
        let rank = ranks.remove(0);
        let ep = ExpertParallel::new(Box::new(rank), model.config.n_routed_experts).unwrap();
        model.set_expert_parallel(Arc::new(ep));
        assert_eq!(weight_bytes(&model), whole - experts / 2);
        assert!(check_weight_room(0, whole, (whole, 2 * whole)).is_ok());
        let refused =
            check_weight_room(1, 164_000_000_000, (140_000_000_000, 143_000_000_000)).unwrap_err();
        assert!(refused.contains("GPU 1"), "{refused}");
        assert!(
            refused.contains("164.00 GB") && refused.contains("140.00 GB"),
            "{refused}"
        );
        assert!(refused.contains("--ep N --dp-attention"), "{refused}");
    }

    /// A rank of an expert-slice group holds, uploads and counts its slice of every routed
    /// expert (half of each over 2 ranks: rows of `w1`/`w3`, columns of `w2`); over 4 ranks
    /// the slices of 8 values would cut NVFP4's scale blocks of 16, and the upload is refused
    /// naming them.
    #[test]
    fn an_expert_slice_rank_holds_its_slice_of_every_expert() {
        use crate::step::{emulated::EmulatedKernels, kernels::Kernels};
        use engine::parallel::sliced::SlicedExperts;

        let dir = nvfp4_checkpoint(Preset::Tiny);
        let one = Model::load(dir.path()).unwrap();
        let c = one.config.clone();
        let experts: usize = one
            .weights
            .layers
            .iter()
            .flat_map(|l| &l.moe.experts)
            .map(|e| e.w1.stored_bytes() + e.w2.stored_bytes() + e.w3.stored_bytes())
            .sum();
        let whole = weight_bytes(&one);
        let k = EmulatedKernels::new(&c);
        for (ranks, held) in [(2usize, true), (4, false)] {
            let mut model = one.replica();
            let rank = InProcessGroup::new(ranks, Duration::from_secs(5)).remove(1);
            let sliced = SlicedExperts::new(Box::new(rank), c.moe_intermediate_size).unwrap();
            model.set_sliced_experts(Arc::new(sliced));
            assert_eq!(weight_bytes(&model), whole - experts + experts / ranks);
            let upload = DeviceModel::upload(&k, &model);
            if !held {
                let err = upload.err().unwrap().to_string();
                assert!(
                    err.contains("down columns") && err.contains("8..16"),
                    "{err}"
                );
                continue;
            }
            let device = upload.unwrap();
            let (n, slice, d) = (
                c.n_routed_experts,
                c.moe_intermediate_size / 2,
                c.hidden_size,
            );
            let [gate, up, down] = &device.experts[0];
            assert_eq!(EmulatedKernels::stack_shape(gate), (n, slice, d));
            assert_eq!(EmulatedKernels::stack_shape(up), (n, slice, d));
            assert_eq!(EmulatedKernels::stack_shape(down), (n, d, slice));
        }
    }

    /// A rank of a tensor-parallel group holds its share of `wq_b`'s and `wo_a`'s rows where
    /// their FP8 blocks cut there (the small model's: 4 of 8 heads of 64, 2 of 4 groups of 64),
    /// counts only those, and its step computes the rows of its share exactly as one rank's.
    #[test]
    fn a_tensor_parallel_rank_holds_and_computes_its_share_of_the_heads() {
        use crate::step::{StepOps, View, device_ops::DeviceStepOps, emulated::EmulatedKernels};
        use engine::{parallel::tensor::TensorParallel, synth::Rng};

        let dir = nvfp4_checkpoint(Preset::Small);
        let one = Model::load(dir.path()).unwrap();
        let mut shared = one.replica();
        let mut ranks = InProcessGroup::new(2, Duration::from_secs(5));
        let tp = TensorParallel::new(Box::new(ranks.remove(1)), &one.config).unwrap();
        shared.set_tensor_parallel(Arc::new(tp));
        let c = &one.config;
        let halves: usize = one
            .weights
            .layers
            .iter()
            .map(|l| l.attn.wq_b.stored_bytes() / 2 + l.attn.wo_a.stored_bytes() / 2)
            .sum();
        assert_eq!(weight_bytes(&shared), weight_bytes(&one) - halves);
        let ops = DeviceStepOps::new(EmulatedKernels::new(c), &shared).unwrap();
        let whole = DeviceStepOps::new(EmulatedKernels::new(c), &one).unwrap();
        let (q_rows, o_rows) = (4 * c.head_dim, 2 * c.o_lora_rank);
        let mut rng = Rng::for_tensor(4, "tp-rows");
        for l in 0..c.num_layers() {
            for (id, from, cols) in [
                (LinearId::QB, q_rows, c.q_lora_rank),
                (LinearId::OA, o_rows, c.num_heads * c.head_dim / c.o_groups),
            ] {
                let w = Lin::Attn(l, id);
                assert_eq!(ops.model.row_offset(w), from, "{w:?}");
                let x: Vec<f32> = (0..3 * cols).map(|_| rng.normal()).collect();
                let mut got = Vec::new();
                for o in [&ops, &whole] {
                    let mut xb = o.alloc(x.len()).unwrap();
                    o.put_at(&mut xb, 0, &x).unwrap();
                    let mut y = o.alloc(3 * from).unwrap();
                    let rows = from..2 * from;
                    o.linear(w, rows, &xb, View::rows(cols), &mut y, View::rows(from), 3)
                        .unwrap();
                    got.push(o.get(&y, 0..3 * from).unwrap());
                }
                assert!(
                    got[0]
                        .iter()
                        .zip(&got[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
                let below = ops.linear(
                    w,
                    0..from,
                    &step_buffer(&ops, 3 * cols),
                    View::rows(cols),
                    &mut step_buffer(&ops, 3 * from),
                    View::rows(from),
                    3,
                );
                assert!(below.is_err(), "rows the rank does not hold");
            }
        }
    }

    fn step_buffer(
        ops: &crate::step::device_ops::DeviceStepOps<crate::step::emulated::EmulatedKernels>,
        n: usize,
    ) -> crate::step::device_ops::DBuf<crate::step::emulated::EmulatedKernels> {
        use crate::step::StepOps;
        ops.alloc(n).unwrap()
    }
}
