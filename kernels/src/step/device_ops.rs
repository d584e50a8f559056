//! [`DeviceStepOps`]: the decode step's ops ([`StepOps`]) as launches of the device's kernels
//! ([`Kernels`]: `exact_gemv`, `norm_rope_rows`, `hyper_*`, `compress_pool`,
//! `indexer_scores` + `indexer_topk`, `attn_exact`, `moe_route`, `exact_pairs`,
//! `swiglu_clamp`, `moe_combine` and `step.cu`'s data movement). Activations and state stay in
//! device buffers; what an op takes from the host is the step's plan (row offsets, each row's
//! rotation from its position). The same code runs on the GPU (`cuda::CudaKernels`) and on the
//! kernels' CPU references ([`super::emulated::EmulatedKernels`], in CI), so the plans and
//! launches are tested here and each kernel against its reference on a GPU.

use std::{cell::RefCell, ops::Range, sync::Arc};

use engine::{config::ModelConfig, paged::layout::RowFormat, rope::Rope};

use super::{
    Comp, IndexAt, Lin, Mixed, Norm, Proj, RopeKind, RowOp, StepOps, Sub, TokenKeys, View,
    WindowClose,
    device_model::{DeviceModel, at_layer},
    kernels::{Kernels, RowSpec},
    key_plan::{Fill, KeyPlan},
    pool::{self, BufPool, PlanStore, StepBuf},
};
mod setup;

/// The decode step's ops over `K`'s kernels, for a model whose weights were uploaded once.
pub struct DeviceStepOps<K: Kernels> {
    pub(super) k: K,
    pub(super) config: ModelConfig,
    main: Rope,
    compress: Rope,
    pub(super) model: DeviceModel<K>,
    /// The step's rotation tables, by table and rows' positions: a step rotates the same
    /// positions in every layer (queries, K=V rows, outputs), so each is written once.
    rotations: RefCell<Vec<Rotation<K>>>,
    /// The step's f32 and i32 buffers, taken by its ops and back when dropped.
    f_pool: Arc<BufPool<K::F>>,
    i_pool: Arc<BufPool<K::I>>,
    /// One value, for the table and weight a launch without rotation or weight does not read.
    unused: K::F,
    /// The read-only plans (row offsets, counts) written this step, by content: every layer
    /// of a kind has the same arena layout, so its plans are the same and go up once a step.
    plans: RefCell<Plans<K>>,
    /// How the model stores K=V rows (each rounded to it as it is computed), in the arenas too.
    kv_rows: RowFormat,
    /// f32s a stored K=V row takes in an arena.
    kv_stride: usize,
    /// Attention by `attn_decode_fp8` (all heads of a token on tensor cores, within its bound)
    /// instead of `attn_exact` (the engine's bits), and the indexer's scores by
    /// `indexer_scores_mma` instead of `indexer_scores`.
    pub(super) fast_attention: bool,
    /// Which kernel runs the routed experts' pairs.
    pub(super) experts: ExpertKernel,
    /// The bf16 and FP8 attention, shared-expert and head linears by the dense GEMM (within
    /// its bound) instead of `exact_gemv`.
    fast_linears: bool,
    /// The expert-parallel group of the model's rank, whose routed experts' pairs every step
    /// exchanges (`device_group`); the device holds this rank's experts only.
    pub(super) expert_parallel: Option<Arc<engine::parallel::expert::ExpertParallel>>,
    /// The tensor-parallel group of the model's rank: the step computes its share of the
    /// heads and output groups and gathers the groups' outputs over it (`device_group`).
    pub(super) tensor_parallel: Option<Arc<engine::parallel::tensor::TensorParallel>>,
    /// The expert-slice group of the model's rank: the device holds this rank's slice of every
    /// routed expert and the step sums every rank's partial outputs (`device_group`).
    pub(super) sliced: Option<Arc<engine::parallel::sliced::SlicedExperts>>,
}

/// The kernel that runs the routed experts' (token, expert) pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertKernel {
    /// `exact_pairs`: the engine's bits.
    Exact,
    /// The grouped FP4 GEMV (`Kernels::fast_pairs`), within its bound.
    GroupedGemv,
    /// The grouped GEMM (`Kernels::gemm_pairs`), within its bound.
    GroupedGemm,
}

