//! [`Kernels`] on the CPU: each kernel of the device decode step computed by its reference
//! (the engine's own functions, or the kernel's formula where it is only data movement), with
//! the kernel's conventions (NaN rows for ids outside a table, -1 / -2 in the indexer's slots,
//! a negative key offset making a token NaN). The device step over these runs in CI, so its
//! plans, offsets and launch order are checked without a GPU; the GPU tests check each kernel
//! against the same references.

use std::{cell::Cell, ops::Range};

use engine::{
    config::ModelConfig,
    model::{hyper, moe},
    paged::layout::RowFormat,
    parallel::collective::Collective,
    tensor::{Matrix, Weight, WeightForm, sigmoid},
    weights::{ExpertWeights, HyperWeights, MoeWeights},
};

mod attend;
mod counters;
mod dispatch;
mod experts;
mod linear;
mod rows;

use super::{
    Proj, ShapeError,
    kernels::{HyperSpec, Kernels, PoolSpec, RouteSpec, RowSpec, ScoreSpec, SlotSpec},
};

/// The decode step's kernels on host buffers.
#[derive(Debug)]
pub struct EmulatedKernels {
    config: ModelConfig,
    reads: Cell<(usize, usize)>,
    /// (f32 uploads, the longest of them, index values uploaded, index uploads).
    uploads: Cell<(usize, usize, usize, usize)>,
    /// Device buffers made (each `zeros`, `upload`), what a step in a graph may not do.
    allocations: Cell<usize>,
    plant: Option<KernelPlant>,
}

/// An error put into a kernel on purpose, to show the tests catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPlant {
    /// `chosen_offsets` points every chosen key one row further.
    ChosenRowShifted,
    /// `compress_pool` ignores the previous window's overlap slices.
    OverlapIgnored,
    /// `indexer_scores_mma` gives every score negated (the exact scores are untouched).
    TensorCoreScoresNegated,
}

/// A linear's weight: the engine's, or an f32 matrix.
#[derive(Debug, Clone)]
pub enum EmuRows {
    Weight(Weight),
    Matrix(Matrix),
}

fn err(what: &str) -> ShapeError {
    ShapeError(format!("{what}: a buffer is shorter than the kernel reads"))
}

fn part<T>(v: &[T], at: usize, len: usize, what: &str) -> Result<Vec<T>, ShapeError>
where
    T: Copy,
{
    v.get(at..at + len)
        .map(<[T]>::to_vec)
        .ok_or_else(|| err(what))
}

/// A kernel's output values into `dst` at `at` (device memory to device memory: not counted).
fn store(dst: &mut [f32], at: usize, v: &[f32]) -> Result<(), ShapeError> {
    dst.get_mut(at..at + v.len())
        .ok_or_else(|| err("store"))?
        .copy_from_slice(v);
    Ok(())
}

fn index(o: i64, what: &str) -> Result<usize, ShapeError> {
    usize::try_from(o).map_err(|_| err(what))
}

fn proj_of(e: &ExpertWeights, proj: Proj) -> &Weight {
    match proj {
        Proj::Gate => &e.w1,
        Proj::Down => &e.w2,
        Proj::Up => &e.w3,
    }
}

impl Kernels for EmulatedKernels {
    type Error = ShapeError;
    type F = Vec<f32>;
    type I = Vec<i32>;
    type L = Vec<i64>;
    type Rows = EmuRows;
    type Stack = Vec<Weight>;
    type Table = Weight;
    type Hash = Vec<u32>;
    /// The CPU references record nothing: a step's launch pass runs instead.
    type Graph = std::convert::Infallible;

    fn f_len(b: &Vec<f32>) -> usize {
        b.len()
    }

    fn i_len(b: &Vec<i32>) -> usize {
        b.len()
    }

    fn f_addr(b: &Vec<f32>) -> usize {
        b.as_ptr() as usize
    }

    fn i_addr(b: &Vec<i32>) -> usize {
        b.as_ptr() as usize
    }

    fn l_addr(b: &Vec<i64>) -> usize {
        b.as_ptr() as usize
    }

