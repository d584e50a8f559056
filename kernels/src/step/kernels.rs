//! The kernels the device decode step launches ([`super::device_ops::DeviceStepOps`]), one
//! method per kernel with the kernel's own parameters, so the step's composition (its plans,
//! offsets, gathers and launch order) is written once and runs on the GPU
//! (`cuda::CudaKernels`) and on the kernels' CPU references ([`super::emulated`]), the latter
//! in CI. Buffers: f32 (`F`), i32 (`I`), i64 (`L`); offsets into a pool are in f32 elements
//! unless said otherwise.

use engine::{
    paged::layout::RowFormat,
    parallel::collective::Collective,
    tensor::Weight,
    weights::{ExpertWeights, MoeWeights},
};

use super::Proj;

/// Work items beyond one per token the fast attention's plan may make (`Fp8AttnShape::parts`):
/// fixed, so the device and the kernels' emulation cut the same splits.
pub const FAST_ATTENTION_PARTS: usize = 64;

/// `attn_fast`'s kernel shape for `heads` heads of FP8 rows of `nope + rope` values: the
/// device's and the emulation's alike.
pub fn fast_attention_shape(
    heads: usize,
    (nope, rope): (usize, usize),
    scale: f32,
) -> crate::attn_fp8::Fp8AttnShape {
    crate::attn_fp8::Fp8AttnShape {
        heads,
        nope,
        rope,
        scale,
        parts: FAST_ATTENTION_PARTS,
    }
}

/// `norm_rope_rows`' shape: rows of `heads` heads of `head_dim`, per head the norm (`0` none,
/// `1` unweighted, `2` weighted by the device vector), then the rotation of the trailing `rope`
/// dims by each row's (sin, cos) pairs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSpec {
    pub heads: usize,
    pub head_dim: usize,
    pub rope: usize,
    pub norm: i32,
    pub eps: f32,
    pub inverse: bool,
}

/// The hyper-connections' constants of a launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HyperSpec {
    pub hc: usize,
    pub dim: usize,
    pub eps: f32,
    pub iters: usize,
}

/// `compress_pool`'s shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpec {
    pub windows: usize,
    pub ratio: usize,
    pub d: usize,
    pub width: usize,
    pub overlap: bool,
}

/// `indexer_scores`' shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreSpec {
    pub tokens: usize,
    pub heads: usize,
    pub dim: usize,
    pub scale: f32,
    pub max_keys: usize,
    /// `indexer_scores_mma` (bf16 operands on tensor cores, within
    /// [`crate::indexer_mma::bound`]) instead of `indexer_scores` (the engine's bits).
    pub tensor_cores: bool,
}

/// `moe_route`'s shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteSpec {
    pub tokens: usize,
    pub experts: usize,
    pub k: usize,
    pub table_rows: usize,
    pub scaling: f32,
}

/// `ep_slots`' split: `ranks` ranks holding `per_rank` routed experts each, rows of `width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotSpec {
    pub ranks: usize,
    pub per_rank: usize,
    pub width: usize,
    pub pairs: usize,
}

/// The device memory and kernels of the decode step.
pub trait Kernels {
    type Error: From<String> + std::fmt::Display;
    type F;
    type I;
    type L;
    /// A linear's weight on the device (`exact_gemv`'s operand).
    type Rows;
    /// One projection of every routed expert of a layer (`exact_pairs`' operand).
    type Stack;
    /// The embedding table.
    type Table;
    /// A layer's routing table (`tid2eid`).
    type Hash;
    /// A recorded step the device replays (a CUDA graph); none where it records none.
    type Graph;