/// The step's plans, in buffers kept from step to step.
struct Plans<K: Kernels> {
    l: PlanStore<K::L, i64>,
    i: PlanStore<K::I, i32>,
    /// Rotation tables (their own buffers: written by the host, never by a kernel).
    f: PlanStore<K::F, f32>,
}

impl<K: Kernels> Default for Plans<K> {
    fn default() -> Self {
        Self {
            l: PlanStore::default(),
            i: PlanStore::default(),
            f: PlanStore::default(),
        }
    }
}

/// An f32 buffer of the step (back to the ops' pool when dropped).
pub type DBuf<K> = StepBuf<<K as Kernels>::F>;
/// An i32 buffer of the step (back to the ops' pool when dropped).
pub type DIdx<K> = StepBuf<<K as Kernels>::I>;

/// A rotation table on the device: its table and rows' positions, its (sin, cos) values.
type Rotation<K> = ((RopeKind, Vec<usize>), Arc<<K as Kernels>::F>);

/// Rotation tables a step keeps: it has at most two tables of token positions and a few of
/// closed windows' positions.
const ROTATIONS_KEPT: usize = 6;

impl<K: Kernels> std::fmt::Debug for DeviceStepOps<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStepOps")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

pub(super) fn offsets(n: usize, stride: usize, start: usize) -> Vec<i64> {
    (0..n).map(|i| (i * stride + start) as i64).collect()
}

impl<K: Kernels> StepOps for DeviceStepOps<K> {
    type Error = K::Error;
    type Buf = DBuf<K>;
    type Idx = DIdx<K>;

    fn begin_step(&self) {
        // The tables first: they hold their buffers.
        self.rotations.borrow_mut().clear();
        let mut plans = self.plans.borrow_mut();
        plans.l.begin_step();
        plans.i.begin_step();
        plans.f.begin_step();
    }

    fn alloc(&self, len: usize) -> Result<DBuf<K>, K::Error> {
        let mut buf = pool::take(&self.f_pool, len, |class| self.k.zeros(class))?;
        self.k.fill_nan(&mut buf)?;
        Ok(buf)
    }

    fn alloc_state(&self, len: usize) -> Result<DBuf<K>, K::Error> {
        let mut buf = self.k.zeros(len.max(1))?;
        self.k.fill_nan(&mut buf)?;
        Ok(StepBuf::kept(buf))
    }

    fn put_at(&self, buf: &mut DBuf<K>, offset: usize, values: &[f32]) -> Result<(), K::Error> {
        if offset + values.len() > K::f_len(buf) {
            return Err("put_at: past the buffer".to_owned().into());
        }
        if values.is_empty() {
            return Ok(());
        }
        self.k.write(buf, offset, values)
    }

    fn get_many(&self, parts: &[(&DBuf<K>, Range<usize>)]) -> Result<Vec<Vec<f32>>, K::Error> {
        if parts
            .iter()
            .any(|(b, r)| r.end > K::f_len(b) || r.start > r.end)
        {
            return Err("get_many: past a buffer".to_owned().into());
        }
        let parts: Vec<(&K::F, Range<usize>)> =
            parts.iter().map(|(b, r)| (&***b, r.clone())).collect();
        self.k.read_many(&parts)
    }

    fn put_idx(&self, values: &[i32]) -> Result<DIdx<K>, K::Error> {
        let mut buf = self.alloc_i(values.len())?;
        if !values.is_empty() {
            self.k.write_i(&mut buf, values)?;
        }
        Ok(buf)
    }

    fn get(&self, buf: &DBuf<K>, range: Range<usize>) -> Result<Vec<f32>, K::Error> {
        if range.end > K::f_len(buf) || range.start > range.end {
            return Err("get: past the buffer".to_owned().into());
        }
        if range.is_empty() {
            return Ok(Vec::new());
        }
        self.k.read(buf, range)
    }

    fn argmax_rows(&self, x: &DBuf<K>, rows: usize, width: usize) -> Result<DIdx<K>, K::Error> {
        if K::f_len(x) < rows * width {
            return Err("argmax_rows: fewer values than rows".to_owned().into());
        }
        let mut out = self.alloc_i(2 * rows)?;
        if rows > 0 {
            self.k.argmax_rows(x, (rows, width), &mut out)?;
        }
        Ok(out)
    }

    fn get_idx(&self, b: &DIdx<K>, range: Range<usize>) -> Result<Vec<i32>, K::Error> {
        if range.end > K::i_len(b) || range.start > range.end {
            return Err("get_idx: past the buffer".to_owned().into());
        }
        if range.is_empty() {
            return Ok(Vec::new());
        }
        self.k.read_i(b, range)
    }