    fn launch_graph(&self, graph: &std::convert::Infallible) -> Result<(), ShapeError> {
        match *graph {}
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>, ShapeError> {
        self.allocated();
        Ok(vec![0.0; len])
    }

    fn zeros_i(&self, len: usize) -> Result<Vec<i32>, ShapeError> {
        self.allocated();
        Ok(vec![0; len])
    }

    fn zeros_l(&self, len: usize) -> Result<Vec<i64>, ShapeError> {
        self.allocated();
        Ok(vec![0; len])
    }

    fn upload(&self, v: &[f32]) -> Result<Vec<f32>, ShapeError> {
        self.allocated();
        self.uploaded(v.len(), 0);
        Ok(v.to_vec())
    }

    fn upload_i(&self, v: &[i32]) -> Result<Vec<i32>, ShapeError> {
        self.allocated();
        self.uploaded(0, v.len());
        Ok(v.to_vec())
    }

    fn upload_l(&self, v: &[i64]) -> Result<Vec<i64>, ShapeError> {
        self.allocated();
        self.uploaded(0, v.len());
        Ok(v.to_vec())
    }

    fn write(&self, dst: &mut Vec<f32>, at: usize, v: &[f32]) -> Result<(), ShapeError> {
        self.uploaded(v.len(), 0);
        dst.get_mut(at..at + v.len())
            .ok_or_else(|| err("write"))?
            .copy_from_slice(v);
        Ok(())
    }

    fn write_i(&self, dst: &mut Vec<i32>, v: &[i32]) -> Result<(), ShapeError> {
        self.uploaded(0, v.len());
        dst.get_mut(..v.len())
            .ok_or_else(|| err("write_i"))?
            .copy_from_slice(v);
        Ok(())
    }

    fn write_l(&self, dst: &mut Vec<i64>, v: &[i64]) -> Result<(), ShapeError> {
        self.uploaded(0, v.len());
        dst.get_mut(..v.len())
            .ok_or_else(|| err("write_l"))?
            .copy_from_slice(v);
        Ok(())
    }

    fn read(&self, b: &Vec<f32>, range: Range<usize>) -> Result<Vec<f32>, ShapeError> {
        let (calls, values) = self.reads.get();
        self.reads.set((calls + 1, values + range.len()));
        b.get(range).map(<[f32]>::to_vec).ok_or_else(|| err("read"))
    }

    /// One read, as a device's gathered read-back crosses once.
    fn read_many(&self, parts: &[(&Vec<f32>, Range<usize>)]) -> Result<Vec<Vec<f32>>, ShapeError> {
        let values: usize = parts.iter().map(|(_, r)| r.len()).sum();
        let (calls, total) = self.reads.get();
        self.reads.set((calls + 1, total + values));
        parts
            .iter()
            .map(|(b, r)| {
                b.get(r.clone())
                    .map(<[f32]>::to_vec)
                    .ok_or_else(|| err("read_many"))
            })
            .collect()
    }

    fn read_i(&self, b: &Vec<i32>, range: Range<usize>) -> Result<Vec<i32>, ShapeError> {
        let (calls, values) = self.reads.get();
        self.reads.set((calls + 1, values + range.len()));
        b.get(range)
            .map(<[i32]>::to_vec)
            .ok_or_else(|| err("read_i"))
    }

    fn read_l(&self, b: &Vec<i64>) -> Result<Vec<i64>, ShapeError> {
        Ok(b.clone())
    }

    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>, len: usize) -> Result<(), ShapeError> {
        let from = src.get(..len).ok_or_else(|| err("copy"))?;
        dst.get_mut(..len)
            .ok_or_else(|| err("copy"))?
            .copy_from_slice(from);
        Ok(())
    }

    fn upload_rows(&self, w: &Weight) -> Result<EmuRows, ShapeError> {
        Ok(EmuRows::Weight(w.clone()))
    }

    fn upload_matrix(&self, data: &[f32], rows: usize, cols: usize) -> Result<EmuRows, ShapeError> {
        if data.len() != rows * cols {
            return Err(err("matrix"));
        }
        Ok(EmuRows::Matrix(Matrix::new(rows, cols, data.to_vec())))
    }

