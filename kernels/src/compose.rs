//! How the CUDA backend composes kernels into the engine's ops, written once over [`Ops`] (the
//! few device operations it needs) so the same composition runs on the GPU
//! (`cuda::CudaBackend`) and on the kernels' CPU references ([`CpuOps`]). The tests here check
//! the compositions against the engine's own code on any machine; on a GPU each kernel is
//! checked against its reference, so together they cover the backend's path.

use engine::backend::AttendBatch;

/// Inputs a composition cannot take (their shapes or indices), in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(pub String);

impl From<String> for ShapeError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

/// A projection of an expert: gate `w1` `[inter, hidden]`, down `w2` `[hidden, inter]`, up
/// `w3` `[inter, hidden]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proj {
    Gate,
    Down,
    Up,
}

/// Shapes the compositions need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertDims {
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub limit: f32,
}

/// The device operations of the compositions. Buffers are created poisoned (NaN) so an
/// operation that writes nothing cannot pass for a result.
pub trait Ops {
    type Error: From<String>;
    /// A buffer of f32.
    type Buf;
    /// A buffer of i32 indices.
    type Idx;

    fn put(&self, values: &[f32]) -> Result<Self::Buf, Self::Error>;
    fn put_idx(&self, values: &[i32]) -> Result<Self::Idx, Self::Error>;
    fn poisoned(&self, len: usize) -> Result<Self::Buf, Self::Error>;
    fn get(&self, buf: &Self::Buf) -> Result<Vec<f32>, Self::Error>;
    /// `y[p] = W_proj[expert[p]] · x[token[p]]` over the layer's routed experts.
    fn grouped(
        &self,
        proj: Proj,
        x: &Self::Buf,
        token: &Self::Idx,
        expert: &Self::Idx,
        pairs: usize,
        y: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// `y[v] = S_proj · x[v]` over the layer's shared expert.
    fn dense(
        &self,
        proj: Proj,
        x: &Self::Buf,
        vectors: usize,
        y: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// `out = silu(min(g, limit)) * clamp(u, -limit, limit)` over `n` values.
    fn swiglu(
        &self,
        gate: &Self::Buf,
        up: &Self::Buf,
        n: usize,
        limit: f32,
        out: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
}

/// Pairs per grouped launch (the kernels' grid y is at most 65535).
pub const PAIRS_PER_LAUNCH: usize = 65_535;

/// The routed experts of one layer: one full expert output (`hidden` values) per pair (token
/// row of `xs`, expert), in pair order: gate and up as grouped GEMVs over the pairs, SwiGLU,
/// then down with each pair reading its own activation row.
pub fn routed_experts<O: Ops>(
    ops: &O,
    dims: ExpertDims,
    xs: &[Vec<f32>],
    pairs: &[(usize, usize)],
) -> Result<Vec<Vec<f32>>, O::Error> {
    if let Some(&(t, e)) = pairs
        .iter()
        .find(|&&(t, e)| t >= xs.len() || e >= dims.experts)
    {
        return Err(format!(
            "pair (token {t}, expert {e}) with {} tokens and {} experts",
            xs.len(),
            dims.experts
        )
        .into());
    }
    check_inputs(xs, dims.hidden)?;
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    let x = ops.put(&xs.concat())?;
    let mut out = Vec::with_capacity(pairs.len());
    for group in pairs.chunks(PAIRS_PER_LAUNCH) {
        let n = group.len();
        let tokens = ops.put_idx(&indices(group.iter().map(|&(t, _)| t))?)?;
        let experts = ops.put_idx(&indices(group.iter().map(|&(_, e)| e))?)?;
        let own_rows = ops.put_idx(&indices(0..n)?)?;
        let mut gate = ops.poisoned(n * dims.inter)?;
        let mut up = ops.poisoned(n * dims.inter)?;
        let mut act = ops.poisoned(n * dims.inter)?;
        let mut y = ops.poisoned(n * dims.hidden)?;
        ops.grouped(Proj::Gate, &x, &tokens, &experts, n, &mut gate)?;
        ops.grouped(Proj::Up, &x, &tokens, &experts, n, &mut up)?;
        ops.swiglu(&gate, &up, n * dims.inter, dims.limit, &mut act)?;
        ops.grouped(Proj::Down, &act, &own_rows, &experts, n, &mut y)?;
        out.extend(split(&ops.get(&y)?, dims.hidden));
    }
    Ok(out)
}

/// The shared expert of one layer for every row of `xs`: gate and up, SwiGLU, down.
pub fn shared_expert<O: Ops>(
    ops: &O,
    dims: ExpertDims,
    xs: &[Vec<f32>],
) -> Result<Vec<Vec<f32>>, O::Error> {
    check_inputs(xs, dims.hidden)?;
    let n = xs.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let x = ops.put(&xs.concat())?;
    let mut gate = ops.poisoned(n * dims.inter)?;
    let mut up = ops.poisoned(n * dims.inter)?;
    let mut act = ops.poisoned(n * dims.inter)?;
    let mut y = ops.poisoned(n * dims.hidden)?;
    ops.dense(Proj::Gate, &x, n, &mut gate)?;
    ops.dense(Proj::Up, &x, n, &mut up)?;
    ops.swiglu(&gate, &up, n * dims.inter, dims.limit, &mut act)?;
    ops.dense(Proj::Down, &act, n, &mut y)?;
    Ok(split(&ops.get(&y)?, dims.hidden))
}

/// The attention core of a chunk as the decode-attention kernel reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedAttend {
    /// The distinct rows, f32 little-endian, one after another.
    pub pool: Vec<u8>,
    /// Byte offset in `pool` of each key of each token, tokens one after another.
    pub offsets: Vec<i64>,
    /// Token `t`'s keys are `offsets[starts[t]..starts[t + 1]]`.
    pub starts: Vec<i64>,
    /// `[tokens, heads, head_dim]`.
    pub queries: Vec<f32>,
}

/// Packs an attention-core batch for the decode-attention kernel, checking every index.
pub fn pack_attend(b: &AttendBatch<'_>) -> Result<PackedAttend, ShapeError> {
    let width = b.heads * b.head_dim;
    if b.keys.len() != b.queries.len()
        || b.sinks.len() != b.heads
        || b.queries.iter().any(|q| q.len() != width)
        || b.rows.iter().any(|r| r.len() != b.head_dim)
        || b.keys.iter().flatten().any(|&k| k >= b.rows.len())
    {
        return Err(ShapeError(format!(
            "attention: {} tokens, {} rows of {}, {} heads",
            b.queries.len(),
            b.rows.len(),
            b.head_dim,
            b.heads
        )));
    }
    let row_bytes = 4 * b.head_dim;
    let pool = b
        .rows
        .iter()
        .flat_map(|r| r.iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    let mut offsets = Vec::with_capacity(b.keys.iter().map(Vec::len).sum());
    let mut starts = vec![0i64];
    for keys in b.keys {
        for &k in keys {
            offsets.push(i64::try_from(k * row_bytes).map_err(|_| ShapeError(format!("row {k}")))?);
        }
        starts.push(
            i64::try_from(offsets.len()).map_err(|_| ShapeError("too many keys".to_owned()))?,
        );
    }
    Ok(PackedAttend {
        pool,
        offsets,
        starts,
        queries: b.queries.concat(),
    })
}

fn check_inputs<E: From<String>>(xs: &[Vec<f32>], hidden: usize) -> Result<(), E> {
    match xs.iter().find(|x| x.len() != hidden) {
        Some(x) => Err(format!("input of {} values, not {hidden}", x.len()).into()),
        None => Ok(()),
    }
}

fn indices<E: From<String>>(values: impl Iterator<Item = usize>) -> Result<Vec<i32>, E> {
    values
        .map(|v| i32::try_from(v).map_err(|_| format!("index {v} beyond i32").into()))
        .collect()
}

fn split(flat: &[f32], width: usize) -> Vec<Vec<f32>> {
    flat.chunks_exact(width).map(<[f32]>::to_vec).collect()
}

/// The compositions' operations on the kernels' CPU references, for one layer: its routed
/// experts (FP4, stacked) and its shared expert (f32 weights, computed as the references do).
#[derive(Debug, Clone)]
pub struct CpuOps<'a> {
    pub gate: crate::cpu::Experts<'a>,
    pub up: crate::cpu::Experts<'a>,
    pub down: crate::cpu::Experts<'a>,
    /// `(w1, w2, w3)` of the shared expert, f32 row-major.
    pub shared: (&'a [f32], &'a [f32], &'a [f32]),
    pub dims: ExpertDims,
}

impl Ops for CpuOps<'_> {
    type Error = ShapeError;
    type Buf = Vec<f32>;
    type Idx = Vec<i32>;

    fn put(&self, values: &[f32]) -> Result<Vec<f32>, ShapeError> {
        Ok(values.to_vec())
    }

    fn put_idx(&self, values: &[i32]) -> Result<Vec<i32>, ShapeError> {
        Ok(values.to_vec())
    }

    fn poisoned(&self, len: usize) -> Result<Vec<f32>, ShapeError> {
        Ok(vec![f32::NAN; len])
    }

    fn get(&self, buf: &Vec<f32>) -> Result<Vec<f32>, ShapeError> {
        Ok(buf.clone())
    }

    fn grouped(
        &self,
        proj: Proj,
        x: &Vec<f32>,
        token: &Vec<i32>,
        expert: &Vec<i32>,
        pairs: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        let (stack, rows, cols) = match proj {
            Proj::Gate => (self.gate, self.dims.inter, self.dims.hidden),
            Proj::Up => (self.up, self.dims.inter, self.dims.hidden),
            Proj::Down => (self.down, self.dims.hidden, self.dims.inter),
        };
        let as_usize =
            |v: &[i32]| -> Vec<usize> { v[..pairs].iter().map(|&i| i as usize).collect() };
        let out =
            crate::cpu::grouped_gemv(stack, x, &as_usize(token), &as_usize(expert), rows, cols)
                .map_err(|e| ShapeError(e.to_string()))?;
        y[..out.len()].copy_from_slice(&out);
        Ok(())
    }

    fn dense(
        &self,
        proj: Proj,
        x: &Vec<f32>,
        vectors: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        let (w, rows, cols) = match proj {
            Proj::Gate => (self.shared.0, self.dims.inter, self.dims.hidden),
            Proj::Down => (self.shared.1, self.dims.hidden, self.dims.inter),
            Proj::Up => (self.shared.2, self.dims.inter, self.dims.hidden),
        };
        for v in 0..vectors {
            let xv = &x[v * cols..(v + 1) * cols];
            for r in 0..rows {
                let dot: f64 = w[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(xv)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                y[v * rows + r] = dot as f32;
            }
        }
        Ok(())
    }

    fn swiglu(
        &self,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        n: usize,
        limit: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        out[..n].copy_from_slice(&crate::cpu::swiglu_clamp(&gate[..n], &up[..n], limit));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use engine::{
        config::ExpertFormat,
        model::{Model, moe},
        synth::{GenerateOptions, Preset, Rng, generate},
        weights::stored::StoredWeights,
    };

    use super::*;
    use crate::cpu::Experts;

    /// One layer's stacked expert projections, owned (packed, scales, global scales).
    type Stack = (ExpertFormat, (Vec<u8>, Vec<u8>, Vec<f32>));

    fn model(format: ExpertFormat) -> (tempfile::TempDir, Model, Vec<[Stack; 3]>) {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 13, format, dir.path());
        generate(&options).unwrap();
        let model = Model::load(dir.path()).unwrap();
        let stored = StoredWeights::open(dir.path(), &model.config).unwrap();
        let layers = (0..model.config.num_layers())
            .map(|layer| {
                let l = stored.fp4_layer(layer).unwrap();
                [&l.w1, &l.w2, &l.w3].map(|s| (s.format, s.concat()))
            })
            .collect();
        (dir, model, layers)
    }

    fn experts(stack: &Stack) -> Experts<'_> {
        let (format, (packed, scales, scale_2)) = stack;
        match format {
            ExpertFormat::Nvfp4 => Experts::Nvfp4 {
                packed,
                scales,
                scale_2,
            },
            _ => Experts::Mxfp4 { packed, scales },
        }
    }

    fn close(got: &[f32], want: &[f32], what: &str) {
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * scale, "{what} at {i}: {g} vs {w}");
        }
    }