    fn copy(&self, buf: &DBuf<K>, len: usize) -> Result<DBuf<K>, K::Error> {
        if len > K::f_len(buf) {
            return Err("copy: past the buffer".to_owned().into());
        }
        let mut out = self.alloc(len)?;
        if len > 0 {
            self.k.copy(buf, &mut out, len)?;
        }
        Ok(out)
    }

    fn embed(&self, tokens: &DIdx<K>, n: usize) -> Result<DBuf<K>, K::Error> {
        let (hc, d) = self.hc_dim();
        let mut out = self.alloc(n * hc * d)?;
        if n == 0 {
            return Ok(out);
        }
        if K::i_len(tokens) < n {
            return Err("embed: fewer token ids than tokens".to_owned().into());
        }
        self.k
            .embed_rows(&self.model.embed, tokens, (n, hc), &mut out)?;
        Ok(out)
    }

    fn linear(
        &self,
        w: Lin,
        rows: Range<usize>,
        x: &DBuf<K>,
        x_view: View,
        y: &mut DBuf<K>,
        y_view: View,
        n: usize,
    ) -> Result<(), K::Error> {
        let dev = self.model.linear(w)?;
        let (total, cols) = K::rows_shape(dev);
        // Rows of the whole weight, of which the device may hold a block.
        let offset = self.model.row_offset(w);
        if rows.start < offset && !rows.is_empty() {
            return Err(format!("{w:?}: rows {rows:?}, and the device holds from {offset}").into());
        }
        let rows = rows.start.saturating_sub(offset)..rows.end.saturating_sub(offset);
        let out = rows.len();
        if rows.end > total {
            return Err(format!("{w:?}: rows {rows:?} of {total}").into());
        }
        if n == 0 || out == 0 {
            return Ok(());
        }
        let gathered;
        let input = if x_view == View::rows(cols) {
            x
        } else {
            let mut g = self.alloc(n * cols)?;
            let from = offsets(n, x_view.stride, x_view.start);
            self.copy_rows(x, &from, &mut g, &offsets(n, cols, 0), cols)?;
            gathered = g;
            &gathered
        };
        if K::f_len(input) < n * cols {
            return Err(format!("{w:?}: fewer inputs than {n} vectors of {cols}").into());
        }
        // The dense GEMM where asked, for the large bf16 and FP8 linears it takes; the
        // hyper-connections' mixing and the MoE gate (which choose experts) stay exact.
        let fast = self.fast_linears
            && matches!(w, Lin::Attn(..) | Lin::Shared(..) | Lin::Head)
            && K::fast_linear_takes(dev);
        let mut scratch = if fast {
            let len = self.k.fast_linear_scratch(n, out, cols);
            Some(pool::take(&self.f_pool, len, |class| self.k.zeros(class))?)
        } else {
            None
        };
        let mut run = |y: &mut K::F| match scratch.as_mut() {
            Some(part) => self
                .k
                .fast_linear(dev, (rows.start, out), input, n, part, y),
            None => self.k.exact_gemv(dev, (rows.start, out), input, n, y),
        };
        if y_view == View::rows(out) {
            if K::f_len(y) < n * out {
                return Err(format!("{w:?}: output shorter than {n} x {out}").into());
            }
            return run(y);
        }
        let mut tmp = self.alloc(n * out)?;
        run(&mut tmp)?;
        let to = offsets(n, y_view.stride, y_view.start);
        self.copy_rows(&tmp, &offsets(n, out, 0), y, &to, out)
    }

    fn round_kv_rows(&self, rows: &mut DBuf<K>, n: usize) -> Result<(), K::Error> {
        // FP8 and bf16 rows round through one kernel (a bf16 row is an FP8 row without e4m3
        // values).
        let Some((nope, rope)) = self.kv_rows.e4m3_bf16_split(self.config.head_dim) else {
            return Ok(());
        };
        if nope + rope != self.config.head_dim || K::f_len(rows) < n * (nope + rope) {
            return Err("round_kv_rows: rows that are not K=V rows"
                .to_owned()
                .into());
        }
        self.k.fp8_kv_round(rows, (nope, rope), n)
    }

