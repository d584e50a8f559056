//! The larger ops of [`super::CudaStepOps`]: closing compressor windows, the indexer's choice,
//! routing and the routed experts' pairs, each a few kernels over device buffers.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{
    CudaStepOps, KernelError, grid_dim, non_empty,
    step_model::{DeviceCompressor, at_layer},
};
use crate::step::{IndexAt, Norm, Proj, RopeKind, RowOp, StepOps, WindowClose};

fn shape(message: impl Into<String>) -> KernelError {
    KernelError::Shape(message.into())
}

fn groups(n: usize, per: u32, what: &str) -> Result<LaunchConfig, KernelError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(n.div_ceil(per as usize), what)?, 1, 1),
        block_dim: (per, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `StepOps::close_windows`: each window's slots gathered from the arena, the position bias
/// added, `compress_pool` over them with the previous windows' overlap slices, then (with
/// overlap) each window's Ca slices written over the previous ones.
pub(super) fn close_windows(
    ops: &CudaStepOps<'_>,
    c: &DeviceCompressor,
    arena: &mut CudaSlice<f32>,
    closes: &[WindowClose],
) -> Result<CudaSlice<f32>, KernelError> {
    let m = closes.len();
    let (ratio, d, width) = (c.ratio, c.d, c.width);
    let per = ratio * width;
    let out_len = m * d;
    let mut out = ops.alloc(out_len)?;
    if m == 0 {
        return Ok(out);
    }
    let mut kv = ops.alloc(m * per)?;
    let mut gate = ops.alloc(m * per)?;
    let at = |i: usize| (i * per) as i64;
    let to: Vec<i64> = (0..m).map(at).collect();
    let pending: Vec<i64> = closes.iter().map(|w| w.pending).collect();
    let pending_gate: Vec<i64> = pending.iter().map(|p| p + per as i64).collect();
    ops.copy_rows(arena, &pending, &mut kv, &to, per)?;
    ops.copy_rows(arena, &pending_gate, &mut gate, &to, per)?;
    let gpu = ops.gpu();
    let s = &gpu.stream;
    {
        let f = gpu.step.load_function("add_periodic")?;
        let (period, n) = (per as i64, (m * per) as i64);
        let mut launch = s.launch_builder(&f);
        launch.arg(&mut gate).arg(&c.ape).arg(&period).arg(&n);
        // SAFETY: `add_periodic(float*, const float*, long long, long long)`; `gate` holds
        // `m * per` values, the bias `per` (`[ratio, width]`).
        unsafe { launch.launch(groups(m * per, 256, "values")?)? };
    }
    let slices = ratio * d;
    let mut prev_kv = ops.alloc(m * slices)?;
    let mut prev_gate = ops.alloc(m * slices)?;
    let has_prev: Vec<i32> = closes.iter().map(|w| i32::from(w.has_prev)).collect();
    if c.overlap {
        let to: Vec<i64> = closes
            .iter()
            .enumerate()
            .map(|(i, w)| if w.has_prev { (i * slices) as i64 } else { -1 })
            .collect();
        let from: Vec<i64> = closes.iter().map(|w| w.prev).collect();
        let from_gate: Vec<i64> = from.iter().map(|p| p + slices as i64).collect();
        ops.copy_rows(arena, &from, &mut prev_kv, &to, slices)?;
        ops.copy_rows(arena, &from_gate, &mut prev_gate, &to, slices)?;
    }
    let d_has = s.clone_htod(&has_prev)?;
    let (windows_i, ratio_i, d_i) = (m as i32, ratio as i32, d as i32);
    let (width_i, overlap_i) = (width as i64, i32::from(c.overlap));
    let f = gpu.compress.load_function("compress_pool")?;
    let mut launch = s.launch_builder(&f);
    launch
        .arg(&kv)
        .arg(&gate)
        .arg(&prev_kv)
        .arg(&prev_gate)
        .arg(&d_has)
        .arg(&windows_i)
        .arg(&ratio_i)
        .arg(&d_i)
        .arg(&width_i)
        .arg(&overlap_i)
        .arg(&mut out);
    // SAFETY: `compress_pool`'s parameters in order; every buffer holds `m` windows.
    unsafe { launch.launch(groups(out_len, 128, "channels")?)? };
    if c.overlap {
        // This window's Ca slices (the first d channels of each slot) replace the previous.
        let (mut from, mut to, mut from_gate, mut to_gate) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, w) in closes.iter().enumerate() {
            for slot in 0..ratio {
                let src = (i * per + slot * width) as i64;
                from.push(src);
                from_gate.push(src);
                to.push(w.prev + (slot * d) as i64);
                to_gate.push(w.prev + (slices + slot * d) as i64);
            }
        }
        ops.copy_rows(&kv, &from, arena, &to, d)?;
        ops.copy_rows(&gate, &from_gate, arena, &to_gate, d)?;
    }
    Ok(out)
}

