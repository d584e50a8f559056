//! The larger ops of [`DeviceStepOps`]: closing compressor windows, the indexer's choice,
//! routing and the routed experts' pairs, each a few kernel launches over device buffers.

use super::{
    IndexAt, Norm, Proj, RopeKind, RowOp, StepOps, WindowClose,
    device_model::{DeviceCompressor, at_layer},
    device_ops::{DBuf, DIdx, DeviceStepOps, ExpertKernel},
    kernels::{Kernels, PoolSpec, RouteSpec, ScoreSpec},
    pool,
};

impl<K: Kernels> DeviceStepOps<K> {
    /// `StepOps::close_windows`: each window's slots gathered from the arena, the position bias
    /// added, `compress_pool` over them with the previous windows' overlap slices, then (with
    /// overlap) each window's Ca slices written over the previous ones.
    pub(super) fn closed_windows(
        &self,
        c: &DeviceCompressor<K>,
        arena: &mut K::F,
        closes: &[WindowClose],
    ) -> Result<DBuf<K>, K::Error> {
        let m = closes.len();
        let (ratio, d, width) = (c.ratio, c.d, c.width);
        let per = ratio * width;
        let mut out = self.alloc(m * d)?;
        if m == 0 {
            return Ok(out);
        }
        let mut kv = self.alloc(m * per)?;
        let mut gate = self.alloc(m * per)?;
        let to: Vec<i64> = (0..m).map(|i| (i * per) as i64).collect();
        let pending: Vec<i64> = closes.iter().map(|w| w.pending).collect();
        let pending_gate: Vec<i64> = pending.iter().map(|p| p + per as i64).collect();
        self.copy_rows(arena, &pending, &mut kv, &to, per)?;
        self.copy_rows(arena, &pending_gate, &mut gate, &to, per)?;
        if K::f_len(&c.ape) < per {
            return Err("close_windows: the position bias is short"
                .to_owned()
                .into());
        }
        self.k.add_periodic(&mut gate, &c.ape, per, m * per)?;
        let slices = ratio * d;
        let mut prev_kv = self.alloc(m * slices)?;
        let mut prev_gate = self.alloc(m * slices)?;
        let has_prev: Vec<i32> = closes.iter().map(|w| i32::from(w.has_prev)).collect();
        if c.overlap {
            let to: Vec<i64> = closes
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    if w.has_prev && w.prev_in_batch.is_none() {
                        (i * slices) as i64
                    } else {
                        -1
                    }
                })
                .collect();
            let from: Vec<i64> = closes.iter().map(|w| w.prev).collect();
            let from_gate: Vec<i64> = from.iter().map(|p| p + slices as i64).collect();
            self.copy_rows(arena, &from, &mut prev_kv, &to, slices)?;
            self.copy_rows(arena, &from_gate, &mut prev_gate, &to, slices)?;
            // A previous window closing in this batch: its Ca slices from its gathered slots (the
            // gate with its position bias, as the arena's would be).
            let (mut from, mut to) = (Vec::new(), Vec::new());
            for (i, w) in closes.iter().enumerate() {
                if let Some(j) = w.prev_in_batch.filter(|_| w.has_prev) {
                    for slot in 0..ratio {
                        from.push((j * per + slot * width) as i64);
                        to.push((i * slices + slot * d) as i64);
                    }
                }
            }
            if !from.is_empty() {
                self.copy_rows(&kv, &from, &mut prev_kv, &to, d)?;
                self.copy_rows(&gate, &from, &mut prev_gate, &to, d)?;
            }
        }
        let d_has = self.plan_i(&has_prev)?;
        let spec = PoolSpec {
            windows: m,
            ratio,
            d,
            width,
            overlap: c.overlap,
        };
        self.k
            .compress_pool(&kv, &gate, (&prev_kv, &prev_gate), &d_has, spec, &mut out)?;
        if c.overlap {
            // This window's Ca slices (the first d channels of each slot) replace the previous.
            let (mut from, mut to, mut to_gate) = (Vec::new(), Vec::new(), Vec::new());
            for (i, w) in closes.iter().enumerate().filter(|(_, w)| w.keeps_prev) {
                for slot in 0..ratio {
                    from.push((i * per + slot * width) as i64);
                    to.push(w.prev + (slot * d) as i64);
                    to_gate.push(w.prev + (slices + slot * d) as i64);
                }
            }
            self.copy_rows(&kv, &from, arena, &to, d)?;
            self.copy_rows(&gate, &from, arena, &to_gate, d)?;
        }
        Ok(out)
    }

    /// `StepOps::index_select`: the queries rotated to their positions (`norm_rope_rows`), the
    /// head weights scaled, `indexer_scores` over the arena's indexer rows, `indexer_topk`.
    pub(super) fn indexer_choice(
        &self,
        (q, weights): (&DBuf<K>, &DBuf<K>),
        arena: &K::F,
        at: &[IndexAt],
        k: usize,
    ) -> Result<DIdx<K>, K::Error> {
        let c = &self.config;
        let (heads, di, n) = (c.index_n_heads, c.index_head_dim, at.len());
        let mut out = self.alloc_i(n * k)?;
        if n == 0 {
            return Ok(out);
        }
        let mut rotated = self.copy(q, n * heads * di)?;
        let positions: Vec<usize> = at.iter().map(|a| a.pos).collect();
        let rope = RowOp {
            heads,
            head_dim: di,
            norm: Norm::None,
            rope: Some((RopeKind::Compress, &positions)),
            inverse: false,
        };
        self.norm_rope(&mut rotated, &rope, n)?;
        let mut w = self.copy(weights, n * heads)?;
        self.k
            .scale_values(&mut w, 1.0 / (heads as f32).sqrt(), n * heads)?;
        if at.iter().any(|a| {
            a.rows < 0
                || a.rows % di as i64 != 0
                || (a.rows as usize) + a.visible * di > K::f_len(arena)
        }) {
            return Err("index_select: indexer rows outside the arena or unaligned"
                .to_owned()
                .into());
        }
        let starts: Vec<i64> = at.iter().map(|a| a.rows / di as i64).collect();
        let visible: Vec<i32> = at
            .iter()
            .map(|a| i32::try_from(a.visible).map_err(|_| "index_select: visible rows".to_owned()))
            .collect::<Result<_, _>>()?;
        // Padded to its size class (keys past a token's visible ones are not scored or read), so
        // steps keep one launch shape as sequences grow.
        let max_keys = pool::size_class(at.iter().map(|a| a.visible).max().unwrap_or(0));
        let (d_starts, d_visible) = (self.plan_l(&starts)?, self.plan_i(&visible)?);
        let mut scores = self.alloc(n * max_keys)?;
        let spec = ScoreSpec {
            tokens: n,
            heads,
            dim: di,
            scale: 1.0 / (di as f32).sqrt(),
            max_keys,
            tensor_cores: self.fast_attention,
        };
        self.k.indexer_scores(
            &rotated,
            &w,
            arena,
            &d_starts,
            &d_visible,
            spec,
            &mut scores,
        )?;
        self.k
            .indexer_topk(&scores, &d_visible, (n, max_keys, k), &mut out)?;
        Ok(out)
    }

    /// `StepOps::route`: `moe_route` over the gate's logits.
    pub(super) fn routing(
        &self,
        layer: usize,
        logits: &K::F,
        tokens: &K::I,
        n: usize,
    ) -> Result<(DIdx<K>, DBuf<K>), K::Error> {
        let c = &self.config;
        let (experts, k) = (c.n_routed_experts, c.experts_per_token);
        let r = at_layer(&self.model.routing, layer)?;
        let mut chosen = self.alloc_i(n * k)?;
        let mut weights = self.alloc(n * k)?;
        if n == 0 {
            return Ok((chosen, weights));
        }
        if K::f_len(logits) < n * experts || K::i_len(tokens) < n || k == 0 || k > experts {
            return Err("route buffers".to_owned().into());
        }
        let mut scores = self.alloc(n * experts)?;
        let spec = RouteSpec {
            tokens: n,
            experts,
            k,
            table_rows: r.table_rows,
            scaling: c.routed_scaling_factor,
        };
        self.k.moe_route(
            logits,
            r.bias.as_ref(),
            r.hash.as_ref(),
            tokens,
            spec,
            &mut scores,
            (&mut chosen, &mut weights),
        )?;
        Ok((chosen, weights))
    }

    /// `StepOps::expert_pairs`: `exact_pairs` with pair p reading row p / per of `x`.
    pub(super) fn expert_pair_rows(
        &self,
        layer: usize,
        proj: Proj,
        x: &K::F,
        (experts, per, pairs): (&K::I, usize, usize),
    ) -> Result<DBuf<K>, K::Error> {
        let stacks = at_layer(&self.model.experts, layer)?;
        let stack = match proj {
            Proj::Gate => &stacks[0],
            Proj::Up => &stacks[1],
            Proj::Down => &stacks[2],
        };
        let (_, rows, cols) = K::stack_shape(stack);
        let mut y = self.alloc(pairs * rows)?;
        if pairs == 0 || rows == 0 {
            return Ok(y);
        }
        let per = per.max(1);
        let tokens = pairs.div_ceil(per);
        if pairs > 65_535 || K::i_len(experts) < pairs || K::f_len(x) < tokens * cols {
            return Err(
                format!("expert pairs: {pairs} pairs (at most 65535) over rows of {cols}").into(),
            );
        }
        let pair_token: Vec<i32> = (0..pairs).map(|p| (p / per) as i32).collect();
        let d_token = self.plan_i(&pair_token)?;
        let pairs_of = (&*d_token, experts);
        match self.experts {
            ExpertKernel::Exact => self.k.exact_pairs(stack, pairs_of, x, pairs, &mut y)?,
            ExpertKernel::GroupedGemv => self.k.fast_pairs(stack, pairs_of, x, pairs, &mut y)?,
            ExpertKernel::GroupedGemm => self.k.gemm_pairs(stack, pairs_of, x, pairs, &mut y)?,
        }
        Ok(y)
    }
}
