//! [`CudaKernels`]: the device decode step's kernels ([`Kernels`]) as launches on a [`Gpu`],
//! and [`CudaStepOps`], the step's ops over them. Each launch passes the kernel's parameters in
//! order; the shapes were checked by `crate::step::device_ops` before.

use crate::cuda::kernel;
use std::{ops::Range, sync::Arc};

use cudarc::driver::CudaSlice;
use engine::{
    tensor::{Weight, WeightForm},
    weights::{ExpertWeights, MoeWeights},
};

use super::{
    DeviceRows, Gpu, KernelError, StoredRows,
    attention_fp8::KeptScratch,
    exact::PairStackRef,
    graph::{StepGraph, addr},
    non_empty,
};
mod choice;
mod dispatch;
mod hyper;
mod launch;
mod stack;

use crate::step::{
    Proj,
    device_ops::DeviceStepOps,
    kernels::{HyperSpec, Kernels, PoolSpec, RouteSpec, RowSpec, ScoreSpec, SlotSpec},
};
use launch::{blocks, function, per_item};

/// The decode step's ops on a GPU.
pub type CudaStepOps = DeviceStepOps<CudaKernels>;

/// The decode step's kernels on `gpu` (shared: the step keeps them for as long as it serves).
#[derive(Debug, Clone)]
pub struct CudaKernels {
    pub gpu: Arc<Gpu>,
    /// The fast attention's plan, partials and output by batch and shape, made once: each
    /// was 5 buffers made and filled from the host per layer per step (12.6 MB of NaNs for
    /// 32 requests of 64 heads).
    attn_scratch: Arc<KeptScratch>,
    /// The grouped GEMM's grouping buffers, kept from launch to launch (`gemm_pairs`).
    grouping: Arc<std::sync::Mutex<Option<super::MoeGrouping>>>,
}

impl CudaKernels {
    pub fn new(gpu: Arc<Gpu>) -> Self {
        Self {
            gpu,
            attn_scratch: Arc::default(),
            grouping: Arc::default(),
        }
    }
}

/// One projection of every routed expert of a layer, stacked as `exact_pairs` reads it.
#[derive(Debug)]
pub struct PairStack {
    kernel: &'static str,
    packed: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    scale_2: CudaSlice<f32>,
    experts: usize,
    rows: usize,
    cols: usize,
}

/// The embedding table's bytes (f32 or bf16).
#[derive(Debug)]
pub struct DeviceTable {
    bytes: CudaSlice<u8>,
    bf16: bool,
    rows: usize,
    cols: usize,
}

impl Kernels for CudaKernels {
    type Error = KernelError;
    type F = CudaSlice<f32>;
    type I = CudaSlice<i32>;
    type L = CudaSlice<i64>;
    type Rows = DeviceRows;
    type Stack = PairStack;
    type Table = DeviceTable;
    type Hash = CudaSlice<u32>;
    type Graph = StepGraph;

    fn f_len(b: &CudaSlice<f32>) -> usize {
        b.len()
    }

    fn i_len(b: &CudaSlice<i32>) -> usize {
        b.len()
    }

    fn f_addr(b: &CudaSlice<f32>) -> usize {
        addr(b)
    }

    fn i_addr(b: &CudaSlice<i32>) -> usize {
        addr(b)
    }

    fn l_addr(b: &CudaSlice<i64>) -> usize {
        addr(b)
    }

    fn begin_capture(&self) -> Result<bool, KernelError> {
        super::graph::begin_capture(&self.gpu)
    }

    fn graphs_hold_collectives(&self) -> Result<(), String> {
        Err(super::graph::NO_GROUP_GRAPHS.to_owned())
    }

    fn end_capture(&self) -> Result<Option<StepGraph>, KernelError> {
        super::graph::end_capture(&self.gpu)
    }

    fn launch_graph(&self, graph: &StepGraph) -> Result<(), KernelError> {
        graph.launch()
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        Ok(self.gpu.stream.alloc_zeros::<f32>(len.max(1))?)
    }