    fn f_len(b: &Self::F) -> usize;
    fn i_len(b: &Self::I) -> usize;
    /// Where a buffer's values start on the device (what a recorded launch names).
    fn f_addr(b: &Self::F) -> usize;
    fn i_addr(b: &Self::I) -> usize;
    fn l_addr(b: &Self::L) -> usize;
    fn zeros(&self, len: usize) -> Result<Self::F, Self::Error>;
    fn zeros_i(&self, len: usize) -> Result<Self::I, Self::Error>;
    fn zeros_l(&self, len: usize) -> Result<Self::L, Self::Error>;
    fn upload(&self, v: &[f32]) -> Result<Self::F, Self::Error>;
    fn upload_i(&self, v: &[i32]) -> Result<Self::I, Self::Error>;
    fn upload_l(&self, v: &[i64]) -> Result<Self::L, Self::Error>;
    /// Host values into `dst` at `at`.
    fn write(&self, dst: &mut Self::F, at: usize, v: &[f32]) -> Result<(), Self::Error>;
    /// Host indices into the start of `dst` (a kept plan buffer at least that long).
    fn write_i(&self, dst: &mut Self::I, v: &[i32]) -> Result<(), Self::Error>;
    /// Host offsets into the start of `dst` (a kept plan buffer at least that long).
    fn write_l(&self, dst: &mut Self::L, v: &[i64]) -> Result<(), Self::Error>;
    fn read(&self, b: &Self::F, range: std::ops::Range<usize>) -> Result<Vec<f32>, Self::Error>;
    /// Several ranges (each of its buffer) to the host as one read: a state read back after a
    /// step (its pieces are many and small; a device gathers them and crosses once).
    fn read_many(
        &self,
        parts: &[(&Self::F, std::ops::Range<usize>)],
    ) -> Result<Vec<Vec<f32>>, Self::Error> {
        parts.iter().map(|(b, r)| self.read(b, r.clone())).collect()
    }
    /// `range` of an index buffer to the host (the step's argmaxes).
    fn read_i(&self, b: &Self::I, range: std::ops::Range<usize>) -> Result<Vec<i32>, Self::Error>;
    /// A whole index buffer to the host (tests and debugging; a step reads none).
    fn read_l(&self, b: &Self::L) -> Result<Vec<i64>, Self::Error>;
    /// `src[0..len]` into `dst[0..len]`.
    fn copy(&self, src: &Self::F, dst: &mut Self::F, len: usize) -> Result<(), Self::Error>;

