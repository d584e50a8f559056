//! [`DeviceStepOps`]' making (the weights uploaded, the kernel choices) and the plans and
//! rotations it keeps from step to step.

use std::{cell::RefCell, sync::Arc};

use engine::{model::Model, rope::Rope};

use super::{DIdx, DeviceStepOps, ExpertKernel, Plans, ROTATIONS_KEPT};
use crate::step::StepOps as _;
use crate::{
    rows::sin_cos_table,
    step::{
        RopeKind,
        device_model::DeviceModel,
        kernels::{HyperSpec, Kernels},
        layout::kv_stride,
        pool,
    },
};

impl<K: Kernels> DeviceStepOps<K> {
    /// Uploads `model`'s weights through `k` (of its routed experts, its rank's where the
    /// model is a rank of an expert-parallel group, whose pairs its steps then exchange, and
    /// its slice of each where it is a rank of an expert-slice group).
    pub fn new(k: K, model: &Model) -> Result<Self, K::Error> {
        let (main, compress) = Rope::tables(&model.config);
        let device = DeviceModel::upload(&k, model)?;
        let unused = k.zeros(1)?;
        Ok(Self {
            k,
            config: model.config.clone(),
            main,
            compress,
            model: device,
            rotations: RefCell::new(Vec::new()),
            f_pool: Arc::default(),
            i_pool: Arc::default(),
            unused,
            plans: RefCell::new(Plans::default()),
            kv_rows: model.kv_rows(),
            kv_stride: kv_stride(model.config.head_dim, model.kv_rows())?,
            fast_attention: false,
            experts: ExpertKernel::Exact,
            fast_linears: false,
            expert_parallel: model.expert_parallel_shared(),
            tensor_parallel: model.tensor_parallel_shared(),
            sliced: model.sliced_experts_shared(),
        })
    }

    /// Attends with `attn_decode_fp8` from now on: every head of a token against each tile of
    /// its FP8 rows at once, within `2^-8 · max |row value|` of the exact attention rather than
    /// its bits; the indexer's scores on tensor cores too (`indexer_scores_mma`, bf16 queries
    /// and keys, within [`crate::indexer_mma::bound`]), so its top-k may pick other keys where
    /// scores nearly tie. Needs FP8 or bf16 K=V rows (a bf16 row is an FP8 row without e4m3
    /// values, which the kernel reads as such) and shapes the kernels take (at most 64 heads of
    /// at most 512 values; the indexer's heads and dims within a block's shared memory).
    pub fn with_fast_attention(mut self) -> Result<Self, K::Error> {
        let Some((nope, rope)) = self.kv_rows.e4m3_bf16_split(self.config.head_dim) else {
            return Err(
                "fast attention reads FP8 or bf16 K=V rows (kv_cache_dtype fp8 or bf16)"
                    .to_owned()
                    .into(),
            );
        };
        // The kernel's own shape check, here once rather than at the first step.
        let heads = self.head_share(&self.config).0.len();
        crate::step::kernels::fast_attention_shape(heads, (nope, rope), 1.0).check()?;
        let (heads, dim) = (self.config.index_n_heads, self.config.index_head_dim);
        if heads > 0 {
            crate::indexer_mma::check_shape(heads, dim)?;
        }
        self.fast_attention = true;
        Ok(self)
    }

    /// Runs the routed experts with the fast grouped GEMV from now on (`Kernels::fast_pairs`:
    /// within its bound of f64 sums over the decoded weights, not the engine's bits).
    #[must_use]
    pub fn with_fast_experts(mut self) -> Self {
        self.experts = ExpertKernel::GroupedGemv;
        self
    }

    /// Runs the routed experts with the grouped GEMM from now on (`Kernels::gemm_pairs`: the
    /// pairs grouped by expert, each expert's weight read once per 64 of its pairs, the
    /// activations in bf16; within its bound of the f64 reference, not the engine's bits).
    /// For prompt chunks: a decode batch gives an expert a pair or two.
    #[must_use]
    pub fn with_gemm_experts(mut self) -> Self {
        self.experts = ExpertKernel::GroupedGemm;
        self
    }

