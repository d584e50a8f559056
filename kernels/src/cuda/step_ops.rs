//! [`CudaStepOps`]: the decode step's ops (`crate::step::StepOps`) on a CUDA device, each one
//! or a few kernels with the engine's bits (`exact_gemv`, `norm_rope_rows`, `hyper_*`,
//! `compress_pool`, `indexer_scores` + `indexer_topk`, `attn_exact`, `moe_route`,
//! `exact_pairs`, `swiglu_clamp`, `moe_combine`) and `step.cu`'s data movement. Activations and
//! state stay in device buffers; what an op takes from the host is the step's plan (row
//! offsets, and each row's rotation from its position). The GPU test `step` runs the decode
//! step over these ops and over `crate::step::cpu_ops::CpuStepOps` and asserts equal bits.

use std::ops::Range;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use engine::{config::ModelConfig, model::Model, rope::Rope};

use super::{
    Gpu, KernelError, grid_dim, non_empty,
    step_model::{DeviceModel, at_layer, hc_dim},
};
use crate::{
    rows::{NormRope, RowNorm, sin_cos_table},
    step::{
        Comp, Compressed, IndexAt, Lin, Mixed, Norm, Proj, RopeKind, RowOp, StepOps, Sub,
        TokenKeys, View, WindowClose,
    },
};

/// The decode step's ops on `gpu` for a model whose weights were uploaded once.
#[derive(Debug)]
pub struct CudaStepOps<'g> {
    gpu: &'g Gpu,
    config: ModelConfig,
    main: Rope,
    compress: Rope,
    model: DeviceModel,
}

fn shape(message: impl Into<String>) -> KernelError {
    KernelError::Shape(message.into())
}