    /// The backend's expert compositions on the CPU references give the engine's own expert
    /// outputs: right projections in the right order, the activation rows paired back to their
    /// experts, ragged pairs (a token with several experts, repeated experts, unused tokens).
    #[test]
    fn expert_compositions_match_the_engine() {
        for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
            let (_dir, model, layers) = model(format);
            let c = &model.config;
            let mut rng = Rng::for_tensor(2, "compose");
            for (l, stored) in layers.iter().enumerate() {
                let moe_w = &model.weights.layers[l].moe;
                let shared_f32 = [&moe_w.shared.w1, &moe_w.shared.w2, &moe_w.shared.w3]
                    .map(engine::tensor::Weight::to_f32);
                let dims = ExpertDims {
                    hidden: c.hidden_size,
                    inter: c.moe_intermediate_size,
                    experts: c.n_routed_experts,
                    limit: c.swiglu_limit,
                };
                let ops = CpuOps {
                    gate: experts(&stored[0]),
                    up: experts(&stored[2]),
                    down: experts(&stored[1]),
                    shared: (&shared_f32[0], &shared_f32[1], &shared_f32[2]),
                    dims,
                };
                let xs: Vec<Vec<f32>> = (0..4)
                    .map(|_| (0..c.hidden_size).map(|_| rng.normal()).collect())
                    .collect();
                let last = c.n_routed_experts - 1;
                let pairs = [(0, 1), (0, last), (2, 1), (3, 0), (2, last), (3, 1)];
                let got = routed_experts(&ops, dims, &xs, &pairs).unwrap();
                assert_eq!(got.len(), pairs.len());
                for (y, &(t, e)) in got.iter().zip(&pairs) {
                    let want = moe::expert(&moe_w.experts[e], &xs[t], c.swiglu_limit);
                    close(y, &want, &format!("{format:?} layer {l} pair ({t}, {e})"));
                }
                let shared = shared_expert(&ops, dims, &xs).unwrap();
                for (t, y) in shared.iter().enumerate() {
                    let want = moe::expert(&moe_w.shared, &xs[t], c.swiglu_limit);
                    close(y, &want, &format!("{format:?} layer {l} shared {t}"));
                }
                assert!(routed_experts(&ops, dims, &xs, &[]).unwrap().is_empty());
                let err = routed_experts(&ops, dims, &xs, &[(4, 0)]).unwrap_err();
                assert!(err.0.contains("token 4"), "{err}");
                let err = routed_experts(&ops, dims, &xs, &[(0, last + 1)]).unwrap_err();
                assert!(err.0.contains("experts"), "{err}");
            }
        }
    }

    /// The packed attention batch, read the way the kernel reads it (rows at the byte offsets,
    /// per-token ranges), gives the attention core computed straight from the batch.
    #[test]
    fn packed_attention_is_the_batch() {
        let mut rng = Rng::for_tensor(3, "pack attend");
        let (heads, dim) = (3usize, 8usize);
        let rows: Vec<Vec<f32>> = (0..7)
            .map(|_| (0..dim).map(|_| rng.normal()).collect())
            .collect();
        let row_refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let keys = vec![vec![0usize], vec![3, 1, 6, 0], vec![5, 5, 2]];
        let queries: Vec<Vec<f32>> = (0..keys.len())
            .map(|_| (0..heads * dim).map(|_| rng.normal()).collect())
            .collect();
        let sinks: Vec<f32> = (0..heads).map(|_| rng.normal()).collect();
        let batch = AttendBatch {
            layer: 0,
            heads,
            head_dim: dim,
            rows: &row_refs,
            queries: &queries,
            keys: &keys,
            sinks: &sinks,
            scale: 0.35,
        };
        let packed = pack_attend(&batch).unwrap();
        let read: Vec<Vec<f32>> = packed
            .offsets
            .iter()
            .map(|&o| {
                let at = o as usize;
                packed.pool[at..at + 4 * dim]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            })
            .collect();
        let starts: Vec<usize> = packed.starts.iter().map(|&s| s as usize).collect();
        let got = crate::cpu::attn_decode(&packed.queries, &read, &starts, &sinks, dim, 0.35);
        // Straight from the batch: token t over rows[keys[t]].
        for (t, token_keys) in keys.iter().enumerate() {
            let mine: Vec<Vec<f32>> = token_keys.iter().map(|&k| rows[k].clone()).collect();
            let want =
                crate::cpu::attn_decode(&queries[t], &mine, &[0, mine.len()], &sinks, dim, 0.35);
            assert_eq!(&got[t * heads * dim..(t + 1) * heads * dim], &want[..]);
        }
        let bad_keys = vec![vec![7usize]];
        let bad = AttendBatch {
            keys: &bad_keys,
            queries: &queries[..1],
            ..batch
        };
        assert!(pack_attend(&bad).is_err());
    }
}