    fn zeros_i(&self, len: usize) -> Result<CudaSlice<i32>, KernelError> {
        Ok(self.gpu.stream.alloc_zeros::<i32>(len.max(1))?)
    }

    fn zeros_l(&self, len: usize) -> Result<CudaSlice<i64>, KernelError> {
        Ok(self.gpu.stream.alloc_zeros::<i64>(len.max(1))?)
    }

    fn upload(&self, v: &[f32]) -> Result<CudaSlice<f32>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&non_empty(v))?)
    }

    fn upload_i(&self, v: &[i32]) -> Result<CudaSlice<i32>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&non_empty(v))?)
    }

    fn upload_l(&self, v: &[i64]) -> Result<CudaSlice<i64>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&non_empty(v))?)
    }

    fn write(&self, dst: &mut CudaSlice<f32>, at: usize, v: &[f32]) -> Result<(), KernelError> {
        let mut view = dst.slice_mut(at..at + v.len());
        Ok(self.gpu.stream.memcpy_htod(v, &mut view)?)
    }

    fn write_i(&self, dst: &mut CudaSlice<i32>, v: &[i32]) -> Result<(), KernelError> {
        let mut view = dst
            .try_slice_mut(0..v.len())
            .ok_or_else(|| KernelError::Shape("write_i: past the buffer".into()))?;
        Ok(self.gpu.stream.memcpy_htod(v, &mut view)?)
    }

    fn write_l(&self, dst: &mut CudaSlice<i64>, v: &[i64]) -> Result<(), KernelError> {
        let mut view = dst
            .try_slice_mut(0..v.len())
            .ok_or_else(|| KernelError::Shape("write_l: past the buffer".into()))?;
        Ok(self.gpu.stream.memcpy_htod(v, &mut view)?)
    }

    fn read(&self, b: &CudaSlice<f32>, range: Range<usize>) -> Result<Vec<f32>, KernelError> {
        Ok(self.gpu.stream.clone_dtoh(&b.slice(range))?)
    }

    fn read_many(
        &self,
        parts: &[(&CudaSlice<f32>, Range<usize>)],
    ) -> Result<Vec<Vec<f32>>, KernelError> {
        self.gpu.read_ranges(parts)
    }

    fn read_i(&self, b: &CudaSlice<i32>, range: Range<usize>) -> Result<Vec<i32>, KernelError> {
        let view = b
            .try_slice(range)
            .ok_or_else(|| KernelError::Shape("read_i: past the buffer".into()))?;
        Ok(self.gpu.stream.clone_dtoh(&view)?)
    }

    fn read_l(&self, b: &CudaSlice<i64>) -> Result<Vec<i64>, KernelError> {
        Ok(self.gpu.stream.clone_dtoh(b)?)
    }

    fn copy(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        len: usize,
    ) -> Result<(), KernelError> {
        let mut view = dst.slice_mut(0..len);
        Ok(self.gpu.stream.memcpy_dtod(&src.slice(0..len), &mut view)?)
    }

    fn upload_rows(&self, w: &Weight) -> Result<DeviceRows, KernelError> {
        self.gpu.upload_rows(StoredRows::of(w), w.rows, w.cols)
    }

    fn upload_matrix(
        &self,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<DeviceRows, KernelError> {
        self.gpu.upload_rows(StoredRows::F32(data), rows, cols)
    }

    fn rows_shape(w: &DeviceRows) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn upload_stack(
        &self,
        experts: &[ExpertWeights],
        proj: Proj,
    ) -> Result<PairStack, KernelError> {
        stack::upload_stack(&self.gpu.stream, experts, proj)
    }

    fn stack_shape(s: &PairStack) -> (usize, usize, usize) {
        (s.experts, s.rows, s.cols)
    }

    fn upload_table(&self, embed: &Weight) -> Result<DeviceTable, KernelError> {
        let (bytes, bf16) = match embed.form() {
            WeightForm::F32(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), false),
            WeightForm::Bf16(b) => (b.as_slice().to_vec(), true),
            _ => {
                return Err(KernelError::Shape(
                    "the device decode step reads an f32 or bf16 embedding table".into(),
                ));
            }
        };
        Ok(DeviceTable {
            bytes: self.gpu.stream.clone_htod(&non_empty::<u8>(&bytes))?,
            bf16,
            rows: embed.rows,
            cols: embed.cols,
        })
    }

    fn upload_hash(&self, moe: &MoeWeights) -> Result<Option<CudaSlice<u32>>, KernelError> {
        moe.tid2eid
            .as_deref()
            .map(|t| Ok(self.gpu.stream.clone_htod(&non_empty(t))?))
            .transpose()
    }

    fn fill_nan(&self, x: &mut CudaSlice<f32>) -> Result<(), KernelError> {
        self.gpu.launch_fill_nan(x)
    }

    fn embed_rows(
        &self,
        table: &DeviceTable,
        tokens: &CudaSlice<i32>,
        (n, hc): (usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.step, kernel::embed_rows::NAME)?;
        let (bf16, rows, dim, hc_i) = (
            i32::from(table.bf16),
            table.rows as i64,
            table.cols as i64,
            hc as i32,
        );
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::embed_rows::args(
            &mut launch,
            &table.bytes,
            &bf16,
            &rows,
            &dim,
            tokens,
            &hc_i,
            out,
        );
        // SAFETY: `embed_rows`' parameters in order; one block per token, `n` ids, `out`
        // `n * hc * dim` values (checked by the caller); ids outside the table give NaN rows.
        unsafe { launch.launch(per_item(n, 256, "tokens")?)? };
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &CudaSlice<f32>,
        from: &CudaSlice<i64>,
        dst: &mut CudaSlice<f32>,
        to: &CudaSlice<i64>,
        width: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.step, kernel::copy_rows::NAME)?;
        let w = width as i64;
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::copy_rows::args(&mut launch, src, from, dst, to, &w);
        // SAFETY: `copy_rows`' parameters in order; every row inside its buffer (checked by
        // the caller); one block per row.
        unsafe { launch.launch(per_item(n, 128, "rows")?)? };
        Ok(())
    }

    fn exact_gemv(
        &self,
        w: &DeviceRows,
        rows: (usize, usize),
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.gpu.launch_exact_gemv(w, rows, x, n, y)
    }

    fn norm_rope_rows(
        &self,
        x: &mut CudaSlice<f32>,
        spec: RowSpec,
        w: &CudaSlice<f32>,
        sin_cos: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        let norm = match spec.norm {
            0 => crate::rows::RowNorm::None,
            1 => crate::rows::RowNorm::Unweighted,
            _ => crate::rows::RowNorm::Weighted(&[]),
        };
        let launch = crate::rows::NormRope {
            heads: spec.heads,
            head_dim: spec.head_dim,
            rope: spec.rope,
            norm,
            eps: spec.eps,
            inverse: spec.inverse,
        };
        self.gpu.launch_norm_rope_rows(x, &launch, w, sin_cos, rows)
    }

    fn hyper_pre(
        &self,
        x: &CudaSlice<f32>,
        mixes: &CudaSlice<f32>,
        (scale, base): (&CudaSlice<f32>, &CudaSlice<f32>),
        spec: HyperSpec,
        n: usize,
        (collapsed, post, comb): (
            &mut CudaSlice<f32>,
            &mut CudaSlice<f32>,
            &mut CudaSlice<f32>,
        ),
    ) -> Result<(), KernelError> {
        self.launch_hyper_pre(x, mixes, (scale, base), spec, n, (collapsed, post, comb))
    }

    fn hyper_post(
        &self,
        x: &CudaSlice<f32>,
        y: &CudaSlice<f32>,
        post: &CudaSlice<f32>,
        comb: &CudaSlice<f32>,
        spec: HyperSpec,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.launch_hyper_post(x, y, (post, comb), spec, n, out)
    }

    fn hyper_head(
        &self,
        x: &CudaSlice<f32>,
        mix: &CudaSlice<f32>,
        (scale, base): (f32, &CudaSlice<f32>),
        spec: HyperSpec,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.launch_hyper_head(x, mix, (scale, base), spec, n, out)
    }

    fn add_periodic(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        period: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.step, kernel::add_periodic::NAME)?;
        let (period, n_i) = (period as i64, n as i64);
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::add_periodic::args(&mut launch, x, bias, &period, &n_i);
        // SAFETY: `add_periodic`'s parameters in order; `x` holds `n` values, the bias
        // `period` (checked by the caller).
        unsafe { launch.launch(blocks(n, 256, "values")?)? };
        Ok(())
    }

    fn sum_blocks(
        &self,
        x: &CudaSlice<f32>,
        shape: (usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.launch_sum_blocks(x, shape, out)
    }

    fn scale_values(&self, x: &mut CudaSlice<f32>, by: f32, n: usize) -> Result<(), KernelError> {
        let f = function(&self.gpu.step, kernel::scale_values::NAME)?;
        let n_i = n as i64;
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::scale_values::args(&mut launch, x, &by, &n_i);
        // SAFETY: `scale_values(float*, float, long long)`; `x` holds `n` values.
        unsafe { launch.launch(blocks(n, 256, "values")?)? };
        Ok(())
    }

    fn fp8_kv_store(
        &self,
        rows: &CudaSlice<f32>,
        shape: (usize, usize),
        arena: &mut CudaSlice<f32>,
        offsets: &CudaSlice<i64>,
        n: usize,
    ) -> Result<(), KernelError> {
        // The arena's bytes are the encoder's pool (offsets in bytes, checked by the caller).
        self.gpu
            .launch_fp8_kv_encode(rows, shape, arena, offsets, n)
    }

    fn fp8_kv_round(
        &self,
        rows: &mut CudaSlice<f32>,
        shape: (usize, usize),
        n: usize,
    ) -> Result<(), KernelError> {
        self.gpu.launch_fp8_kv_round(rows, shape, n)
    }

    fn compress_pool(
        &self,
        kv: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        (prev_kv, prev_gate): (&CudaSlice<f32>, &CudaSlice<f32>),
        has_prev: &CudaSlice<i32>,
        p: PoolSpec,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let f = function(&self.gpu.compress, kernel::compress_pool::NAME)?;
        let (windows, ratio, d) = (p.windows as i32, p.ratio as i32, p.d as i32);
        let (width, overlap) = (p.width as i64, i32::from(p.overlap));
        let mut launch = self.gpu.stream.launch_builder(&f);
        kernel::compress_pool::args(
            &mut launch,
            kv,
            gate,
            prev_kv,
            prev_gate,
            has_prev,
            &windows,
            &ratio,
            &d,
            &width,
            &overlap,
            out,
        );
        // SAFETY: `compress_pool`'s parameters in order; every buffer holds `windows` windows.
        unsafe { launch.launch(blocks(p.windows * p.d, 128, "channels")?)? };
        Ok(())
    }

    fn indexer_scores(
        &self,
        q: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        keys: &CudaSlice<f32>,
        starts: &CudaSlice<i64>,
        visible: &CudaSlice<i32>,
        sp: ScoreSpec,
        scores: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.gpu
            .launch_indexer_scores((q, w, keys), (starts, visible), sp, scores)
    }

    fn indexer_topk(
        &self,
        scores: &CudaSlice<f32>,
        visible: &CudaSlice<i32>,
        shape: (usize, usize, usize),
        out: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        self.launch_indexer_topk(scores, visible, shape, out)
    }

    fn chosen_offsets(
        &self,
        chosen: &CudaSlice<i32>,
        k: usize,
        plans: (
            &CudaSlice<i32>,
            &CudaSlice<i64>,
            &CudaSlice<i32>,
            &CudaSlice<i64>,
        ),
        row_bytes: usize,
        entries: usize,
        offsets: &mut CudaSlice<i64>,
    ) -> Result<(), KernelError> {
        self.launch_chosen_offsets((chosen, k), plans, (row_bytes, entries), offsets)
    }

    fn attn_exact(
        &self,
        q: &CudaSlice<f32>,
        (pool, rows): (&CudaSlice<f32>, engine::paged::layout::RowFormat),
        (offsets, starts): (&CudaSlice<i64>, &CudaSlice<i64>),
        sinks: &CudaSlice<f32>,
        shape: (usize, usize, usize, usize),
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        // The f32 arena is the kernel's byte pool; every offset a whole f32 row inside it or -1
        // (checked by the caller or written by `chosen_offsets`).
        self.gpu
            .launch_attn_exact(((q, pool, offsets, starts, sinks), rows), shape, scale, out)
    }

    fn attn_fast(
        &self,
        q: &CudaSlice<f32>,
        (pool, (nope, rope)): (&CudaSlice<f32>, (usize, usize)),
        (offsets, starts): (&CudaSlice<i64>, &CudaSlice<i64>),
        sinks: &CudaSlice<f32>,
        (tokens, heads): (usize, usize),
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let shape = crate::step::kernels::fast_attention_shape(heads, (nope, rope), scale);
        // The arena's bytes are the kernel's pool (whole rows inside it: checked by the caller).
        self.gpu.attn_decode_fp8_kept(
            &self.attn_scratch,
            (q, pool, offsets, starts, sinks),
            (tokens, shape),
            out,
        )
    }

    fn moe_route(
        &self,
        logits: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        hash: Option<&CudaSlice<u32>>,
        tokens: &CudaSlice<i32>,
        sp: RouteSpec,
        scores: &mut CudaSlice<f32>,
        out: (&mut CudaSlice<i32>, &mut CudaSlice<f32>),
    ) -> Result<(), KernelError> {
        self.gpu.launch_moe_route(
            (logits, tokens),
            (bias, hash),
            (sp.tokens, sp.experts, sp.k, sp.table_rows, sp.scaling),
            scores,
            out,
        )
    }

    fn exact_pairs(
        &self,
        stack: &PairStack,
        pairs_of: (&CudaSlice<i32>, &CudaSlice<i32>),
        x: &CudaSlice<f32>,
        pairs: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let view = PairStackRef {
            kernel: stack.kernel,
            packed: &stack.packed,
            scales: &stack.scales,
            scale_2: &stack.scale_2,
            shape: (stack.experts, stack.rows, stack.cols),
        };
        self.gpu.launch_exact_pairs(&view, pairs_of, x, pairs, y)
    }

    fn fast_pairs(
        &self,
        stack: &PairStack,
        (tokens, experts): (&CudaSlice<i32>, &CudaSlice<i32>),
        x: &CudaSlice<f32>,
        pairs: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        // The exact kernels' stack is the checkpoint's bytes, as the grouped GEMV reads them.
        let device = super::DeviceExperts {
            packed: &stack.packed,
            scales: &stack.scales,
            scale_2: (stack.kernel == kernel::exact_pairs_nvfp4::NAME).then_some(&stack.scale_2),
            experts: stack.experts,
            rows: stack.rows,
            cols: stack.cols,
        };
        self.gpu
            .launch_grouped_gemv(&device, x, tokens, experts, pairs, y)
    }

    fn gemm_pairs(
        &self,
        stack: &PairStack,
        (tokens, experts): (&CudaSlice<i32>, &CudaSlice<i32>),
        x: &CudaSlice<f32>,
        pairs: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        // The exact kernels' stack is the checkpoint's bytes, as the grouped GEMM reads them.
        let device = super::DeviceStack {
            packed: &stack.packed,
            scales: &stack.scales,
            scale_2: (stack.kernel == kernel::exact_pairs_nvfp4::NAME).then_some(&stack.scale_2),
            experts: stack.experts,
            n: stack.rows,
            k: stack.cols,
        };
        let mut kept = self
            .grouping
            .lock()
            .map_err(|_| KernelError::Shape("gemm_pairs: a launch panicked".into()))?;
        let grouping = self
            .gpu
            .moe_grouping_kept(&mut kept, pairs, stack.experts)?;
        self.gpu
            .launch_grouped_gemm(x, tokens, experts, &device, grouping, y)
    }

    fn fast_linear_takes(w: &DeviceRows) -> bool {
        w.gemm_weight().is_some()
    }

    fn fast_linear_scratch(&self, n: usize, rows: usize, cols: usize) -> usize {
        self.gpu.dense_gemm_scratch((n, rows, cols))
    }

    fn fast_linear(
        &self,
        w: &DeviceRows,
        (row0, rows): (usize, usize),
        x: &CudaSlice<f32>,
        n: usize,
        scratch: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.gpu
            .launch_fast_linear(w, (row0, rows), x, n, scratch, y)
    }

    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.gpu.launch_swiglu_clamp(gate, up, n, limit, out)
    }

    fn argmax_rows(
        &self,
        x: &CudaSlice<f32>,
        shape: (usize, usize),
        out: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        self.gpu.launch_argmax_rows(x, shape, out)
    }

    fn ep_slots(
        &self,
        experts: &CudaSlice<i32>,
        spec: SlotSpec,
        send: &mut CudaSlice<f32>,
        offsets: (&mut CudaSlice<i64>, &mut CudaSlice<i64>),
        counts: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        self.launch_ep_slots(experts, spec, send, offsets, counts)
    }

    fn ep_take_ids(
        &self,
        recv: &CudaSlice<f32>,
        at: &CudaSlice<i64>,
        held: (usize, usize),
        m: usize,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        self.launch_ep_take_ids(recv, at, held, m, ids)
    }

    fn held_ids(
        &self,
        experts: &CudaSlice<i32>,
        held: (usize, usize),
        total: usize,
        pairs: usize,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        self.launch_held_ids(experts, held, total, pairs, ids)
    }

    fn clear_unheld_rows(
        &self,
        ys: &mut CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        width: usize,
        pairs: usize,
    ) -> Result<(), KernelError> {
        self.launch_clear_unheld_rows(ys, ids, width, pairs)
    }

    /// GPU to GPU where the group's collective is NCCL's; through the host otherwise (an
    /// in-process group, as two ranks on one GPU in the tests).
    fn exchange_known(
        &self,
        coll: &mut dyn engine::parallel::collective::Collective,
        send: &CudaSlice<f32>,
        sizes: (&[usize], &[usize]),
    ) -> Result<CudaSlice<f32>, KernelError> {
        self.exchange_rows_known(coll, send, sizes)
    }

    /// GPU to GPU where the group's collective is NCCL's (one all-gather); through the host
    /// otherwise.
    fn all_gather(
        &self,
        coll: &mut dyn engine::parallel::collective::Collective,
        send: &CudaSlice<f32>,
        part: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.all_gather_of(coll, send, part, out)
    }

    /// GPU to GPU where the group's collective is NCCL's (one all-reduce); through the host
    /// otherwise.
    fn all_owned(
        &self,
        coll: &mut dyn engine::parallel::collective::Collective,
        send: &CudaSlice<f32>,
        len: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.all_owned_of(coll, send, len, out)
    }

    fn gather_counts(
        &self,
        coll: &mut dyn engine::parallel::collective::Collective,
        counts: &CudaSlice<i32>,
        n: usize,
    ) -> Result<Vec<Vec<i32>>, KernelError> {
        self.gather_counts_of(coll, counts, n)
    }

    fn moe_combine(
        &self,
        inputs: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        shape: (usize, usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.gpu.launch_moe_combine(inputs, shape, out)
    }
}
