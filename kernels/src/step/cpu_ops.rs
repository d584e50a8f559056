//! [`StepOps`] on host buffers, each op the engine's own code (the functions its forward pass
//! calls, on the same values in the same order), so the decode step over these ops is the
//! engine's forward pass and the reference of the device's ops. Counts what a step reads back
//! to the host, so tests can hold a step to reading nothing but its logits.

use std::{cell::Cell, ops::Range};

use engine::{
    model::{Model, attention, compressor, hyper, moe},
    rope::Rope,
    tensor::{Matrix, Weight, rms_norm, rms_norm_unweighted},
    weights::{CompressorWeights, HyperWeights, LayerWeights},
};

use super::{
    CHOSEN_EMPTY, CHOSEN_POISONED, Comp, Compressed, IndexAt, Lin, Mixed, Norm, Proj, RopeKind,
    RowOp, ShapeError, StepOps, Sub, TokenKeys, Vector, View, WindowClose,
    layout::{kv_stride, pack_kv_row, unpack_kv_row},
};

/// The engine's ops over a loaded model's weights.
#[derive(Debug)]
pub struct CpuStepOps<'m> {
    model: &'m Model,
    main: Rope,
    compress: Rope,
    reads: Cell<(usize, usize)>,
    plant: Cell<Option<Plant>>,
}

/// An error put into an op on purpose, to show the tests catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// Attention sums the window rows newest first.
    WindowOrder,
    /// A closed window's gate scores lack the position bias.
    NoPositionBias,
    /// A closed window leaves the overlap slices as they were.
    StaleOverlap,
    /// The MoE adds the shared expert before the routed slots.
    SharedFirst,
}

impl Plant {
    pub const ALL: [Plant; 4] = [
        Plant::WindowOrder,
        Plant::NoPositionBias,
        Plant::StaleOverlap,
        Plant::SharedFirst,
    ];
}

/// A linear's weight as the engine holds it.
enum Linear<'m> {
    Weight(&'m Weight),
    Matrix(&'m Matrix),
}

impl<'m> CpuStepOps<'m> {
    pub fn new(model: &'m Model) -> Self {
        let (main, compress) = Rope::tables(&model.config);
        Self {
            model,
            main,
            compress,
            reads: Cell::new((0, 0)),
            plant: Cell::new(None),
        }
    }

    /// Puts `plant` into the ops (or takes it out): for tests that must fail.
    pub fn plant(&self, plant: Option<Plant>) {
        self.plant.set(plant);
    }

    fn planted(&self, plant: Plant) -> bool {
        self.plant.get() == Some(plant)
    }

    /// (calls, values) of [`StepOps::get`] since the last call, and starts counting again.
    pub fn take_reads(&self) -> (usize, usize) {
        self.reads.replace((0, 0))
    }

    fn linear_weight(&self, w: Lin) -> Result<Linear<'m>, ShapeError> {
        use engine::backend::LinearId as L;
        let m = &self.model.weights;
        let layer = |l: usize| {
            m.layers
                .get(l)
                .ok_or_else(|| ShapeError(format!("{w:?}: no layer {l}")))
        };
        Ok(match w {
            Lin::Attn(l, id) => {
                let a = &layer(l)?.attn;
                Linear::Weight(match id {
                    L::QA => &a.wq_a,
                    L::QB => &a.wq_b,
                    L::Kv => &a.wkv,
                    L::OA => &a.wo_a,
                    L::OB => &a.wo_b,
                    L::CompressorKv => &self.compressor(l, Comp::Attn)?.wkv,
                    L::CompressorGate => &self.compressor(l, Comp::Attn)?.wgate,
                    L::IndexerCompressorKv => &self.compressor(l, Comp::Index)?.wkv,
                    L::IndexerCompressorGate => &self.compressor(l, Comp::Index)?.wgate,
                    L::IndexerQB | L::IndexerWeights => {
                        let index = a.indexer.as_ref().ok_or_else(|| no_indexer(l))?;
                        if id == L::IndexerQB {
                            &index.wq_b
                        } else {
                            &index.weights_proj
                        }
                    }
                })
            }
            Lin::Mix(l, sub) => Linear::Matrix(&self.hyper(l, sub)?.mix),
            Lin::Gate(l) => Linear::Weight(&layer(l)?.moe.gate),
            Lin::Shared(l, proj) => {
                let s = &layer(l)?.moe.shared;
                Linear::Weight(match proj {
                    Proj::Gate => &s.w1,
                    Proj::Down => &s.w2,
                    Proj::Up => &s.w3,
                })
            }
            Lin::Head => Linear::Weight(&m.head),
        })
    }

    fn layer(&self, l: usize) -> Result<&'m LayerWeights, ShapeError> {
        self.model
            .weights
            .layers
            .get(l)
            .ok_or_else(|| ShapeError(format!("no layer {l}")))
    }

    fn hyper(&self, l: usize, sub: Sub) -> Result<&'m HyperWeights, ShapeError> {
        let layer = self.layer(l)?;
        Ok(match sub {
            Sub::Attn => &layer.hc_attn,
            Sub::Ffn => &layer.hc_ffn,
        })
    }

    fn vector(&self, v: Vector) -> Result<&'m [f32], ShapeError> {
        Ok(match v {
            Vector::AttnNorm(l) => &self.layer(l)?.attn_norm,
            Vector::FfnNorm(l) => &self.layer(l)?.ffn_norm,
            Vector::QNorm(l) => &self.layer(l)?.attn.q_norm,
            Vector::KvNorm(l) => &self.layer(l)?.attn.kv_norm,
            Vector::CompressorNorm(l, comp) => &self.compressor(l, comp)?.norm,
            Vector::FinalNorm => &self.model.weights.norm,
        })
    }

    fn compressor(&self, l: usize, comp: Comp) -> Result<&'m CompressorWeights, ShapeError> {
        let a = &self.layer(l)?.attn;
        match comp {
            Comp::Attn => a
                .compressor
                .as_ref()
                .ok_or_else(|| ShapeError(format!("layer {l} has no compressor"))),
            Comp::Index => a
                .indexer
                .as_ref()
                .map(|i| &i.compressor)
                .ok_or_else(|| no_indexer(l)),
        }
    }

    fn rope(&self, kind: RopeKind) -> &Rope {
        match kind {
            RopeKind::Main => &self.main,
            RopeKind::Compress => &self.compress,
        }
    }

    fn hc_dim(&self) -> (usize, usize) {
        (self.model.config.hc_mult, self.model.config.hidden_size)
    }
}

