//! The decode step with its state on the device: one forward pass of a batch of sequences (one
//! token each, or a prompt chunk of consecutive tokens of a sequence, [`layout::StateLayout::chunked`]),
//! written once over [`StepOps`], the device operations it needs. Between calls
//! the sequences' attention state (sliding-window rows, compressed rows, the compressors'
//! unfinished windows) stays in per-layer arenas of the ops' own buffers
//! ([`layout::StateLayout`]); within a step nothing crosses to the host but the inputs (token
//! ids, and the plan the host derives from positions: row offsets, rotations) and the logits.
//!
//! The same composition runs over three sets of ops:
//! - [`cpu_ops::CpuStepOps`]: each op the engine's own code on host buffers;
//! - [`device_ops::DeviceStepOps`] over [`kernels::Kernels`]: each op as the device launches it
//!   (plans, offsets, gathers, kernels), written once for every device: over
//!   [`emulated::EmulatedKernels`] (each kernel by its CPU reference) and, with the `cuda`
//!   feature, over `cuda::CudaKernels` (`cuda::CudaStepOps`, the GPU decode step).
//!
//! The tests here check, on any machine, that the composition over both CPU sets gives
//! `engine::model::Model::forward`'s logits and state bit for bit; on a GPU each kernel is
//! checked against its reference, and the whole step against the engine.

pub mod chunk_runs;
pub mod cpu_ops;
pub mod decode;
pub mod decoder;
mod device_close;
mod device_group;
pub mod device_model;
pub mod device_ops;
pub mod emulated;
pub mod group_runs;
pub mod kernels;
pub mod key_plan;
pub mod layout;
pub mod pool;
pub mod replay;
pub mod staged;
#[cfg(test)]
mod tests;

use std::ops::Range;

use engine::{backend::LinearId, config::ModelConfig};

pub use crate::compose::{Proj, ShapeError};

/// A sublayer with its own hyper-connection mixing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sub {
    Attn,
    Ffn,
}

/// One of a layer's compressors: the attention's, or the indexer's (CSA layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Comp {
    Attn,
    Index,
}

/// A linear of the model, as the ops find its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lin {
    /// An attention linear of a layer (projections, compressors, indexer).
    Attn(usize, LinearId),
    /// The hyper-connection mixing projection of a layer's sublayer.
    Mix(usize, Sub),
    /// The MoE gate of a layer.
    Gate(usize),
    /// A projection of a layer's shared expert.
    Shared(usize, Proj),
    /// The output head.
    Head,
}

/// A weight vector of the model (norms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vector {
    AttnNorm(usize),
    FfnNorm(usize),
    QNorm(usize),
    KvNorm(usize),
    CompressorNorm(usize, Comp),
    FinalNorm,
}

/// The model's two RoPE tables (`engine::rope::Rope::tables`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeKind {
    /// Sliding-only layers.
    Main,
    /// Compressed layers, their compressors and the indexer.
    Compress,
}

/// The norm [`StepOps::norm_rope`] applies to each head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    None,
    Unweighted,
    Weighted(Vector),
}

/// One [`StepOps::norm_rope`]: rows of `heads` heads of `head_dim`; per head the norm, then
/// (if `rope`) the rotation of the trailing rope dims to the row's position.
#[derive(Debug, Clone, Copy)]
pub struct RowOp<'a> {
    pub heads: usize,
    pub head_dim: usize,
    pub norm: Norm,
    /// The table and each row's position.
    pub rope: Option<(RopeKind, &'a [usize])>,
    pub inverse: bool,
}

/// Where a linear reads its vectors (`cols` values of each row of `stride` from `start`) or
/// writes its outputs (the same for `rows` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub stride: usize,
    pub start: usize,
}

impl View {
    /// Whole rows of `width`.
    pub fn rows(width: usize) -> Self {
        Self {
            stride: width,
            start: 0,
        }
    }
}