fn blocks(n: usize, per: usize, what: &str) -> Result<LaunchConfig, KernelError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(n.div_ceil(per), what)?, 1, 1),
        block_dim: (per as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn offsets(n: usize, stride: usize, start: usize) -> Vec<i64> {
    (0..n).map(|i| (i * stride + start) as i64).collect()
}

impl<'g> CudaStepOps<'g> {
    /// Uploads `model`'s weights to `gpu`.
    pub fn new(gpu: &'g Gpu, model: &Model) -> Result<Self, KernelError> {
        let (main, compress) = Rope::tables(&model.config);
        Ok(Self {
            gpu,
            config: model.config.clone(),
            main,
            compress,
            model: DeviceModel::upload(gpu, model)?,
        })
    }

    fn rope(&self, kind: RopeKind) -> &Rope {
        match kind {
            RopeKind::Main => &self.main,
            RopeKind::Compress => &self.compress,
        }
    }

    /// `width` values from `src` at each of `from` to `dst` at each of `to` (negative: skipped).
    pub(super) fn copy_rows(
        &self,
        src: &CudaSlice<f32>,
        from: &[i64],
        dst: &mut CudaSlice<f32>,
        to: &[i64],
        width: usize,
    ) -> Result<(), KernelError> {
        let w = width as i64;
        let fits = |o: i64, len: usize| o >= 0 && o + w <= len as i64;
        if from.len() != to.len()
            || from.iter().any(|&o| !fits(o, src.len()))
            || to.iter().any(|&o| o >= 0 && !fits(o, dst.len()))
        {
            return Err(shape(format!(
                "copy_rows: {} rows of {width} outside their buffers",
                from.len()
            )));
        }
        if from.is_empty() || width == 0 {
            return Ok(());
        }
        let s = &self.gpu.stream;
        let (d_from, d_to) = (s.clone_htod(from)?, s.clone_htod(to)?);
        let f = self.gpu.step.load_function("copy_rows")?;
        let mut launch = s.launch_builder(&f);
        launch.arg(src).arg(&d_from).arg(dst).arg(&d_to).arg(&w);
        // SAFETY: `copy_rows`'s parameters in order; every row inside its buffer (checked).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(from.len(), "rows")?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    pub(super) fn alloc_idx(&self, len: usize) -> Result<CudaSlice<i32>, KernelError> {
        Ok(self.gpu.stream.alloc_zeros::<i32>(len.max(1))?)
    }

    /// `x *= by` over the first `n` values (`step.cu` `scale_values`).
    pub(super) fn scale_values(
        &self,
        x: &mut CudaSlice<f32>,
        by: f32,
        n: usize,
    ) -> Result<(), KernelError> {
        if n == 0 {
            return Ok(());
        }
        let f = self.gpu.step.load_function("scale_values")?;
        let n_i = n as i64;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch.arg(x).arg(&by).arg(&n_i);
        // SAFETY: `scale_values(float*, float, long long)`; `x` holds `n` values (callers).
        unsafe { launch.launch(blocks(n, 256, "values")?)? };
        Ok(())
    }
}

impl StepOps for CudaStepOps<'_> {
    type Error = KernelError;
    type Buf = CudaSlice<f32>;
    type Idx = CudaSlice<i32>;

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        let s = &self.gpu.stream;
        let mut buf = s.alloc_zeros::<f32>(len.max(1))?;
        let f = self.gpu.moe_align.load_function("fill_nan")?;
        let n = len.max(1) as i64;
        let mut launch = s.launch_builder(&f);
        launch.arg(&mut buf).arg(&n);
        // SAFETY: `fill_nan(float*, long long)` over the whole buffer.
        unsafe { launch.launch(blocks(len.max(1), 256, "values")?)? };
        Ok(buf)
    }

    fn put_at(
        &self,
        buf: &mut CudaSlice<f32>,
        offset: usize,
        values: &[f32],
    ) -> Result<(), KernelError> {
        if offset + values.len() > buf.len() {
            return Err(shape("put_at: past the buffer"));
        }
        if !values.is_empty() {
            let mut view = buf.slice_mut(offset..offset + values.len());
            self.gpu.stream.memcpy_htod(values, &mut view)?;
        }
        Ok(())
    }

    fn put_idx(&self, values: &[i32]) -> Result<CudaSlice<i32>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&non_empty(values))?)
    }

    fn get(&self, buf: &CudaSlice<f32>, range: Range<usize>) -> Result<Vec<f32>, KernelError> {
        if range.end > buf.len() || range.start > range.end {
            return Err(shape("get: past the buffer"));
        }
        if range.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.gpu.stream.clone_dtoh(&buf.slice(range))?)
    }

    fn copy(&self, buf: &CudaSlice<f32>, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        if len > buf.len() {
            return Err(shape("copy: past the buffer"));
        }
        let mut out = self.alloc(len)?;
        if len > 0 {
            let mut view = out.slice_mut(0..len);
            self.gpu.stream.memcpy_dtod(&buf.slice(0..len), &mut view)?;
        }
        Ok(out)
    }

    fn embed(&self, tokens: &CudaSlice<i32>, n: usize) -> Result<CudaSlice<f32>, KernelError> {
        let (hc, d) = hc_dim(&self.config);
        let mut out = self.alloc(n * hc * d)?;
        if n == 0 {
            return Ok(out);
        }
        if tokens.len() < n {
            return Err(shape("embed: fewer token ids than tokens"));
        }
        let m = &self.model;
        let f = self.gpu.step.load_function("embed_rows")?;
        let (bf16, rows, dim, hc_i) = (
            i32::from(m.embed_bf16),
            m.embed_rows as i64,
            d as i64,
            hc as i32,
        );
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&m.embed)
            .arg(&bf16)
            .arg(&rows)
            .arg(&dim)
            .arg(tokens)
            .arg(&hc_i)
            .arg(&mut out);
        // SAFETY: `embed_rows`'s parameters in order; the table holds `rows` rows of `dim`
        // (uploaded from the checkpoint), `out` `n * hc * dim` values; ids outside are NaN rows.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(n, "tokens")?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(out)
    }

    fn linear(
        &self,
        w: Lin,
        rows: Range<usize>,
        x: &CudaSlice<f32>,
        x_view: View,
        y: &mut CudaSlice<f32>,
        y_view: View,
        n: usize,
    ) -> Result<(), KernelError> {
        let dev = self.model.linear(w)?;
        let (cols, out) = (dev.cols, rows.len());
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
        if y_view == View::rows(out) {
            return self
                .gpu
                .launch_exact_gemv(dev, (rows.start, out), input, n, y);
        }
        let mut tmp = self.alloc(n * out)?;
        self.gpu
            .launch_exact_gemv(dev, (rows.start, out), input, n, &mut tmp)?;
        let to = offsets(n, y_view.stride, y_view.start);
        self.copy_rows(&tmp, &offsets(n, out, 0), y, &to, out)
    }

    fn norm_rope(
        &self,
        x: &mut CudaSlice<f32>,
        op: &RowOp<'_>,
        n: usize,
    ) -> Result<(), KernelError> {
        let s = &self.gpu.stream;
        let (table, rope) = match op.rope {
            Some((kind, positions)) => {
                let positions = positions
                    .get(..n)
                    .ok_or_else(|| shape("norm_rope: fewer positions than rows"))?;
                let rope = self.rope(kind);
                (sin_cos_table(rope, positions), rope.rope_dim())
            }
            None => (Vec::new(), 0),
        };
        let sin_cos = s.clone_htod(&non_empty(&table))?;
        let (norm, weight) = match op.norm {
            Norm::None => (RowNorm::None, None),
            Norm::Unweighted => (RowNorm::Unweighted, None),
            Norm::Weighted(v) => (RowNorm::Weighted(&[]), Some(self.model.vector(v)?)),
        };
        let dummy;
        let weight = if let Some(w) = weight {
            w
        } else {
            dummy = s.alloc_zeros::<f32>(1)?;
            &dummy
        };
        if x.len() < n * op.heads * op.head_dim {
            return Err(shape("norm_rope: fewer values than rows"));
        }
        let spec = NormRope {
            heads: op.heads,
            head_dim: op.head_dim,
            rope,
            norm,
            eps: self.config.rms_norm_eps,
            inverse: op.inverse,
        };
        self.gpu
            .launch_norm_rope_rows(x, &spec, weight, &sin_cos, n)
    }

    fn hyper_pre(
        &self,
        layer: usize,
        sub: Sub,
        x: &CudaSlice<f32>,
        mixes: &CudaSlice<f32>,
        n: usize,
    ) -> Result<Mixed<CudaSlice<f32>>, KernelError> {
        let (hc, d) = hc_dim(&self.config);
        let (mut input, mut post, mut comb) = (
            self.alloc(n * d)?,
            self.alloc(n * hc)?,
            self.alloc(n * hc * hc)?,
        );
        let h = self
            .model
            .hyper
            .get(&(layer, sub))
            .ok_or_else(|| shape(format!("no hyper-connections {layer} {sub:?}")))?;
        if x.len() < n * hc * d || mixes.len() < n * (2 + hc) * hc || hc > super::MAX_HC {
            return Err(shape("hyper_pre buffers"));
        }
        if n > 0 {
            let (hc_i, dim) = (hc as i32, d as i64);
            let iters = self.config.hc_sinkhorn_iters as i32;
            let f = self.gpu.hyper.load_function("hyper_pre")?;
            let mut launch = self.gpu.stream.launch_builder(&f);
            launch
                .arg(x)
                .arg(mixes)
                .arg(&h.scale)
                .arg(&h.base)
                .arg(&hc_i)
                .arg(&dim)
                .arg(&self.config.hc_eps)
                .arg(&iters)
                .arg(&mut input)
                .arg(&mut post)
                .arg(&mut comb);
            // SAFETY: `hyper_pre`'s parameters in order; buffers sized above.
            unsafe { launch.launch(blocks(n * 256, 256, "tokens")?)? };
        }
        Ok(Mixed { input, post, comb })
    }

    fn hyper_post(
        &self,
        x: &CudaSlice<f32>,
        y: &CudaSlice<f32>,
        post: &CudaSlice<f32>,
        comb: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        let (hc, d) = hc_dim(&self.config);
        let mut out = self.alloc(n * hc * d)?;
        if x.len() < n * hc * d
            || y.len() < n * d
            || post.len() < n * hc
            || comb.len() < n * hc * hc
        {
            return Err(shape("hyper_post buffers"));
        }
        if n > 0 {
            let (hc_i, dim) = (hc as i32, d as i64);
            let f = self.gpu.hyper.load_function("hyper_post")?;
            let mut launch = self.gpu.stream.launch_builder(&f);
            launch
                .arg(x)
                .arg(y)
                .arg(post)
                .arg(comb)
                .arg(&hc_i)
                .arg(&dim)
                .arg(&mut out);
            // SAFETY: `hyper_post`'s parameters in order; buffers sized above.
            unsafe { launch.launch(blocks(n * 256, 256, "tokens")?)? };
        }
        Ok(out)
    }

    fn hyper_head(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>, KernelError> {
        let (hc, d) = hc_dim(&self.config);
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
        self.gpu
            .launch_exact_gemv(&self.model.head_mix, (0, hc), &flat, n, &mut mix)?;
        let (hc_i, dim) = (hc as i32, d as i64);
        let f = self.gpu.hyper.load_function("hyper_head")?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(x)
            .arg(&mix)
            .arg(&self.model.head_scale)
            .arg(&self.model.head_base)
            .arg(&hc_i)
            .arg(&dim)
            .arg(&self.config.hc_eps)
            .arg(&mut out);
        // SAFETY: `hyper_head`'s parameters in order; `x` holds `n` tokens' streams (copied
        // above, which checks it).
        unsafe { launch.launch(blocks(n * 256, 256, "tokens")?)? };
        Ok(out)
    }

    fn write_rows(
        &self,
        src: &CudaSlice<f32>,
        width: usize,
        arena: &mut CudaSlice<f32>,
        to: &[i64],
    ) -> Result<(), KernelError> {
        self.copy_rows(src, &offsets(to.len(), width, 0), arena, to, width)
    }

    fn close_windows(
        &self,
        layer: usize,
        comp: Comp,
        arena: &mut CudaSlice<f32>,
        closes: &[WindowClose],
    ) -> Result<CudaSlice<f32>, KernelError> {
        super::step_close::close_windows(self, self.model.compressor(layer, comp)?, arena, closes)
    }

    fn index_select(
        &self,
        q: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        arena: &CudaSlice<f32>,
        at: &[IndexAt],
        k: usize,
    ) -> Result<CudaSlice<i32>, KernelError> {
        super::step_close::index_select(self, (q, weights), arena, at, k)
    }

    fn attend(
        &self,
        layer: usize,
        q: &CudaSlice<f32>,
        arena: &CudaSlice<f32>,
        keys: &[TokenKeys],
        chosen: Option<(&CudaSlice<i32>, usize)>,
    ) -> Result<CudaSlice<f32>, KernelError> {
        let c = &self.config;
        let (heads, hd, n) = (c.num_heads, c.head_dim, keys.len());
        let row_bytes = 4 * hd as i64;
        let mut out = self.alloc(n * heads * hd)?;
        if n == 0 {
            return Ok(out);
        }
        // Every token's key offsets (bytes), the indexer's choice left to `chosen_offsets`.
        let (mut offs, mut starts) = (Vec::new(), vec![0i64]);
        let (mut fill_at, mut fill_count, mut fill_base) = (Vec::new(), Vec::new(), Vec::new());
        for tk in keys {
            offs.extend(tk.window.iter().map(|&o| 4 * o));
            match tk.compressed {
                Compressed::None => {}
                Compressed::All { rows, count } => {
                    offs.extend((0..count as i64).map(|i| 4 * rows + i * row_bytes));
                }
                Compressed::Chosen { rows, count } => {
                    fill_at.push(offs.len() as i64);
                    fill_count.push(count as i32);
                    fill_base.push(4 * rows);
                    offs.extend(std::iter::repeat_n(-1, count));
                }
            }
            starts.push(offs.len() as i64);
        }
        let pool_bytes = 4 * arena.len() as i64;
        if offs.iter().any(|&o| o < -1 || o + row_bytes > pool_bytes)
            || fill_base.iter().any(|&b| b < 0 || b >= pool_bytes)
            || q.len() < n * heads * hd
        {
            return Err(shape("attend: a key outside the arena"));
        }
        let s = &self.gpu.stream;
        let mut d_offs = s.clone_htod(&non_empty(&offs))?;
        if !fill_at.is_empty() {
            let (idx, k) = chosen.ok_or_else(|| shape("attend: a choice without indices"))?;
            if idx.len() < n * k {
                return Err(shape("attend: the choice is short"));
            }
            let (d_at, d_count) = (s.clone_htod(&fill_at)?, s.clone_htod(&fill_count)?);
            let d_base = s.clone_htod(&fill_base)?;
            let (k_i, tokens) = (k as i32, fill_at.len() as i32);
            let f = self.gpu.step.load_function("chosen_offsets")?;
            let mut launch = s.launch_builder(&f);
            // Chosen tokens are the ones with a fill entry, in order: index their rows.
            let d_rows = s.clone_htod(&chosen_rows(keys))?;
            launch
                .arg(idx)
                .arg(&k_i)
                .arg(&d_rows)
                .arg(&d_at)
                .arg(&d_count)
                .arg(&d_base)
                .arg(&row_bytes)
                .arg(&tokens)
                .arg(&mut d_offs);
            // SAFETY: `chosen_offsets`'s parameters in order; each token's slots lie inside
            // `offs` (reserved above), its chosen rows inside the arena's rows (the indexer
            // only returns rows below the token's visible count).
            unsafe { launch.launch(blocks(fill_at.len(), 128, "tokens")?)? };
        }
        let d_starts = s.clone_htod(&starts)?;
        let sinks = at_layer(&self.model.sinks, layer)?;
        let most = starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0) as usize;
        let smem = u32::try_from(4 * most.max(1))
            .ok()
            .filter(|&b| b <= 96 * 1024)
            .ok_or_else(|| shape(format!("attn_exact: {most} keys")))?;
        let f = self.gpu.attn_exact.load_function("attn_exact")?;
        if smem > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let (heads_i, dim_i) = (heads as i32, hd as i32);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut launch = s.launch_builder(&f);
        launch
            .arg(q)
            .arg(arena)
            .arg(&d_offs)
            .arg(&d_starts)
            .arg(sinks)
            .arg(&heads_i)
            .arg(&dim_i)
            .arg(&scale)
            .arg(&mut out);
        // SAFETY: `attn_exact`'s parameters in order (the arena is its byte pool); every offset
        // a whole f32 row inside the arena or -1 (checked above, or written by
        // `chosen_offsets`); one float of shared memory per key of the longest token.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(n * heads, "token heads")?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: smem,
            })?;
        }
        Ok(out)
    }

    fn route(
        &self,
        layer: usize,
        logits: &CudaSlice<f32>,
        tokens: &CudaSlice<i32>,
        n: usize,
    ) -> Result<(CudaSlice<i32>, CudaSlice<f32>), KernelError> {
        super::step_close::route(self, layer, logits, tokens, n)
    }

    fn expert_pairs(
        &self,
        layer: usize,
        proj: Proj,
        x: &CudaSlice<f32>,
        experts: &CudaSlice<i32>,
        per: usize,
        pairs: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        super::step_close::expert_pairs(self, layer, proj, x, (experts, per, pairs))
    }

    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        rows: usize,
        width: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        let mut out = self.alloc(rows * width)?;
        self.gpu
            .launch_swiglu_clamp(gate, up, rows * width, self.config.swiglu_limit, &mut out)?;
        Ok(out)
    }

    fn combine(
        &self,
        ys: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        shared: &CudaSlice<f32>,
        n: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        let d = self.config.hidden_size;
        let mut out = self.alloc(n * d)?;
        if ys.len() < n * k * d || weights.len() < n * k || shared.len() < n * d || k == 0 {
            return Err(shape("combine buffers"));
        }
        if n > 0 {
            let (k_i, hidden) = (k as i32, d as i64);
            let f = self.gpu.exact.load_function("moe_combine")?;
            let mut launch = self.gpu.stream.launch_builder(&f);
            launch
                .arg(ys)
                .arg(weights)
                .arg(shared)
                .arg(&k_i)
                .arg(&hidden)
                .arg(&mut out);
            // SAFETY: `moe_combine`'s parameters in order; buffers sized above.
            unsafe { launch.launch(blocks(n * 256, 256, "tokens")?)? };
        }
        Ok(out)
    }
}

/// The row of the chosen indices of each token with an indexer choice (its index in the batch).
fn chosen_rows(keys: &[TokenKeys]) -> Vec<i32> {
    keys.iter()
        .enumerate()
        .filter(|(_, tk)| matches!(tk.compressed, Compressed::Chosen { .. }))
        .map(|(t, _)| t as i32)
        .collect()
}

/// Shared with `step_close`: the parts of the ops it needs.
impl CudaStepOps<'_> {
    pub(super) fn gpu(&self) -> &Gpu {
        self.gpu
    }

    pub(super) fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub(super) fn model(&self) -> &DeviceModel {
        &self.model
    }
}