    fn rows_shape(w: &EmuRows) -> (usize, usize) {
        match w {
            EmuRows::Weight(w) => (w.rows, w.cols),
            EmuRows::Matrix(m) => (m.rows, m.cols),
        }
    }

    fn upload_stack(
        &self,
        experts: &[ExpertWeights],
        proj: Proj,
    ) -> Result<Vec<Weight>, ShapeError> {
        let stack: Vec<Weight> = experts.iter().map(|e| proj_of(e, proj).clone()).collect();
        // As on the device: `exact_pairs` reads the FP4 forms, one shape for every expert.
        let fp4 = stack.iter().all(|w| {
            matches!(
                w.form(),
                WeightForm::Nvfp4 { .. } | WeightForm::Mxfp4 { .. }
            )
        });
        let same = stack
            .windows(2)
            .all(|p| (p[0].rows, p[0].cols) == (p[1].rows, p[1].cols));
        if stack.is_empty() || !fp4 || !same {
            return Err(ShapeError(
                "the device decode step runs routed experts stored as NVFP4 or MXFP4 only".into(),
            ));
        }
        Ok(stack)
    }

    fn stack_shape(s: &Vec<Weight>) -> (usize, usize, usize) {
        s.first().map_or((0, 0, 0), |w| (s.len(), w.rows, w.cols))
    }

    fn upload_table(&self, embed: &Weight) -> Result<Weight, ShapeError> {
        match embed.form() {
            WeightForm::F32(_) | WeightForm::Bf16(_) => Ok(embed.clone()),
            _ => Err(ShapeError(
                "the device decode step reads an f32 or bf16 embedding table".into(),
            )),
        }
    }

    fn upload_hash(&self, moe: &MoeWeights) -> Result<Option<Vec<u32>>, ShapeError> {
        Ok(moe.tid2eid.clone())
    }

    fn fill_nan(&self, x: &mut Vec<f32>) -> Result<(), ShapeError> {
        x.fill(f32::NAN);
        Ok(())
    }

    fn embed_rows(
        &self,
        table: &Weight,
        tokens: &Vec<i32>,
        (n, hc): (usize, usize),
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        let dim = table.cols;
        for (t, &token) in tokens
            .get(..n)
            .ok_or_else(|| err("embed_rows"))?
            .iter()
            .enumerate()
        {
            let row = match usize::try_from(token) {
                Ok(r) if r < table.rows => table.row_f32(r),
                _ => vec![f32::NAN; dim],
            };
            for s in 0..hc {
                store(out, (t * hc + s) * dim, &row)?;
            }
        }
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &Vec<f32>,
        from: &Vec<i64>,
        dst: &mut Vec<f32>,
        to: &Vec<i64>,
        width: usize,
        n: usize,
    ) -> Result<(), ShapeError> {
        for i in 0..n {
            let (f, t) = (from[i], to[i]);
            if t < 0 {
                continue;
            }
            let row = part(src, index(f, "copy_rows")?, width, "copy_rows")?;
            store(dst, index(t, "copy_rows")?, &row)?;
        }
        Ok(())
    }

    fn exact_gemv(
        &self,
        w: &EmuRows,
        rows: (usize, usize),
        x: &Vec<f32>,
        n: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        linear::exact_gemv(w, rows, x, n, y)
    }

    fn norm_rope_rows(
        &self,
        x: &mut Vec<f32>,
        spec: RowSpec,
        w: &Vec<f32>,
        sin_cos: &Vec<f32>,
        rows: usize,
    ) -> Result<(), ShapeError> {
        rows::norm_rope_rows(x, spec, w, sin_cos, rows)
    }