/// A compressor window a step closes: its slots in the arena and where the overlap slices are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowClose {
    /// Offset of the window's projected kv slots (`ratio * width`), the gate scores right after.
    pub pending: i64,
    /// Offset of the previous window's Ca slices (kv `ratio * d`, the gate right after): read
    /// when `has_prev`, then replaced by this window's (overlapping compressors).
    pub prev: i64,
    pub has_prev: bool,
    /// Where the previous window closes in this same batch (a prompt chunk closing several
    /// windows of a sequence): its index there. Its Ca slices are then this window's previous
    /// ones, not the arena's (which it has not written yet); the ops that close windows in
    /// order may ignore it.
    pub prev_in_batch: Option<usize>,
    /// Whether this window's Ca slices replace the arena's: not where a later window of the
    /// same sequence closes in the same batch (its slices are the ones to keep).
    pub keeps_prev: bool,
}

/// A token's query to the indexer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexAt {
    pub pos: usize,
    /// Offset of the sequence's first compressed indexer row.
    pub rows: i64,
    /// Rows the token sees.
    pub visible: usize,
}

/// The compressed rows a token attends to after its window rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compressed {
    None,
    /// Rows `0..count` from offset `rows`.
    All {
        rows: i64,
        count: usize,
    },
    /// The indexer's choice (the token's row of the chosen indices) from offset `rows`: `count`
    /// rows (the top-k or the rows the token sees, the fewer), ascending.
    Chosen {
        rows: i64,
        count: usize,
    },
}

/// A token's keys: window rows oldest first, then compressed rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenKeys {
    pub window: Vec<i64>,
    pub compressed: Compressed,
}

/// [`StepOps::hyper_pre`]'s outputs for every token.
#[derive(Debug, Clone, PartialEq)]
pub struct Mixed<B> {
    /// The collapsed sublayer input, `[n, D]`.
    pub input: B,
    /// `[n, hc]`.
    pub post: B,
    /// `[n, hc * hc]`.
    pub comb: B,
}

/// An indexer entry for a slot past the token's choice.
pub const CHOSEN_EMPTY: i32 = -1;
/// Every indexer entry of a token whose scores hold a NaN (no choice is defined; its attention
/// output is NaN).
pub const CHOSEN_POISONED: i32 = -2;

/// A key offset of a poisoned choice: below -1, which the fast attention kernel reads as an
/// empty slot; both attention kernels make the token NaN for it.
pub const POISONED_KEY: i64 = -2;

/// The device operations of the decode step. Buffers are f32 (`Buf`) or i32 (`Idx`); offsets
/// into a layer's arena are in f32 elements. A buffer made by [`Self::alloc`] is NaN, so an
/// operation that writes nothing cannot pass for a result. Host slices an op takes are the
/// step's plan (offsets, positions), never activations.
pub trait StepOps {
    type Error: From<String> + std::fmt::Display;
    type Buf;
    type Idx;