    /// Runs the bf16 and FP8 attention, shared-expert and output-head linears with the dense
    /// GEMM from now on (`Kernels::fast_linear`: bf16 tensor cores, each weight read once per
    /// 64 sequences, within its bound of f64 sums over the bf16 operands, not the engine's
    /// bits). The hyper-connections' mixing and the MoE gate stay exact.
    #[must_use]
    pub fn with_fast_linears(mut self) -> Self {
        self.fast_linears = true;
        self
    }

    /// `values` as a read-only plan on the device: written once a step (kernels only read
    /// it) into a buffer kept from step to step.
    pub(in crate::step) fn plan_l(&self, values: &[i64]) -> Result<Arc<K::L>, K::Error> {
        let k = &self.k;
        self.plans
            .borrow_mut()
            .l
            .plan(values, |class| k.zeros_l(class), |b, v| k.write_l(b, v))
    }

    /// [`Self::plan_l`] for i32 values.
    pub(in crate::step) fn plan_i(&self, values: &[i32]) -> Result<Arc<K::I>, K::Error> {
        let k = &self.k;
        self.plans
            .borrow_mut()
            .i
            .plan(values, |class| k.zeros_i(class), |b, v| k.write_i(b, v))
    }

    /// A step buffer of `len` indices (a kernel's output: every one it is asked for written).
    pub(in crate::step) fn alloc_i(&self, len: usize) -> Result<DIdx<K>, K::Error> {
        pool::take(&self.i_pool, len, |class| self.k.zeros_i(class))
    }

    /// Buffers waiting in the ops' pools (those of finished steps).
    pub fn pooled(&self) -> usize {
        self.f_pool.free_count() + self.i_pool.free_count()
    }

    /// The index in `rotations` of the (sin, cos) table of `kind` at `positions`, uploaded if
    /// it is not there.
    pub(super) fn rotation(&self, kind: RopeKind, positions: &[usize]) -> Result<usize, K::Error> {
        let mut kept = self.rotations.borrow_mut();
        if let Some(i) = kept
            .iter()
            .position(|((k, p), _)| *k == kind && p == positions)
        {
            return Ok(i);
        }
        let rope = match kind {
            RopeKind::Main => &self.main,
            RopeKind::Compress => &self.compress,
        };
        let values = sin_cos_table(rope, positions);
        let k = &self.k;
        let mut plans = self.plans.borrow_mut();
        let (place, table) =
            plans
                .f
                .scratch(&values, |class| k.zeros(class), |b, v| k.write(b, 0, v))?;
        let table = plans.f.keep(place, table);
        if kept.len() == ROTATIONS_KEPT {
            kept.remove(0);
        }
        kept.push(((kind, positions.to_vec()), table));
        Ok(kept.len() - 1)
    }

    /// The kernels the ops launch.
    pub fn kernels(&self) -> &K {
        &self.k
    }

    pub(super) fn hc_dim(&self) -> (usize, usize) {
        (self.config.hc_mult, self.config.hidden_size)
    }

    pub(super) fn hyper_spec(&self) -> HyperSpec {
        HyperSpec {
            hc: self.config.hc_mult,
            dim: self.config.hidden_size,
            eps: self.config.hc_eps,
            iters: self.config.hc_sinkhorn_iters,
        }
    }

    /// `width` values from `src` at each of `from` to `dst` at each of `to` (negative: skipped),
    /// checked against both buffers first.
    pub(in crate::step) fn copy_rows(
        &self,
        src: &K::F,
        from: &[i64],
        dst: &mut K::F,
        to: &[i64],
        width: usize,
    ) -> Result<(), K::Error> {
        let w = width as i64;
        let fits = |o: i64, len: usize| o >= 0 && o + w <= len as i64;
        if from.len() != to.len()
            || from.iter().any(|&o| !fits(o, K::f_len(src)))
            || to.iter().any(|&o| o >= 0 && !fits(o, K::f_len(dst)))
        {
            return Err(format!(
                "copy_rows: {} rows of {width} outside their buffers",
                from.len()
            )
            .into());
        }
        if from.is_empty() || width == 0 {
            return Ok(());
        }
        let (d_from, d_to) = (self.plan_l(from)?, self.plan_l(to)?);
        self.k
            .copy_rows(src, &d_from, dst, &d_to, width, from.len())
    }
}