    fn norm_rope(&self, x: &mut DBuf<K>, op: &RowOp<'_>, n: usize) -> Result<(), K::Error> {
        let (table, rope) = match op.rope {
            Some((kind, positions)) => {
                let positions = positions
                    .get(..n)
                    .ok_or_else(|| "norm_rope: fewer positions than rows".to_owned())?;
                let dims = match kind {
                    RopeKind::Main => self.main.rope_dim(),
                    RopeKind::Compress => self.compress.rope_dim(),
                };
                (Some((kind, positions)), dims)
            }
            None => (None, 0),
        };
        if K::f_len(x) < n * op.heads * op.head_dim || rope > op.head_dim {
            return Err("norm_rope: fewer values than rows".to_owned().into());
        }
        if n == 0 {
            return Ok(());
        }
        let (norm, weight) = match op.norm {
            Norm::None => (0, &self.unused),
            Norm::Unweighted => (1, &self.unused),
            Norm::Weighted(v) => {
                let w = self.model.vector(v)?;
                if K::f_len(w) < op.head_dim {
                    return Err(format!("{v:?}: shorter than a head").into());
                }
                (2, w)
            }
        };
        let spec = RowSpec {
            heads: op.heads,
            head_dim: op.head_dim,
            rope,
            norm,
            eps: self.config.rms_norm_eps,
            inverse: op.inverse,
        };
        match table {
            Some((kind, positions)) => {
                let i = self.rotation(kind, positions)?;
                let kept = self.rotations.borrow();
                self.k.norm_rope_rows(x, spec, weight, &kept[i].1, n)
            }
            None => self.k.norm_rope_rows(x, spec, weight, &self.unused, n),
        }
    }

    fn hyper_pre(
        &self,
        layer: usize,
        sub: Sub,
        x: &DBuf<K>,
        mixes: &DBuf<K>,
        n: usize,
    ) -> Result<Mixed<DBuf<K>>, K::Error> {
        let (hc, d) = self.hc_dim();
        let (mut input, mut post, mut comb) = (
            self.alloc(n * d)?,
            self.alloc(n * hc)?,
            self.alloc(n * hc * hc)?,
        );
        let h = self.model.hyper(layer, sub)?;
        if K::f_len(x) < n * hc * d || K::f_len(mixes) < n * (2 + hc) * hc {
            return Err("hyper_pre buffers".to_owned().into());
        }
        if n > 0 {
            self.k.hyper_pre(
                x,
                mixes,
                (&h.scale, &h.base),
                self.hyper_spec(),
                n,
                (&mut input, &mut post, &mut comb),
            )?;
        }
        Ok(Mixed { input, post, comb })
    }

    fn hyper_post(
        &self,
        x: &DBuf<K>,
        y: &DBuf<K>,
        post: &DBuf<K>,
        comb: &DBuf<K>,
        n: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let (hc, d) = self.hc_dim();
        let mut out = self.alloc(n * hc * d)?;
        if K::f_len(x) < n * hc * d
            || K::f_len(y) < n * d
            || K::f_len(post) < n * hc
            || K::f_len(comb) < n * hc * hc
        {
            return Err("hyper_post buffers".to_owned().into());
        }
        if n > 0 {
            self.k
                .hyper_post(x, y, post, comb, self.hyper_spec(), n, &mut out)?;
        }
        Ok(out)
    }

    fn hyper_head(&self, x: &DBuf<K>, n: usize) -> Result<DBuf<K>, K::Error> {
        let (hc, d) = self.hc_dim();
        let mut out = self.alloc(n * d)?;
        if n == 0 {
            return Ok(out);
        }
        let mut flat = self.copy(x, n * hc * d)?;
        let unit = RowOp {
            heads: 1,
            head_dim: hc * d,
            norm: Norm::Unweighted,
            rope: None,
            inverse: false,
        };
        self.norm_rope(&mut flat, &unit, n)?;
        let mut mix = self.alloc(n * hc)?;
        self.k
            .exact_gemv(&self.model.head_mix, (0, hc), &flat, n, &mut mix)?;
        let head = (self.model.head_scale, &self.model.head_base);
        self.k
            .hyper_head(x, &mix, head, self.hyper_spec(), n, &mut out)?;
        Ok(out)
    }

    fn write_rows(
        &self,
        src: &DBuf<K>,
        width: usize,
        arena: &mut DBuf<K>,
        to: &[i64],
    ) -> Result<(), K::Error> {
        self.copy_rows(src, &offsets(to.len(), width, 0), arena, to, width)
    }