    /// A step starts (what the ops keep for one step only, they drop here).
    fn begin_step(&self) {}
    /// The first `n` K=V rows (`head_dim` each) of `rows` rounded to the form the model stores
    /// them in (`engine::model::Model::kv_rows`; nothing to do for f32), as the engine rounds
    /// each row as it computes it.
    fn round_kv_rows(&self, rows: &mut Self::Buf, n: usize) -> Result<(), Self::Error>;
    /// K=V rows `rows` (`head_dim` values each, one per offset) into `arena` at `offsets` (f32
    /// elements) in their stored form: the values, or the FP8 row's bytes
    /// (`layout::pack_kv_row`). [`Self::attend`] reads them back in that form.
    fn store_kv_rows(
        &self,
        rows: &Self::Buf,
        arena: &mut Self::Buf,
        offsets: &[i64],
    ) -> Result<(), Self::Error>;
    /// A buffer of `len` NaNs.
    fn alloc(&self, len: usize) -> Result<Self::Buf, Self::Error>;
    /// A buffer of `len` NaNs that outlives steps (a layer's arena).
    fn alloc_state(&self, len: usize) -> Result<Self::Buf, Self::Error> {
        self.alloc(len)
    }
    /// Host values into `buf` at `offset` (loading state; not used within a step).
    fn put_at(&self, buf: &mut Self::Buf, offset: usize, values: &[f32])
    -> Result<(), Self::Error>;
    /// Indices to the device (the step's token ids).
    fn put_idx(&self, values: &[i32]) -> Result<Self::Idx, Self::Error>;
    /// `range` of `buf` to the host (the logits; or state, outside a step).
    fn get(&self, buf: &Self::Buf, range: Range<usize>) -> Result<Vec<f32>, Self::Error>;
    /// Several ranges (each of its buffer) to the host at once (a state's pieces read back
    /// after a step: one crossing on a device).
    fn get_many(&self, parts: &[(&Self::Buf, Range<usize>)]) -> Result<Vec<Vec<f32>>, Self::Error> {
        parts.iter().map(|(b, r)| self.get(b, r.clone())).collect()
    }
    /// For each of `rows` rows of `width` values, the index of its largest finite value (ties
    /// to the lowest) and of its first value that is not finite (-1 for none): `[rows, 2]`.
    fn argmax_rows(
        &self,
        x: &Self::Buf,
        rows: usize,
        width: usize,
    ) -> Result<Self::Idx, Self::Error>;
    /// `range` of an index buffer to the host (the step's argmaxes).
    fn get_idx(&self, b: &Self::Idx, range: Range<usize>) -> Result<Vec<i32>, Self::Error>;
    /// A copy of the first `len` values.
    fn copy(&self, buf: &Self::Buf, len: usize) -> Result<Self::Buf, Self::Error>;