fn no_indexer(l: usize) -> ShapeError {
    ShapeError(format!("layer {l} has no indexer"))
}

fn short(what: &str) -> ShapeError {
    ShapeError(format!("{what}: a buffer is shorter than the op reads"))
}

fn rows_of(buf: &[f32], width: usize, n: usize, what: &str) -> Result<Vec<Vec<f32>>, ShapeError> {
    let v = buf.get(..n * width).ok_or_else(|| short(what))?;
    Ok(if width == 0 {
        vec![Vec::new(); n]
    } else {
        v.chunks_exact(width).map(<[f32]>::to_vec).collect()
    })
}

impl StepOps for CpuStepOps<'_> {
    type Error = ShapeError;
    type Buf = Vec<f32>;
    type Idx = Vec<i32>;

    fn alloc(&self, len: usize) -> Result<Vec<f32>, ShapeError> {
        Ok(vec![f32::NAN; len])
    }

    fn put_at(&self, buf: &mut Vec<f32>, offset: usize, values: &[f32]) -> Result<(), ShapeError> {
        buf.get_mut(offset..offset + values.len())
            .ok_or_else(|| short("put_at"))?
            .copy_from_slice(values);
        Ok(())
    }

    fn put_idx(&self, values: &[i32]) -> Result<Vec<i32>, ShapeError> {
        Ok(values.to_vec())
    }

    fn get(&self, buf: &Vec<f32>, range: Range<usize>) -> Result<Vec<f32>, ShapeError> {
        let (calls, values) = self.reads.get();
        self.reads.set((calls + 1, values + range.len()));
        Ok(buf.get(range).ok_or_else(|| short("get"))?.to_vec())
    }

    fn get_many(&self, parts: &[(&Vec<f32>, Range<usize>)]) -> Result<Vec<Vec<f32>>, ShapeError> {
        let values: usize = parts.iter().map(|(_, r)| r.len()).sum();
        let (calls, total) = self.reads.get();
        self.reads.set((calls + 1, total + values));
        parts
            .iter()
            .map(|(b, r)| Ok(b.get(r.clone()).ok_or_else(|| short("get_many"))?.to_vec()))
            .collect()
    }

    fn argmax_rows(&self, x: &Vec<f32>, rows: usize, width: usize) -> Result<Vec<i32>, ShapeError> {
        let x = x.get(..rows * width).ok_or_else(|| short("argmax_rows"))?;
        Ok(x.chunks_exact(width.max(1))
            .take(rows)
            .flat_map(|row| match engine::sampling::argmax(row) {
                Ok(token) => [token as i32, -1],
                Err(at) => [0, at as i32],
            })
            .collect())
    }

    fn get_idx(&self, b: &Vec<i32>, range: Range<usize>) -> Result<Vec<i32>, ShapeError> {
        let (calls, values) = self.reads.get();
        self.reads.set((calls + 1, values + range.len()));
        Ok(b.get(range).ok_or_else(|| short("get_idx"))?.to_vec())
    }

    fn copy(&self, buf: &Vec<f32>, len: usize) -> Result<Vec<f32>, ShapeError> {
        Ok(buf.get(..len).ok_or_else(|| short("copy"))?.to_vec())
    }

    fn embed(&self, tokens: &Vec<i32>, n: usize) -> Result<Vec<f32>, ShapeError> {
        let (hc, _) = self.hc_dim();
        let embed = &self.model.weights.embed;
        let mut out = Vec::new();
        for &t in tokens.get(..n).ok_or_else(|| short("embed"))? {
            let t = usize::try_from(t)
                .ok()
                .filter(|&t| t < embed.rows)
                .ok_or_else(|| ShapeError(format!("embed: token {t} outside the table")))?;
            out.extend(embed.row_f32(t).repeat(hc));
        }
        Ok(out)
    }

    fn linear(
        &self,
        w: Lin,
        rows: Range<usize>,
        x: &Vec<f32>,
        x_view: View,
        y: &mut Vec<f32>,
        y_view: View,
        n: usize,
    ) -> Result<(), ShapeError> {
        let weight = self.linear_weight(w)?;
        let (total, cols) = match weight {
            Linear::Weight(m) => (m.rows, m.cols),
            Linear::Matrix(m) => (m.rows, m.cols),
        };
        if rows.end > total {
            return Err(ShapeError(format!("{w:?}: rows {rows:?} of {total}")));
        }
        let inputs: Vec<&[f32]> = (0..n)
            .map(|t| {
                let at = t * x_view.stride + x_view.start;
                x.get(at..at + cols).ok_or_else(|| short("linear input"))
            })
            .collect::<Result<_, _>>()?;
        let outs = match weight {
            Linear::Weight(m) => m.apply_rows_many(rows.start, rows.len(), &inputs),
            Linear::Matrix(m) => m.apply_rows_many(rows.start, rows.len(), &inputs),
        };
        for (t, out) in outs.iter().enumerate() {
            let at = t * y_view.stride + y_view.start;
            y.get_mut(at..at + out.len())
                .ok_or_else(|| short("linear output"))?
                .copy_from_slice(out);
        }
        Ok(())
    }

    fn round_kv_rows(&self, rows: &mut Vec<f32>, n: usize) -> Result<(), ShapeError> {
        let hd = self.model.config.head_dim;
        let rows = rows
            .get_mut(..n * hd)
            .ok_or_else(|| short("round_kv_rows"))?;
        for row in rows.chunks_exact_mut(hd) {
            engine::paged::codec::round(self.model.kv_rows(), row);
        }
        Ok(())
    }

    fn norm_rope(&self, x: &mut Vec<f32>, op: &RowOp<'_>, n: usize) -> Result<(), ShapeError> {
        let eps = self.model.config.rms_norm_eps;
        let width = op.heads * op.head_dim;
        let rows = x.get_mut(..n * width).ok_or_else(|| short("norm_rope"))?;
        for (t, row) in rows.chunks_exact_mut(width.max(1)).enumerate() {
            let rotation = match op.rope {
                Some((kind, positions)) => Some(
                    self.rope(kind).at(*positions
                        .get(t)
                        .ok_or_else(|| short("norm_rope positions"))?),
                ),
                None => None,
            };
            for head in row.chunks_exact_mut(op.head_dim) {
                match op.norm {
                    Norm::None => {}
                    Norm::Unweighted => rms_norm_unweighted(head, eps),
                    Norm::Weighted(v) => rms_norm(head, self.vector(v)?, eps),
                }
                if let Some(rotation) = &rotation {
                    rotation.apply(head, op.inverse);
                }
            }
        }
        Ok(())
    }

    fn hyper_pre(
        &self,
        layer: usize,
        sub: Sub,
        x: &Vec<f32>,
        mixes: &Vec<f32>,
        n: usize,
    ) -> Result<Mixed<Vec<f32>>, ShapeError> {
        let (hc, d) = self.hc_dim();
        let w = self.hyper(layer, sub)?;
        let xs = rows_of(x, hc * d, n, "hyper_pre streams")?;
        let ms = rows_of(mixes, (2 + hc) * hc, n, "hyper_pre mixes")?;
        let (mut collapsed, mut post, mut comb) = (Vec::new(), Vec::new(), Vec::new());
        for (x, m) in xs.iter().zip(&ms) {
            let (mix, c) = hyper::pre_from_mixes(x, m, w, &self.model.config);
            collapsed.extend(c);
            post.extend(mix.post);
            comb.extend(mix.comb);
        }
        Ok(Mixed {
            input: collapsed,
            post,
            comb,
        })
    }

    fn hyper_post(
        &self,
        x: &Vec<f32>,
        y: &Vec<f32>,
        post: &Vec<f32>,
        comb: &Vec<f32>,
        n: usize,
    ) -> Result<Vec<f32>, ShapeError> {
        let (hc, d) = self.hc_dim();
        let xs = rows_of(x, hc * d, n, "hyper_post streams")?;
        let ys = rows_of(y, d, n, "hyper_post output")?;
        let posts = rows_of(post, hc, n, "hyper_post post")?;
        let combs = rows_of(comb, hc * hc, n, "hyper_post comb")?;
        let mut out = Vec::with_capacity(n * hc * d);
        for t in 0..n {
            let mix = hyper::Mix {
                post: posts[t].clone(),
                comb: combs[t].clone(),
            };
            out.extend(hyper::post(&xs[t], &ys[t], &mix, hc));
        }
        Ok(out)
    }

    fn hyper_head(&self, x: &Vec<f32>, n: usize) -> Result<Vec<f32>, ShapeError> {
        let (hc, d) = self.hc_dim();
        let c = &self.model.config;
        Ok(rows_of(x, hc * d, n, "hyper_head")?
            .iter()
            .flat_map(|x| hyper::head(x, &self.model.weights.hc_head, c))
            .collect())
    }

    fn write_rows(
        &self,
        src: &Vec<f32>,
        width: usize,
        arena: &mut Vec<f32>,
        offsets: &[i64],
    ) -> Result<(), ShapeError> {
        for (i, &off) in offsets.iter().enumerate() {
            let Ok(at) = usize::try_from(off) else {
                continue;
            };
            let row = src
                .get(i * width..(i + 1) * width)
                .ok_or_else(|| short("write_rows source"))?;
            self.put_at(arena, at, row)?;
        }
        Ok(())
    }

    fn store_kv_rows(
        &self,
        rows: &Vec<f32>,
        arena: &mut Vec<f32>,
        offsets: &[i64],
    ) -> Result<(), ShapeError> {
        let (hd, kv) = (self.model.config.head_dim, self.model.kv_rows());
        for (i, &off) in offsets.iter().enumerate() {
            let Ok(at) = usize::try_from(off) else {
                continue;
            };
            let row = rows
                .get(i * hd..(i + 1) * hd)
                .ok_or_else(|| short("store_kv_rows source"))?;
            self.put_at(arena, at, &pack_kv_row(kv, row))?;
        }
        Ok(())
    }

    fn close_windows(
        &self,
        layer: usize,
        comp: Comp,
        arena: &mut Vec<f32>,
        closes: &[WindowClose],
    ) -> Result<Vec<f32>, ShapeError> {
        let w = self.compressor(layer, comp)?;
        let (ratio, d) = (w.ratio, w.head_dim);
        let width = w.wkv.rows;
        let mut out = Vec::with_capacity(closes.len() * d);
        for close in closes {
            let at = |off: i64, len: usize| -> Result<Vec<f32>, ShapeError> {
                let off = usize::try_from(off).map_err(|_| short("close_windows offset"))?;
                Ok(arena
                    .get(off..off + len)
                    .ok_or_else(|| short("close_windows"))?
                    .to_vec())
            };
            let kv = at(close.pending, ratio * width)?;
            let mut gate = at(close.pending + (ratio * width) as i64, ratio * width)?;
            for (slot, g) in gate.chunks_exact_mut(width).enumerate() {
                if self.planted(Plant::NoPositionBias) {
                    continue;
                }
                for (gi, bias) in g.iter_mut().zip(w.ape.row(slot)) {
                    *gi += bias;
                }
            }
            let prev = if close.has_prev {
                (
                    at(close.prev, ratio * d)?,
                    at(close.prev + (ratio * d) as i64, ratio * d)?,
                )
            } else {
                (Vec::new(), Vec::new())
            };
            out.extend(compressor::pool_window(w, &prev, &kv, &gate));
            if w.overlap && !self.planted(Plant::StaleOverlap) {
                let ca = |v: &[f32]| -> Vec<f32> {
                    v.chunks_exact(width)
                        .flat_map(|t| t[..d].iter().copied())
                        .collect()
                };
                let prev_at = usize::try_from(close.prev).map_err(|_| short("close_windows"))?;
                self.put_at(arena, prev_at, &ca(&kv))?;
                self.put_at(arena, prev_at + ratio * d, &ca(&gate))?;
            }
        }
        Ok(out)
    }

    fn index_select(
        &self,
        q: &Vec<f32>,
        weights: &Vec<f32>,
        arena: &Vec<f32>,
        at: &[IndexAt],
        k: usize,
    ) -> Result<Vec<i32>, ShapeError> {
        let c = &self.model.config;
        let (heads, di) = (c.index_n_heads, c.index_head_dim);
        let qs = rows_of(q, heads * di, at.len(), "index_select queries")?;
        let ws = rows_of(weights, heads, at.len(), "index_select weights")?;
        let mut out = Vec::with_capacity(at.len() * k);
        for ((a, q), w) in at.iter().zip(&qs).zip(&ws) {
            let base = usize::try_from(a.rows).map_err(|_| short("index_select rows"))?;
            if arena.len() < base + a.visible * di {
                return Err(short("index_select rows"));
            }
            let query = attention::IndexQuery {
                q,
                weights: w,
                visible: a.visible,
                pos: a.pos,
            };
            let row = |s: usize| &arena[base + s * di..base + (s + 1) * di];
            let choice = attention::index_choice(&query, row, c, &self.compress);
            let mut slots = vec![CHOSEN_EMPTY; k];
            match choice {
                Some(rows) => {
                    for (slot, r) in slots.iter_mut().zip(rows) {
                        *slot = r as i32;
                    }
                }
                None => slots.fill(CHOSEN_POISONED),
            }
            out.extend(slots);
        }
        Ok(out)
    }

    fn attend(
        &self,
        layer: usize,
        q: &Vec<f32>,
        arena: &Vec<f32>,
        keys: &[TokenKeys],
        chosen: Option<(&Vec<i32>, usize)>,
    ) -> Result<Vec<f32>, ShapeError> {
        let c = &self.model.config;
        let (heads, hd, kv) = (c.num_heads, c.head_dim, self.model.kv_rows());
        let stride = kv_stride(hd, kv)?;
        let sinks = &self.layer(layer)?.attn.sink;
        let scale = 1.0 / (hd as f32).sqrt();
        let qs = rows_of(q, heads * hd, keys.len(), "attend queries")?;
        let row = |off: i64| -> Result<Vec<f32>, ShapeError> {
            let off = usize::try_from(off).map_err(|_| short("attend offset"))?;
            let stored = arena
                .get(off..off + stride)
                .ok_or_else(|| short("attend rows"))?;
            Ok(unpack_kv_row(kv, stored, hd))
        };
        let mut out = Vec::with_capacity(keys.len() * heads * hd);
        for (t, (q, tk)) in qs.iter().zip(keys).enumerate() {
            let mut rows: Vec<Vec<f32>> = tk
                .window
                .iter()
                .map(|&o| row(o))
                .collect::<Result<_, _>>()?;
            if self.planted(Plant::WindowOrder) {
                rows.reverse();
            }
            let mut poisoned = false;
            match tk.compressed {
                Compressed::None => {}
                Compressed::All { rows: base, count } => {
                    for i in 0..count {
                        rows.push(row(base + (i * stride) as i64)?);
                    }
                }
                Compressed::Chosen { rows: base, count } => {
                    let (idx, k) = chosen.ok_or_else(|| short("attend without a choice"))?;
                    let mine = idx
                        .get(t * k..(t + 1) * k)
                        .ok_or_else(|| short("attend choice"))?;
                    poisoned = mine.contains(&CHOSEN_POISONED);
                    if !poisoned && mine.iter().filter(|&&i| i >= 0).count() != count {
                        return Err(ShapeError(format!(
                            "attend: token {t} has a choice of other than {count} rows"
                        )));
                    }
                    for &i in mine.iter().filter(|&&i| i >= 0) {
                        rows.push(row(base + i64::from(i) * stride as i64)?);
                    }
                }
            }
            let rows: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let mut o = attention::attend(q, &rows, &sinks[..heads], scale, hd);
            if poisoned {
                o.fill(f32::NAN);
            }
            out.extend(o);
        }
        Ok(out)
    }

    fn route(
        &self,
        layer: usize,
        logits: &Vec<f32>,
        tokens: &Vec<i32>,
        n: usize,
    ) -> Result<(Vec<i32>, Vec<f32>), ShapeError> {
        let c = &self.model.config;
        let w = &self.layer(layer)?.moe;
        let ls = rows_of(logits, c.n_routed_experts, n, "route")?;
        let (mut experts, mut weights) = (Vec::new(), Vec::new());
        for (l, &t) in ls.iter().zip(tokens) {
            let (chosen, ws) = moe::route_logits(w, l, t as u32, c);
            experts.extend(chosen.iter().map(|&e| e as i32));
            weights.extend(ws);
        }
        Ok((experts, weights))
    }

    fn expert_pairs(
        &self,
        layer: usize,
        proj: Proj,
        x: &Vec<f32>,
        experts: &Vec<i32>,
        per: usize,
        pairs: usize,
    ) -> Result<Vec<f32>, ShapeError> {
        let stack = &self.layer(layer)?.moe.experts;
        let mut out = Vec::new();
        for (p, &e) in experts
            .get(..pairs)
            .ok_or_else(|| short("pairs"))?
            .iter()
            .enumerate()
        {
            let expert = usize::try_from(e)
                .ok()
                .and_then(|e| stack.get(e))
                .ok_or_else(|| ShapeError(format!("pairs: expert {e} outside the layer")))?;
            let w = match proj {
                Proj::Gate => &expert.w1,
                Proj::Down => &expert.w2,
                Proj::Up => &expert.w3,
            };
            let t = p / per.max(1);
            let xt = x
                .get(t * w.cols..(t + 1) * w.cols)
                .ok_or_else(|| short("pairs input"))?;
            out.extend(w.apply(xt));
        }
        Ok(out)
    }

    fn swiglu(
        &self,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        rows: usize,
        width: usize,
    ) -> Result<Vec<f32>, ShapeError> {
        let limit = self.model.config.swiglu_limit;
        let gs = rows_of(gate, width, rows, "swiglu gate")?;
        let us = rows_of(up, width, rows, "swiglu up")?;
        let mut out = vec![0.0f32; rows * width];
        for ((o, g), u) in out.chunks_exact_mut(width.max(1)).zip(&gs).zip(&us) {
            moe::swiglu(g, u, limit, o);
        }
        Ok(out)
    }

    fn combine(
        &self,
        ys: &Vec<f32>,
        weights: &Vec<f32>,
        shared: &Vec<f32>,
        n: usize,
        k: usize,
    ) -> Result<Vec<f32>, ShapeError> {
        let d = self.model.config.hidden_size;
        let ys = rows_of(ys, d, n * k, "combine slots")?;
        let shared = rows_of(shared, d, n, "combine shared")?;
        let weights = weights
            .get(..n * k)
            .ok_or_else(|| short("combine weights"))?;
        let mut out = Vec::with_capacity(n * d);
        for t in 0..n {
            let mut o = vec![0.0f32; d];
            if self.planted(Plant::SharedFirst) {
                o.clone_from(&shared[t]);
            }
            for slot in 0..k {
                let weight = weights[t * k + slot];
                for (oi, v) in o.iter_mut().zip(&ys[t * k + slot]) {
                    *oi += v * weight;
                }
            }
            if !self.planted(Plant::SharedFirst) {
                for (oi, v) in o.iter_mut().zip(&shared[t]) {
                    *oi += v;
                }
            }
            out.extend(o);
        }
        Ok(out)
    }
}