    fn store_kv_rows(
        &self,
        rows: &DBuf<K>,
        arena: &mut DBuf<K>,
        to: &[i64],
    ) -> Result<(), K::Error> {
        let (hd, stride) = (self.config.head_dim, self.kv_stride);
        let Some((nope, rope)) = self.kv_rows.e4m3_bf16_split(hd) else {
            return self.write_rows(rows, hd, arena, to);
        };
        let fits = |o: i64| o + stride as i64 <= K::f_len(arena) as i64;
        if K::f_len(rows) < to.len() * hd || to.iter().any(|&o| o >= 0 && !fits(o)) {
            return Err(format!("store_kv_rows: {} rows outside their buffers", to.len()).into());
        }
        if to.is_empty() {
            return Ok(());
        }
        // The encoder addresses the arena's bytes.
        let bytes: Vec<i64> = to.iter().map(|&o| if o < 0 { -1 } else { 4 * o }).collect();
        let d_bytes = self.plan_l(&bytes)?;
        self.k
            .fp8_kv_store(rows, (nope, rope), arena, &d_bytes, to.len())
    }

    fn close_windows(
        &self,
        layer: usize,
        comp: Comp,
        arena: &mut DBuf<K>,
        closes: &[WindowClose],
    ) -> Result<DBuf<K>, K::Error> {
        self.closed_windows(self.model.compressor(layer, comp)?, arena, closes)
    }

    fn index_select(
        &self,
        q: &DBuf<K>,
        weights: &DBuf<K>,
        arena: &DBuf<K>,
        at: &[IndexAt],
        k: usize,
    ) -> Result<DIdx<K>, K::Error> {
        self.indexer_choice((q, weights), arena, at, k)
    }

    fn attend(
        &self,
        layer: usize,
        q: &DBuf<K>,
        arena: &DBuf<K>,
        keys: &[TokenKeys],
        chosen: Option<(&DIdx<K>, usize)>,
    ) -> Result<DBuf<K>, K::Error> {
        let c = &self.config;
        let (heads, hd, n) = (self.head_share(c).0.len(), c.head_dim, keys.len());
        let mut out = self.alloc(n * heads * hd)?;
        if n == 0 {
            return Ok(out);
        }
        let plan = KeyPlan::of(keys, self.kv_stride);
        let pool_bytes = 4 * K::f_len(arena) as i64;
        let row_bytes = 4 * self.kv_stride as i64;
        if plan
            .offsets
            .iter()
            .any(|&o| o < -1 || o + row_bytes > pool_bytes)
            || plan
                .fills
                .iter()
                .any(|f| f.base < 0 || f.base >= pool_bytes)
            || K::f_len(q) < n * heads * hd
        {
            return Err("attend: a key outside the arena".to_owned().into());
        }
        // Offsets the indexer's choice fills in are written on the device: their own buffer.
        let offsets = non_empty(&plan.offsets);
        let d_offsets = if plan.fills.is_empty() {
            self.plan_l(&offsets)?
        } else {
            let k = &self.k;
            let (place, mut d_offsets) = self.plans.borrow_mut().l.scratch(
                &offsets,
                |class| k.zeros_l(class),
                |b, v| k.write_l(b, v),
            )?;
            let (idx, k) = chosen.ok_or_else(|| "attend: a choice without indices".to_owned())?;
            if K::i_len(idx) < n * k {
                return Err("attend: the choice is short".to_owned().into());
            }
            let column = |f: fn(&Fill) -> i64| -> Vec<i64> { plan.fills.iter().map(f).collect() };
            let tokens: Vec<i32> = plan.fills.iter().map(|f| f.token as i32).collect();
            let counts: Vec<i32> = plan.fills.iter().map(|f| f.count as i32).collect();
            let (d_tokens, d_counts) = (self.plan_i(&tokens)?, self.plan_i(&counts)?);
            let d_starts = self.plan_l(&column(|f| f.at))?;
            let d_bases = self.plan_l(&column(|f| f.base))?;
            self.k.chosen_offsets(
                idx,
                k,
                (&d_tokens, &d_starts, &d_counts, &d_bases),
                4 * self.kv_stride,
                plan.fills.len(),
                &mut d_offsets,
            )?;
            self.plans.borrow_mut().l.keep(place, d_offsets)
        };
        let d_starts = self.plan_l(&plan.starts)?;
        let sinks = at_layer(&self.model.sinks, layer)?;
        if K::f_len(sinks) < heads {
            return Err("attend: fewer sinks than heads".to_owned().into());
        }
        let scale = 1.0 / (hd as f32).sqrt();
        if let (true, Some((nope, rope))) = (self.fast_attention, self.kv_rows.e4m3_bf16_split(hd))
        {
            self.k.attn_fast(
                q,
                (arena, (nope, rope)),
                (&d_offsets, &d_starts),
                sinks,
                (n, heads),
                scale,
                &mut out,
            )?;
            return Ok(out);
        }
        self.k.attn_exact(
            q,
            (arena, self.kv_rows),
            (&d_offsets, &d_starts),
            sinks,
            (n, heads, hd, padded_keys(plan.most)),
            scale,
            &mut out,
        )?;
        Ok(out)
    }