    /// Each token's embedding row, repeated over the hyper-connection streams: `[n, hc * D]`.
    fn embed(&self, tokens: &Self::Idx, n: usize) -> Result<Self::Buf, Self::Error>;
    /// Rows `rows` of `w` times `n` vectors read through `x_view` (`w.cols` values each),
    /// written through `y_view`.
    #[expect(
        clippy::too_many_arguments,
        reason = "a weight, its rows, two views and a count"
    )]
    fn linear(
        &self,
        w: Lin,
        rows: Range<usize>,
        x: &Self::Buf,
        x_view: View,
        y: &mut Self::Buf,
        y_view: View,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// Per head the norm, then the rotation (see [`RowOp`]), of `n` rows in place.
    fn norm_rope(&self, x: &mut Self::Buf, op: &RowOp<'_>, n: usize) -> Result<(), Self::Error>;
    /// `hyper::pre_from_mixes` of every token.
    fn hyper_pre(
        &self,
        layer: usize,
        sub: Sub,
        x: &Self::Buf,
        mixes: &Self::Buf,
        n: usize,
    ) -> Result<Mixed<Self::Buf>, Self::Error>;
    /// `hyper::post` of every token: the new streams.
    fn hyper_post(
        &self,
        x: &Self::Buf,
        y: &Self::Buf,
        post: &Self::Buf,
        comb: &Self::Buf,
        n: usize,
    ) -> Result<Self::Buf, Self::Error>;
    /// `hyper::head` of every token: `[n, D]`.
    fn hyper_head(&self, x: &Self::Buf, n: usize) -> Result<Self::Buf, Self::Error>;
    /// Row `i` of `src` (`width` values) to `arena[offsets[i]..]`; a negative offset skips it.
    fn write_rows(
        &self,
        src: &Self::Buf,
        width: usize,
        arena: &mut Self::Buf,
        offsets: &[i64],
    ) -> Result<(), Self::Error>;
    /// The rows of the windows `closes` close, before their norm and rotation
    /// (`compressor::pool_window`, position bias added), `[closes, d]`; overlapping
    /// compressors' Ca slices replaced by each window's.
    fn close_windows(
        &self,
        layer: usize,
        comp: Comp,
        arena: &mut Self::Buf,
        closes: &[WindowClose],
    ) -> Result<Self::Buf, Self::Error>;
    /// The indexer's choice of every token (`attention::index_choice`) from its query `q`
    /// (`[n, heads * index_dim]`, before RoPE) and head weights (`[n, heads]`): `[n, k]`,
    /// ascending, [`CHOSEN_EMPTY`] past the choice, all [`CHOSEN_POISONED`] where undefined.
    fn index_select(
        &self,
        q: &Self::Buf,
        weights: &Self::Buf,
        arena: &Self::Buf,
        at: &[IndexAt],
        k: usize,
    ) -> Result<Self::Idx, Self::Error>;
    /// `attention::attend` of every token over its keys with layer `layer`'s sinks:
    /// `[n, heads * head_dim]`; NaN for a token whose choice is poisoned.
    fn attend(
        &self,
        layer: usize,
        q: &Self::Buf,
        arena: &Self::Buf,
        keys: &[TokenKeys],
        chosen: Option<(&Self::Idx, usize)>,
    ) -> Result<Self::Buf, Self::Error>;
    /// `moe::route_logits` of every token: experts `[n, k]` in slot order and their weights.
    fn route(
        &self,
        layer: usize,
        logits: &Self::Buf,
        tokens: &Self::Idx,
        n: usize,
    ) -> Result<(Self::Idx, Self::Buf), Self::Error>;
    /// Projection `proj` of each pair's routed expert (`experts[p]`) times row `p / per` of
    /// `x`: `[pairs, rows]`.
    fn expert_pairs(
        &self,
        layer: usize,
        proj: Proj,
        x: &Self::Buf,
        experts: &Self::Idx,
        per: usize,
        pairs: usize,
    ) -> Result<Self::Buf, Self::Error>;
    /// `moe::swiglu` of `rows` rows of `width`.
    fn swiglu(
        &self,
        gate: &Self::Buf,
        up: &Self::Buf,
        rows: usize,
        width: usize,
    ) -> Result<Self::Buf, Self::Error>;
    /// The routed experts of each of `pairs` pairs (`moe::expert_many`: gate and up
    /// projections, SwiGLU over `inter` values, down projection), pair `p` taking row `p / k`
    /// of `h` to expert `experts[p]`: `[pairs, D]`. Here on the ops' own experts; a rank of an
    /// expert-parallel group exchanges the pairs with its group.
    fn routed_experts(
        &self,
        layer: usize,
        h: &Self::Buf,
        experts: &Self::Idx,
        (k, inter): (usize, usize),
        pairs: usize,
    ) -> Result<Self::Buf, Self::Error> {
        routed_here(self, layer, h, experts, (k, inter), pairs)
    }
    /// The query heads and output groups this rank computes: all of them, but on a rank of a
    /// tensor-parallel group its share (`engine::parallel::tensor`).
    fn head_share(&self, c: &ModelConfig) -> (Range<usize>, Range<usize>) {
        (0..c.num_heads, 0..c.o_groups)
    }
    /// Every rank's output groups (`lows`: `[n, width]`, this rank's) joined per token in rank
    /// order, the rows `wo_b` takes: `lows` itself on one rank.
    fn gather_lows(
        &self,
        lows: Self::Buf,
        _n: usize,
        _width: usize,
    ) -> Result<Self::Buf, Self::Error> {
        Ok(lows)
    }
    /// Every token's MoE output: its `k` slot outputs `ys` (`[n * k, D]`) times their weights,
    /// summed in slot order, plus the shared expert's output.
    fn combine(
        &self,
        ys: &Self::Buf,
        weights: &Self::Buf,
        shared: &Self::Buf,
        n: usize,
        k: usize,
    ) -> Result<Self::Buf, Self::Error>;
}

/// [`StepOps::routed_experts`] on `ops`' own experts.
pub(crate) fn routed_here<O: StepOps + ?Sized>(
    ops: &O,
    layer: usize,
    h: &O::Buf,
    experts: &O::Idx,
    (k, inter): (usize, usize),
    pairs: usize,
) -> Result<O::Buf, O::Error> {
    let gate = ops.expert_pairs(layer, Proj::Gate, h, experts, k, pairs)?;
    let up = ops.expert_pairs(layer, Proj::Up, h, experts, k, pairs)?;
    let act = ops.swiglu(&gate, &up, pairs, inter)?;
    ops.expert_pairs(layer, Proj::Down, &act, experts, 1, pairs)
}