/// `StepOps::index_select`: the queries rotated to their positions (`norm_rope_rows`), the
/// head weights scaled, `indexer_scores` over the arena's indexer rows, `indexer_topk`.
pub(super) fn index_select(
    ops: &CudaStepOps<'_>,
    (q, weights): (&CudaSlice<f32>, &CudaSlice<f32>),
    arena: &CudaSlice<f32>,
    at: &[IndexAt],
    k: usize,
) -> Result<CudaSlice<i32>, KernelError> {
    let c = ops.config();
    let (heads, di, n) = (c.index_n_heads, c.index_head_dim, at.len());
    let mut out = ops.alloc_idx(n * k)?;
    if n == 0 {
        return Ok(out);
    }
    let mut rotated = ops.copy(q, n * heads * di)?;
    let positions: Vec<usize> = at.iter().map(|a| a.pos).collect();
    let rope = RowOp {
        heads,
        head_dim: di,
        norm: Norm::None,
        rope: Some((RopeKind::Compress, &positions)),
        inverse: false,
    };
    ops.norm_rope(&mut rotated, &rope, n)?;
    let mut w = ops.copy(weights, n * heads)?;
    ops.scale_values(&mut w, 1.0 / (heads as f32).sqrt(), n * heads)?;
    let starts: Vec<i64> = at.iter().map(|a| a.rows / di as i64).collect();
    if at.iter().any(|a| {
        a.rows < 0 || a.rows % di as i64 != 0 || (a.rows as usize) + a.visible * di > arena.len()
    }) {
        return Err(shape(
            "index_select: indexer rows outside the arena or unaligned",
        ));
    }
    let visible: Vec<i32> = at
        .iter()
        .map(|a| i32::try_from(a.visible).map_err(|_| shape("index_select: visible rows")))
        .collect::<Result<_, _>>()?;
    let max_keys = at.iter().map(|a| a.visible).max().unwrap_or(0).max(1);
    let gpu = ops.gpu();
    let s = &gpu.stream;
    let (d_starts, d_visible) = (s.clone_htod(&starts)?, s.clone_htod(&visible)?);
    let mut scores = ops.alloc(n * max_keys)?;
    let (n_i, heads_i, dim_i, k_i) = (n as i32, heads as i32, di as i32, k as i32);
    let max_keys_i = max_keys as i64;
    let scale = 1.0 / (di as f32).sqrt();
    let f = gpu.indexer.load_function("indexer_scores")?;
    let mut launch = s.launch_builder(&f);
    launch
        .arg(&rotated)
        .arg(&w)
        .arg(arena)
        .arg(&d_starts)
        .arg(&d_visible)
        .arg(&n_i)
        .arg(&heads_i)
        .arg(&dim_i)
        .arg(&scale)
        .arg(&max_keys_i)
        .arg(&mut scores);
    // SAFETY: `indexer_scores`'s parameters in order; each token's rows inside the arena
    // (checked above); a group of eight threads per (token, key).
    unsafe { launch.launch(groups(n * max_keys * 8, 256, "keys")?)? };
    let f = gpu.indexer.load_function("indexer_topk")?;
    let mut launch = s.launch_builder(&f);
    launch
        .arg(&scores)
        .arg(&d_visible)
        .arg(&max_keys_i)
        .arg(&k_i)
        .arg(&mut out);
    // SAFETY: `indexer_topk`'s parameters in order; one block per token, `k` slots each.
    unsafe {
        launch.launch(LaunchConfig {
            grid_dim: (grid_dim(n, "tokens")?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })?;
    }
    Ok(out)
}

/// `StepOps::route`: `moe_route` over the gate's logits.
pub(super) fn route(
    ops: &CudaStepOps<'_>,
    layer: usize,
    logits: &CudaSlice<f32>,
    tokens: &CudaSlice<i32>,
    n: usize,
) -> Result<(CudaSlice<i32>, CudaSlice<f32>), KernelError> {
    let c = ops.config();
    let (experts, k) = (c.n_routed_experts, c.experts_per_token);
    let r = at_layer(&ops.model().routing, layer)?;
    let mut chosen = ops.alloc_idx(n * k)?;
    let mut weights = ops.alloc(n * k)?;
    if n == 0 {
        return Ok((chosen, weights));
    }
    if logits.len() < n * experts || tokens.len() < n || k == 0 || k > experts {
        return Err(shape("route buffers"));
    }
    let gpu = ops.gpu();
    let s = &gpu.stream;
    let mut scores = ops.alloc(n * experts)?;
    let (n_i, experts_i, k_i) = (n as i32, experts as i32, k as i32);
    let table_rows = r.table_rows as i64;
    let null: u64 = 0;
    let f = gpu.exact.load_function("moe_route")?;
    let mut launch = s.launch_builder(&f);
    launch.arg(logits).arg(&n_i).arg(&experts_i).arg(&k_i);
    match &r.bias {
        Some(b) => launch.arg(b),
        None => launch.arg(&null),
    };
    match &r.table {
        Some(t) => launch.arg(t),
        None => launch.arg(&null),
    };
    launch
        .arg(&table_rows)
        .arg(tokens)
        .arg(&c.routed_scaling_factor)
        .arg(&mut scores)
        .arg(&mut chosen)
        .arg(&mut weights);
    // SAFETY: `moe_route`'s parameters in order (a null pointer where the layer has no bias or
    // table); every buffer holds `n` tokens' rows.
    unsafe { launch.launch(groups(n, 128, "tokens")?)? };
    Ok((chosen, weights))
}

/// `StepOps::expert_pairs`: `exact_pairs` with pair p reading row p / per of `x`.
pub(super) fn expert_pairs(
    ops: &CudaStepOps<'_>,
    layer: usize,
    proj: Proj,
    x: &CudaSlice<f32>,
    (experts, per, pairs): (&CudaSlice<i32>, usize, usize),
) -> Result<CudaSlice<f32>, KernelError> {
    let stacks = at_layer(&ops.model().experts, layer)?;
    let st = match proj {
        Proj::Gate => &stacks[0],
        Proj::Up => &stacks[1],
        Proj::Down => &stacks[2],
    };
    let mut y = ops.alloc(pairs * st.rows)?;
    if pairs == 0 || st.rows == 0 {
        return Ok(y);
    }
    let per = per.max(1);
    let tokens = pairs.div_ceil(per);
    if pairs > 65_535 || experts.len() < pairs || x.len() < tokens * st.cols {
        return Err(shape(format!(
            "expert pairs: {pairs} pairs (at most 65535) over rows of {}",
            st.cols
        )));
    }
    let gpu = ops.gpu();
    let s = &gpu.stream;
    let pair_token: Vec<i32> = (0..pairs).map(|p| (p / per) as i32).collect();
    let d_token = s.clone_htod(&non_empty(&pair_token))?;
    let (experts_i, rows_i, cols_i) = (st.experts as i32, st.rows as i64, st.cols as i64);
    let f = gpu.exact.load_function(st.kernel)?;
    let mut launch = s.launch_builder(&f);
    launch
        .arg(&st.packed)
        .arg(&st.scales)
        .arg(&st.scale_2)
        .arg(&experts_i)
        .arg(&rows_i)
        .arg(&cols_i)
        .arg(&d_token)
        .arg(experts)
        .arg(x)
        .arg(&mut y);
    // SAFETY: `exact_pairs_*`'s parameters in order; the stack holds `experts` experts of
    // [rows, cols] (uploaded whole), pair tokens below `tokens`; an expert outside the stack
    // gives a NaN row.
    unsafe {
        launch.launch(LaunchConfig {
            grid_dim: (grid_dim(st.rows.div_ceil(32), "rows")?, pairs as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })?;
    }
    Ok(y)
}