    fn route(
        &self,
        layer: usize,
        logits: &DBuf<K>,
        tokens: &DIdx<K>,
        n: usize,
    ) -> Result<(DIdx<K>, DBuf<K>), K::Error> {
        self.routing(layer, logits, tokens, n)
    }

    fn routed_experts(
        &self,
        layer: usize,
        h: &DBuf<K>,
        experts: &DIdx<K>,
        widths: (usize, usize),
        pairs: usize,
    ) -> Result<DBuf<K>, K::Error> {
        if let Some(sliced) = self.sliced.as_deref() {
            return self.routed_sliced(sliced, layer, h, experts, widths, pairs);
        }
        match (self.expert_parallel.as_deref(), &self.tensor_parallel) {
            (Some(ep), None) => self.routed_in_group(ep, layer, h, experts, widths, pairs),
            (Some(ep), Some(_)) => self.routed_replicated(ep, layer, h, experts, widths, pairs),
            (None, _) => super::routed_here(self, layer, h, experts, widths, pairs),
        }
    }

    fn head_share(&self, c: &ModelConfig) -> (Range<usize>, Range<usize>) {
        match &self.tensor_parallel {
            Some(tp) => (tp.heads(), tp.groups()),
            None => (0..c.num_heads, 0..c.o_groups),
        }
    }

    fn gather_lows(&self, lows: DBuf<K>, n: usize, width: usize) -> Result<DBuf<K>, K::Error> {
        match self.tensor_parallel.as_deref() {
            Some(tp) => self.gather_in_group(tp, &lows, n, width),
            None => Ok(lows),
        }
    }

    fn expert_pairs(
        &self,
        layer: usize,
        proj: Proj,
        x: &DBuf<K>,
        experts: &DIdx<K>,
        per: usize,
        pairs: usize,
    ) -> Result<DBuf<K>, K::Error> {
        self.expert_pair_rows(layer, proj, x, (experts, per, pairs))
    }

    fn swiglu(
        &self,
        gate: &DBuf<K>,
        up: &DBuf<K>,
        rows: usize,
        width: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let n = rows * width;
        let mut out = self.alloc(n)?;
        if K::f_len(gate) < n || K::f_len(up) < n {
            return Err("swiglu buffers".to_owned().into());
        }
        if n > 0 {
            self.k
                .swiglu(gate, up, n, self.config.swiglu_limit, &mut out)?;
        }
        Ok(out)
    }

    fn combine(
        &self,
        ys: &DBuf<K>,
        weights: &DBuf<K>,
        shared: &DBuf<K>,
        n: usize,
        k: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let d = self.config.hidden_size;
        let mut out = self.alloc(n * d)?;
        if K::f_len(ys) < n * k * d
            || K::f_len(weights) < n * k
            || K::f_len(shared) < n * d
            || k == 0
        {
            return Err("combine buffers".to_owned().into());
        }
        if n > 0 {
            self.k
                .moe_combine((ys, weights, shared), (n, k, d), &mut out)?;
        }
        Ok(out)
    }
}

/// The most keys a token of a launch has, padded to its size class (within the exact
/// attention's 96 KiB of shared memory, 4 bytes a key): a bound on every token's keys that
/// stays the same as sequences grow, so steps keep one signature (`super::staged`) for a while.
pub(super) fn padded_keys(most: usize) -> usize {
    let padded = pool::size_class(most);
    if padded * 4 <= 96 * 1024 {
        padded
    } else {
        most
    }
}

fn non_empty(v: &[i64]) -> Vec<i64> {
    if v.is_empty() { vec![0] } else { v.to_vec() }
}