    fn upload_rows(&self, w: &Weight) -> Result<Self::Rows, Self::Error>;
    /// An f32 matrix `[rows, cols]` (the hyper-connections' mixing projections).
    fn upload_matrix(
        &self,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Self::Rows, Self::Error>;
    /// (rows, cols).
    fn rows_shape(w: &Self::Rows) -> (usize, usize);
    fn upload_stack(
        &self,
        experts: &[ExpertWeights],
        proj: Proj,
    ) -> Result<Self::Stack, Self::Error>;
    /// (experts, rows, cols).
    fn stack_shape(s: &Self::Stack) -> (usize, usize, usize);
    fn upload_table(&self, embed: &Weight) -> Result<Self::Table, Self::Error>;
    fn upload_hash(&self, moe: &MoeWeights) -> Result<Option<Self::Hash>, Self::Error>;

    /// Every value NaN.
    fn fill_nan(&self, x: &mut Self::F) -> Result<(), Self::Error>;
    /// `embed_rows`: row `tokens[t]` of the table into each of the `hc` streams of `out`.
    fn embed_rows(
        &self,
        table: &Self::Table,
        tokens: &Self::I,
        n_hc: (usize, usize),
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `copy_rows`: `n` rows of `width` from `src + from[i]` to `dst + to[i]` (skipped where
    /// negative).
    fn copy_rows(
        &self,
        src: &Self::F,
        from: &Self::L,
        dst: &mut Self::F,
        to: &Self::L,
        width: usize,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `exact_gemv`: rows `row0..row0 + rows` of `w` times `n` vectors of `x`, `[n, rows]`.
    fn exact_gemv(
        &self,
        w: &Self::Rows,
        rows: (usize, usize),
        x: &Self::F,
        n: usize,
        y: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `norm_rope_rows` over `rows` rows of `x`.
    fn norm_rope_rows(
        &self,
        x: &mut Self::F,
        spec: RowSpec,
        w: &Self::F,
        sin_cos: &Self::F,
        rows: usize,
    ) -> Result<(), Self::Error>;
    /// `hyper_pre`: (collapsed, post, comb) of `n` tokens into `out`.
    fn hyper_pre(
        &self,
        x: &Self::F,
        mixes: &Self::F,
        scale_base: (&Self::F, &Self::F),
        spec: HyperSpec,
        n: usize,
        out: (&mut Self::F, &mut Self::F, &mut Self::F),
    ) -> Result<(), Self::Error>;
    /// `hyper_post`.
    #[expect(clippy::too_many_arguments, reason = "the kernel's parameters")]
    fn hyper_post(
        &self,
        x: &Self::F,
        y: &Self::F,
        post: &Self::F,
        comb: &Self::F,
        spec: HyperSpec,
        n: usize,
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `hyper_head` from the head's mixing projections `mix` (`[n, hc]`).
    fn hyper_head(
        &self,
        x: &Self::F,
        mix: &Self::F,
        scale_base: (f32, &Self::F),
        spec: HyperSpec,
        n: usize,
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `add_periodic`: `x[i] += bias[i % period]` for `n` values.
    fn add_periodic(
        &self,
        x: &mut Self::F,
        bias: &Self::F,
        period: usize,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `sum_blocks`: `out[i] = x[i] + x[part + i] + .. + x[(blocks - 1) part + i]` for
    /// `i < part`, added in block order (`blocks` at least 1).
    fn sum_blocks(
        &self,
        x: &Self::F,
        shape: (usize, usize),
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `scale_values`: `x[i] *= by` for `n` values.
    fn scale_values(&self, x: &mut Self::F, by: f32, n: usize) -> Result<(), Self::Error>;
    /// `fp8_kv_encode` into the f32 arena `arena` (its bytes): row `i` of `rows` (`nope + rope`
    /// values) as the engine's FP8 K=V row at byte offset `offsets[i]` (negative: skipped).
    fn fp8_kv_store(
        &self,
        rows: &Self::F,
        shape: (usize, usize),
        arena: &mut Self::F,
        offsets: &Self::L,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `fp8_kv_round`: the first `n` rows of `nope + rope` values of `rows` rounded to the
    /// engine's FP8 K=V format, in place.
    fn fp8_kv_round(
        &self,
        rows: &mut Self::F,
        shape: (usize, usize),
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `compress_pool`.
    fn compress_pool(
        &self,
        kv: &Self::F,
        gate: &Self::F,
        prev: (&Self::F, &Self::F),
        has_prev: &Self::I,
        spec: PoolSpec,
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `indexer_scores` over f32 rows of `keys` (row index `starts[t] + s`).
    #[expect(clippy::too_many_arguments, reason = "the kernel's parameters")]
    fn indexer_scores(
        &self,
        q: &Self::F,
        w: &Self::F,
        keys: &Self::F,
        starts: &Self::L,
        visible: &Self::I,
        spec: ScoreSpec,
        scores: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `indexer_topk`: `[tokens, k]` ascending, -1 past the choice, -2 everywhere on a NaN.
    fn indexer_topk(
        &self,
        scores: &Self::F,
        visible: &Self::I,
        shape: (usize, usize, usize),
        out: &mut Self::I,
    ) -> Result<(), Self::Error>;
    /// `chosen_offsets`: for entry e, token `tokens[e]`'s `counts[e]` chosen rows as byte
    /// offsets from `bases[e]` into `offsets[starts[e]..]`, -1 when poisoned.
    fn chosen_offsets(
        &self,
        chosen: &Self::I,
        k: usize,
        entries_of: (&Self::I, &Self::L, &Self::I, &Self::L),
        row_bytes: usize,
        entries: usize,
        offsets: &mut Self::L,
    ) -> Result<(), Self::Error>;
    /// `attn_exact` over the f32 pool (byte offsets; a negative one makes the token NaN), its
    /// rows stored as the format says (f32, or `attn_exact_fp8` over FP8 K=V rows).
    #[expect(clippy::too_many_arguments, reason = "the kernel's parameters")]
    fn attn_exact(
        &self,
        q: &Self::F,
        pool: (&Self::F, RowFormat),
        keys: (&Self::L, &Self::L),
        sinks: &Self::F,
        shape: (usize, usize, usize, usize),
        scale: f32,
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `attn_decode_fp8` (plan, partials, combine) over the FP8 K=V rows of `pool` (its bytes;
    /// rows of `nope + rope` values): every head of a token against each tile of its rows on
    /// tensor cores. Byte offsets, CSR by token; -1 is an empty slot, below -1 makes the token
    /// NaN. Within `2^-8 · max |row value|` of [`Self::attn_exact`] (the query and the tile
    /// weights rounded to bf16), `[tokens, heads, nope + rope]`.
    #[expect(clippy::too_many_arguments, reason = "the kernel's parameters")]
    fn attn_fast(
        &self,
        q: &Self::F,
        pool: (&Self::F, (usize, usize)),
        keys: (&Self::L, &Self::L),
        sinks: &Self::F,
        shape: (usize, usize),
        scale: f32,
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `moe_route`.
    #[expect(clippy::too_many_arguments, reason = "the kernel's parameters")]
    fn moe_route(
        &self,
        logits: &Self::F,
        bias: Option<&Self::F>,
        hash: Option<&Self::Hash>,
        tokens: &Self::I,
        spec: RouteSpec,
        scores: &mut Self::F,
        out: (&mut Self::I, &mut Self::F),
    ) -> Result<(), Self::Error>;
    /// `exact_pairs`: pair p's expert `experts[p]` times row `tokens[p]` of `x`.
    fn exact_pairs(
        &self,
        stack: &Self::Stack,
        pairs_of: (&Self::I, &Self::I),
        x: &Self::F,
        pairs: usize,
        y: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `nvfp4_grouped_gemv` / `mxfp4_grouped_gemv`: [`Self::exact_pairs`] by the fast grouped
    /// GEMV, within its bound of `cpu::grouped_gemv` (f64 sums over the exactly decoded
    /// weights) rather than the engine's bits; an expert outside the stack gives a NaN row.
    fn fast_pairs(
        &self,
        stack: &Self::Stack,
        pairs_of: (&Self::I, &Self::I),
        x: &Self::F,
        pairs: usize,
        y: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `moe_align` + `nvfp4_grouped_gemm_bf16` / `mxfp4_grouped_gemm_bf16`:
    /// [`Self::exact_pairs`] by the grouped GEMM (the pairs grouped by expert on the device,
    /// each expert's weight read once per 64 of its pairs, the activations rounded to bf16),
    /// within its bound of the f64 reference over the bf16 activations (`cpu::nvfp4_gemm`,
    /// `cpu::mxfp4_gemm`) rather than the engine's bits; an expert outside the stack gives a
    /// NaN row (the GEMM leaves its pairs out of a NaN-filled output).
    fn gemm_pairs(
        &self,
        stack: &Self::Stack,
        pairs_of: (&Self::I, &Self::I),
        x: &Self::F,
        pairs: usize,
        y: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// Whether [`Self::fast_linear`] takes `w` (bf16 and FP8-block weights; f32 and FP4 ones
    /// stay with [`Self::exact_gemv`]).
    fn fast_linear_takes(w: &Self::Rows) -> bool;
    /// The scratch values [`Self::fast_linear`] needs for `n` vectors through `rows` rows of
    /// `cols` (its split plan's partials; 0 when it does not split).
    fn fast_linear_scratch(&self, n: usize, rows: usize, cols: usize) -> usize;
    /// `dense_gemm`: [`Self::exact_gemv`] on bf16 tensor cores, each weight byte read once
    /// per 64 vectors, within `dense_gemm::bound` of `dense_gemm::reference` (f64 over the
    /// bf16 operands) rather than the engine's bits.
    fn fast_linear(
        &self,
        w: &Self::Rows,
        rows: (usize, usize),
        x: &Self::F,
        n: usize,
        scratch: &mut Self::F,
        y: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `swiglu_clamp` over `n` values.
    fn swiglu(
        &self,
        gate: &Self::F,
        up: &Self::F,
        n: usize,
        limit: f32,
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;
    /// `argmax_rows`: for each of `rows` rows of `width` values of `x`, `out[2r]` the index of
    /// its largest finite value (ties to the lowest index; 0 when none is finite) and
    /// `out[2r + 1]` the index of its first value that is not finite, or -1.
    fn argmax_rows(
        &self,
        x: &Self::F,
        shape: (usize, usize),
        out: &mut Self::I,
    ) -> Result<(), Self::Error>;
    /// `moe_combine`.
    fn moe_combine(
        &self,
        inputs: (&Self::F, &Self::F, &Self::F),
        shape: (usize, usize, usize),
        out: &mut Self::F,
    ) -> Result<(), Self::Error>;

    /// `ep_slots`: packs a rank's expert-parallel dispatch messages into `send`, with the
    /// offsets that move the rows. Pair `p`'s expert `experts[p]` is valid below
    /// `ranks * per_rank` and goes to rank `d = e / per_rank`; `counts[d]` = `c_d`, the valid
    /// pairs to `d`, and `counts[ranks]` the invalid ones. Message `d` starts at
    /// `S_d = sum over d' < d of (1 + c_d' (1 + width))`: `send[S_d] = c_d`, then the global
    /// expert id of each of its pairs (in pair order), then their rows (not written here:
    /// `pack_to[p] = S_d + 1 + c_d + j width` for the `j`-th pair to `d`, where `copy_rows`
    /// puts its token's row). The outputs come back by destination in the same order:
    /// `back_from[p] = (c_0 + .. + c_{d-1} + j) width`. An invalid pair gets -1 in both.
    /// The messages are `engine::parallel::expert::dispatch_messages`', value for value.
    fn ep_slots(
        &self,
        experts: &Self::I,
        spec: SlotSpec,
        send: &mut Self::F,
        offsets: (&mut Self::L, &mut Self::L),
        counts: &mut Self::I,
    ) -> Result<(), Self::Error>;
    /// `held_ids`: a rank's ids of the routed pairs' experts among those it holds, where every
    /// rank of its group has every pair (tensor-parallel attention): with `held = (first,
    /// count)`, `ids[p]` = `experts[p] - first` for an expert this rank holds, -1 for another
    /// rank's expert (below `total`), -2 for none of the model's. The expert kernels answer
    /// both with a NaN row; [`Self::clear_unheld_rows`] clears only the -1 rows, so a pair of
    /// no expert stays NaN on every rank and fails the step.
    fn held_ids(
        &self,
        experts: &Self::I,
        held: (usize, usize),
        total: usize,
        pairs: usize,
        ids: &mut Self::I,
    ) -> Result<(), Self::Error>;
    /// `clear_unheld_rows`: each row `p < pairs` of `width` values of `ys` whose `ids[p]` is -1
    /// (another rank's expert) set to -0.0, the identity of the sum [`Self::all_owned`] merges
    /// the ranks' rows by.
    fn clear_unheld_rows(
        &self,
        ys: &mut Self::F,
        ids: &Self::I,
        width: usize,
        pairs: usize,
    ) -> Result<(), Self::Error>;
    /// `ep_take_ids`: with `held = (first, count)`, `ids[i]` = `recv[at[i]] - first` where
    /// that is a whole number below `count` (an expert this rank holds, as its index among
    /// them), else -1 (which the expert kernels answer with a NaN row).
    fn ep_take_ids(
        &self,
        recv: &Self::F,
        at: &Self::L,
        held: (usize, usize),
        m: usize,
        ids: &mut Self::I,
    ) -> Result<(), Self::Error>;
    /// All-to-all over `coll`: the first `sizes[r]` values after those of the ranks before
    /// `r` go to rank `r` (this rank's own included); returns what every rank sent to this
    /// one, by source rank back to back, where this rank knows how many values each sends it
    /// (`from[r]`: nothing is gathered first; a rank that sends otherwise is an error).
    /// Through the host by default; a device that can exchange its buffers directly (NCCL)
    /// does.
    fn exchange_known(
        &self,
        coll: &mut dyn Collective,
        send: &Self::F,
        (sizes, from): (&[usize], &[usize]),
    ) -> Result<Self::F, Self::Error> {
        let (recv, got) = exchange_through_host(self, coll, send, sizes)?;
        check_received(&got, from)?;
        Ok(recv)
    }
    /// All-gather over `coll`: the first `part` values of `send` to every rank (its own
    /// included), every rank's into `out`'s first `ranks * part` in rank order. Through the
    /// host by default; a device that can gathers its buffers directly (one NCCL all-gather).
    fn all_gather(
        &self,
        coll: &mut dyn Collective,
        send: &Self::F,
        part: usize,
        out: &mut Self::F,
    ) -> Result<(), Self::Error> {
        all_gather_through_host(self, coll, send, part, out)
    }
    /// All-reduce over `coll` of values each held by one rank: the first `len` values of
    /// `send`, summed over the ranks into `out`, where at each place every rank's value but at
    /// most one is -0.0 (NaN aside). -0 is the sum's identity, so every order of the sum gives
    /// that rank's value, bit for bit (NCCL's all-reduce adds in an order of its own). Through
    /// the host by default ([`merge_owned`]: checked, a place two ranks hold refused);
    /// a device that can reduces its buffers directly (one NCCL all-reduce).
    fn all_owned(
        &self,
        coll: &mut dyn Collective,
        send: &Self::F,
        len: usize,
        out: &mut Self::F,
    ) -> Result<(), Self::Error> {
        all_owned_through_host(self, coll, send, len, out)
    }
    /// Every rank's first `n` values of `counts` (small whole numbers), by rank: read back
    /// and all-gathered through the host by default; a device that can gathers them on the
    /// device and reads back the gathered ones once.
    fn gather_counts(
        &self,
        coll: &mut dyn Collective,
        counts: &Self::I,
        n: usize,
    ) -> Result<Vec<Vec<i32>>, Self::Error> {
        gather_counts_through_host(self, coll, counts, n)
    }

    /// Whether a graph of this device's holds a group's collectives ([`Self::all_gather`],
    /// [`Self::all_owned`]), and why not: a device that records nothing runs them in its
    /// launch pass, as every launch.
    fn graphs_hold_collectives(&self) -> Result<(), String> {
        Ok(())
    }
    /// Starts recording this device's launches instead of running them; false where it
    /// records none (then the launches run).
    fn begin_capture(&self) -> Result<bool, Self::Error> {
        Ok(false)
    }
    /// The launches recorded since [`Self::begin_capture`] returned true.
    fn end_capture(&self) -> Result<Option<Self::Graph>, Self::Error> {
        Ok(None)
    }
    /// Runs a recording's launches again, over the buffers they named.
    fn launch_graph(&self, graph: &Self::Graph) -> Result<(), Self::Error>;
}

/// [`Kernels::exchange_known`] through the host: the values read back, exchanged by `coll` as
/// host rows, the received ones uploaded; with how many values each rank sent.
pub fn exchange_through_host<K: Kernels + ?Sized>(
    k: &K,
    coll: &mut dyn Collective,
    send: &K::F,
    sizes: &[usize],
) -> Result<(K::F, Vec<usize>), K::Error> {
    let total: usize = sizes.iter().sum();
    let values = if total == 0 {
        Vec::new()
    } else {
        k.read(send, 0..total)?
    };
    let mut at = 0;
    let sends = sizes
        .iter()
        .map(|&n| {
            at += n;
            values[at - n..at].to_vec()
        })
        .collect();
    let received = coll.exchange(sends).map_err(|e| format!("exchange: {e}"))?;
    let sizes = received.iter().map(Vec::len).collect();
    let flat = received.concat();
    // A buffer is never empty (an upload of nothing has no device address).
    let recv = k.upload(if flat.is_empty() { &[0.0] } else { &flat })?;
    Ok((recv, sizes))
}

/// [`Kernels::all_gather`] through the host.
pub fn all_gather_through_host<K: Kernels + ?Sized>(
    k: &K,
    coll: &mut dyn Collective,
    send: &K::F,
    part: usize,
    out: &mut K::F,
) -> Result<(), K::Error> {
    if K::f_len(out) < coll.size() * part {
        return Err(format!("all-gather: {part} values of {} ranks outside", coll.size()).into());
    }
    let mine = if part == 0 {
        Vec::new()
    } else {
        k.read(send, 0..part)?
    };
    let all = coll
        .all_gather(mine)
        .map_err(|e| format!("all-gather: {e}"))?;
    let got: Vec<usize> = all.iter().map(Vec::len).collect();
    check_received(&got, &vec![part; all.len()])?;
    if part > 0 {
        k.write(out, 0, &all.concat())?;
    }
    Ok(())
}

/// [`Kernels::all_owned`] through the host: the values read back, all-gathered by `coll` as
/// host rows, merged ([`merge_owned`]) and written into `out`.
pub fn all_owned_through_host<K: Kernels + ?Sized>(
    k: &K,
    coll: &mut dyn Collective,
    send: &K::F,
    len: usize,
    out: &mut K::F,
) -> Result<(), K::Error> {
    let mine = if len == 0 {
        Vec::new()
    } else {
        k.read(send, 0..len)?
    };
    let all = coll
        .all_gather(mine)
        .map_err(|e| format!("all-reduce: {e}"))?;
    let merged = merge_owned(&all, len)?;
    if len > 0 {
        k.write(out, 0, &merged)?;
    }
    Ok(())
}

/// The ranks' values (`all`, `len` each) each held by one rank ([`Kernels::all_owned`]), summed
/// in rank order; refused where two ranks hold a value at one place (neither is -0.0 nor NaN:
/// the sum would then depend on its order) or a rank sent another count.
pub fn merge_owned(all: &[Vec<f32>], len: usize) -> Result<Vec<f32>, String> {
    let got: Vec<usize> = all.iter().map(Vec::len).collect();
    check_received(&got, &vec![len; all.len()])?;
    let held = |v: f32| v.to_bits() != (-0.0f32).to_bits() && !v.is_nan();
    let mut out = vec![-0.0f32; len];
    let mut owner: Vec<Option<usize>> = vec![None; len];
    for (r, values) in all.iter().enumerate() {
        for (i, &v) in values.iter().enumerate() {
            if held(v) {
                if let Some(first) = owner[i] {
                    return Err(format!(
                        "all-reduce: ranks {first} and {r} both hold value {i} (each value is \
                         one rank's, -0 on the others)"
                    ));
                }
                owner[i] = Some(r);
            }
            out[i] += v;
        }
    }
    Ok(out)
}

/// That what each rank sent (`got`) is what this rank expected (`from`).
pub fn check_received(got: &[usize], from: &[usize]) -> Result<(), String> {
    if got == from {
        Ok(())
    } else {
        Err(format!(
            "the ranks sent {got:?} values where {from:?} were due"
        ))
    }
}

/// [`Kernels::gather_counts`] through the host.
pub fn gather_counts_through_host<K: Kernels + ?Sized>(
    k: &K,
    coll: &mut dyn Collective,
    counts: &K::I,
    n: usize,
) -> Result<Vec<Vec<i32>>, K::Error> {
    // Counts are far below 2^24: exact as f32.
    let mine: Vec<f32> = k.read_i(counts, 0..n)?.iter().map(|&c| c as f32).collect();
    let all = coll
        .all_gather(mine)
        .map_err(|e| format!("gather counts: {e}"))?;
    if all.iter().any(|row| row.len() != n) {
        return Err(format!("gather counts: rows of {n} expected").into());
    }
    Ok(all
        .iter()
        .map(|row| row.iter().map(|&c| c as i32).collect())
        .collect())
}