    fn hyper_pre(
        &self,
        x: &Vec<f32>,
        mixes: &Vec<f32>,
        (scale, base): (&Vec<f32>, &Vec<f32>),
        spec: HyperSpec,
        n: usize,
        (collapsed, post, comb): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<(), ShapeError> {
        let (hc, d) = (spec.hc, spec.dim);
        let width = (2 + hc) * hc;
        let mut c = self.config.clone();
        (c.hc_mult, c.hc_eps, c.hc_sinkhorn_iters) = (hc, spec.eps, spec.iters);
        let w = HyperWeights {
            mix: Matrix::zeros(0, 0),
            base: base.clone(),
            scale: [scale[0], scale[1], scale[2]],
        };
        for t in 0..n {
            let xt = part(x, t * hc * d, hc * d, "hyper_pre streams")?;
            let mt = part(mixes, t * width, width, "hyper_pre mixes")?;
            let (mix, input) = hyper::pre_from_mixes(&xt, &mt, &w, &c);
            store(collapsed, t * d, &input)?;
            store(post, t * hc, &mix.post)?;
            store(comb, t * hc * hc, &mix.comb)?;
        }
        Ok(())
    }

    fn hyper_post(
        &self,
        x: &Vec<f32>,
        y: &Vec<f32>,
        post: &Vec<f32>,
        comb: &Vec<f32>,
        spec: HyperSpec,
        n: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        let (hc, d) = (spec.hc, spec.dim);
        for t in 0..n {
            let mix = hyper::Mix {
                post: part(post, t * hc, hc, "hyper_post post")?,
                comb: part(comb, t * hc * hc, hc * hc, "hyper_post comb")?,
            };
            let xt = part(x, t * hc * d, hc * d, "hyper_post streams")?;
            let yt = part(y, t * d, d, "hyper_post output")?;
            store(out, t * hc * d, &hyper::post(&xt, &yt, &mix, hc))?;
        }
        Ok(())
    }

    fn hyper_head(
        &self,
        x: &Vec<f32>,
        mix: &Vec<f32>,
        (scale, base): (f32, &Vec<f32>),
        spec: HyperSpec,
        n: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        let (hc, d) = (spec.hc, spec.dim);
        for t in 0..n {
            let xt = part(x, t * hc * d, hc * d, "hyper_head streams")?;
            let mut o = vec![0.0f32; d];
            // `hyper::head` after its mixing projection.
            for (i, stream) in xt.chunks_exact(d).enumerate() {
                let p = sigmoid(mix[t * hc + i] * scale + base[i]) + spec.eps;
                for (oi, v) in o.iter_mut().zip(stream) {
                    *oi += p * v;
                }
            }
            store(out, t * d, &o)?;
        }
        Ok(())
    }

    fn add_periodic(
        &self,
        x: &mut Vec<f32>,
        bias: &Vec<f32>,
        period: usize,
        n: usize,
    ) -> Result<(), ShapeError> {
        for (i, v) in x
            .get_mut(..n)
            .ok_or_else(|| err("add_periodic"))?
            .iter_mut()
            .enumerate()
        {
            *v += bias[i % period];
        }
        Ok(())
    }

    fn sum_blocks(
        &self,
        x: &Vec<f32>,
        shape: (usize, usize),
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        dispatch::sum_blocks(x, shape, out)
    }

    fn scale_values(&self, x: &mut Vec<f32>, by: f32, n: usize) -> Result<(), ShapeError> {
        for v in x.get_mut(..n).ok_or_else(|| err("scale_values"))? {
            *v *= by;
        }
        Ok(())
    }

    fn fp8_kv_store(
        &self,
        rows: &Vec<f32>,
        shape: (usize, usize),
        arena: &mut Vec<f32>,
        offsets: &Vec<i64>,
        n: usize,
    ) -> Result<(), ShapeError> {
        let offsets = offsets.get(..n).ok_or_else(|| err("fp8_kv_store"))?;
        rows::fp8_kv_store(rows, shape, arena, offsets)
    }

    fn fp8_kv_round(
        &self,
        rows: &mut Vec<f32>,
        (nope, rope): (usize, usize),
        n: usize,
    ) -> Result<(), ShapeError> {
        let rows = rows
            .get_mut(..n * (nope + rope))
            .ok_or_else(|| err("fp8_kv_round"))?;
        crate::rows::fp8_kv_round(rows, (nope, rope));
        Ok(())
    }

    fn compress_pool(
        &self,
        kv: &Vec<f32>,
        gate: &Vec<f32>,
        (prev_kv, prev_gate): (&Vec<f32>, &Vec<f32>),
        has_prev: &Vec<i32>,
        p: PoolSpec,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        attend::compress_pool(kv, gate, (prev_kv, prev_gate), has_prev, p, out, self.plant)
    }

    fn indexer_scores(
        &self,
        q: &Vec<f32>,
        w: &Vec<f32>,
        keys: &Vec<f32>,
        starts: &Vec<i64>,
        visible: &Vec<i32>,
        sp: ScoreSpec,
        scores: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        attend::indexer_scores((q, w, keys), (starts, visible), sp, scores, self.plant)
    }

    fn indexer_topk(
        &self,
        scores: &Vec<f32>,
        visible: &Vec<i32>,
        shape: (usize, usize, usize),
        out: &mut Vec<i32>,
    ) -> Result<(), ShapeError> {
        attend::indexer_topk(scores, visible, shape, out)
    }

    fn chosen_offsets(
        &self,
        chosen: &Vec<i32>,
        k: usize,
        (tokens, starts, counts, bases): (&Vec<i32>, &Vec<i64>, &Vec<i32>, &Vec<i64>),
        row_bytes: usize,
        entries: usize,
        offsets: &mut Vec<i64>,
    ) -> Result<(), ShapeError> {
        let plans = (&tokens[..], &starts[..], &counts[..], &bases[..]);
        let shifted = self.plant == Some(KernelPlant::ChosenRowShifted);
        attend::chosen_offsets((chosen, k), plans, (row_bytes, entries), offsets, shifted)
    }

    fn attn_exact(
        &self,
        q: &Vec<f32>,
        (pool, kv): (&Vec<f32>, RowFormat),
        (offsets, starts): (&Vec<i64>, &Vec<i64>),
        sinks: &Vec<f32>,
        shape: (usize, usize, usize, usize),
        scale: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        attend::attn_exact(q, (pool, kv), (offsets, starts), sinks, shape, scale, out)
    }

    fn attn_fast(
        &self,
        q: &Vec<f32>,
        (pool, (nope, rope)): (&Vec<f32>, (usize, usize)),
        (offsets, starts): (&Vec<i64>, &Vec<i64>),
        sinks: &Vec<f32>,
        (tokens, heads): (usize, usize),
        scale: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        attend::attn_fast(
            q,
            (pool, (nope, rope)),
            (offsets, starts),
            sinks,
            (tokens, heads),
            scale,
            out,
        )
    }

    fn moe_route(
        &self,
        logits: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        hash: Option<&Vec<u32>>,
        tokens: &Vec<i32>,
        sp: RouteSpec,
        _: &mut Vec<f32>,
        (chosen, weights): (&mut Vec<i32>, &mut Vec<f32>),
    ) -> Result<(), ShapeError> {
        // The reference needs no scores buffer.
        experts::moe_route(logits, bias, hash, tokens, sp, (chosen, weights))
    }

    fn exact_pairs(
        &self,
        stack: &Vec<Weight>,
        (tokens, experts): (&Vec<i32>, &Vec<i32>),
        x: &Vec<f32>,
        pairs: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        experts::exact_pairs(stack, (tokens, experts), x, pairs, y)
    }

    fn fast_pairs(
        &self,
        stack: &Vec<Weight>,
        (tokens, experts): (&Vec<i32>, &Vec<i32>),
        x: &Vec<f32>,
        pairs: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        experts::fast_pairs(stack, (tokens, experts), x, pairs, y)
    }

    fn gemm_pairs(
        &self,
        stack: &Vec<Weight>,
        (tokens, experts): (&Vec<i32>, &Vec<i32>),
        x: &Vec<f32>,
        pairs: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        experts::gemm_pairs(stack, (tokens, experts), x, pairs, y)
    }

    fn fast_linear_takes(w: &EmuRows) -> bool {
        linear::dense_rows(w).is_some()
    }

    fn fast_linear_scratch(&self, n: usize, rows: usize, cols: usize) -> usize {
        linear::scratch(n, rows, cols)
    }

    fn fast_linear(
        &self,
        w: &EmuRows,
        rows: (usize, usize),
        x: &Vec<f32>,
        n: usize,
        scratch: &mut Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        linear::fast_linear(w, rows, x, n, scratch, y)
    }

    fn swiglu(
        &self,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        n: usize,
        limit: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        let (g, u) = (part(gate, 0, n, "swiglu")?, part(up, 0, n, "swiglu")?);
        moe::swiglu(
            &g,
            &u,
            limit,
            out.get_mut(..n).ok_or_else(|| err("swiglu"))?,
        );
        Ok(())
    }

    fn argmax_rows(
        &self,
        x: &Vec<f32>,
        (rows, width): (usize, usize),
        out: &mut Vec<i32>,
    ) -> Result<(), ShapeError> {
        attend::argmax_rows(x, (rows, width), out)
    }

    fn ep_slots(
        &self,
        experts: &Vec<i32>,
        spec: SlotSpec,
        send: &mut Vec<f32>,
        (pack_to, back_from): (&mut Vec<i64>, &mut Vec<i64>),
        counts: &mut Vec<i32>,
    ) -> Result<(), ShapeError> {
        dispatch::ep_slots(experts, spec, send, (pack_to, back_from), counts)
    }

    fn ep_take_ids(
        &self,
        recv: &Vec<f32>,
        at: &Vec<i64>,
        held: (usize, usize),
        m: usize,
        ids: &mut Vec<i32>,
    ) -> Result<(), ShapeError> {
        let at = at.get(..m).ok_or_else(|| err("ep_take_ids"))?;
        dispatch::ep_take_ids(recv, at, held, ids)
    }

    fn held_ids(
        &self,
        experts: &Vec<i32>,
        held: (usize, usize),
        total: usize,
        pairs: usize,
        ids: &mut Vec<i32>,
    ) -> Result<(), ShapeError> {
        let experts = experts.get(..pairs).ok_or_else(|| err("held_ids"))?;
        dispatch::held_ids(experts, held, total, ids)
    }

    fn clear_unheld_rows(
        &self,
        ys: &mut Vec<f32>,
        ids: &Vec<i32>,
        width: usize,
        pairs: usize,
    ) -> Result<(), ShapeError> {
        dispatch::clear_unheld_rows(ys, ids, width, pairs)
    }

    /// As a GPU's NCCL exchange: device to device, so neither a read nor an upload.
    fn exchange_known(
        &self,
        coll: &mut dyn Collective,
        send: &Vec<f32>,
        sizes: (&[usize], &[usize]),
    ) -> Result<Vec<f32>, ShapeError> {
        dispatch::exchange_known(coll, send, sizes)
    }

    /// As a GPU's NCCL all-gather: device to device, so neither a read nor an upload.
    fn all_gather(
        &self,
        coll: &mut dyn Collective,
        send: &Vec<f32>,
        part: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        dispatch::all_gather(coll, send, part, out)
    }

    /// As a GPU's NCCL all-reduce: device to device, so neither a read nor an upload.
    fn all_owned(
        &self,
        coll: &mut dyn Collective,
        send: &Vec<f32>,
        len: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        dispatch::all_owned(coll, send, len, out)
    }

    fn moe_combine(
        &self,
        (ys, weights, shared): (&Vec<f32>, &Vec<f32>, &Vec<f32>),
        (n, k, hidden): (usize, usize, usize),
        out: &mut Vec<f32>,
    ) -> Result<(), ShapeError> {
        for t in 0..n {
            let mut o = vec![0.0f32; hidden];
            for j in 0..k {
                let y = part(ys, (t * k + j) * hidden, hidden, "moe_combine")?;
                let w = weights[t * k + j];
                for (oi, v) in o.iter_mut().zip(&y) {
                    *oi += v * w;
                }
            }
            for (oi, v) in o.iter_mut().zip(&shared[t * hidden..(t + 1) * hidden]) {
                *oi += v;
            }
            store(out, t * hidden, &o)?;
        }
        Ok(())
    }
}
