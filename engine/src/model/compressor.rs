//! KV compressors. Every `ratio` tokens close a window and emit one compressed row: the
//! per-channel softmax over the window's gate scores (plus a learned position bias) weights
//! the window's projected rows; the result is RMS-normed and rotated (compress RoPE) to the
//! window's first position. CSA (ratio 4) overlaps windows: each token projects two series,
//! Ca (feeds the next window's row) and Cb (feeds its own window's row), so an emitted row
//! pools 2*ratio slots. Tokens of an unfinished window, and the previous window's Ca slice,
//! are the state that must survive between forward calls (and cross from prefill to decode).

use crate::backend::{BackendError, LayerDevice, LinearId};
use crate::{
    paged::layout::RowFormat,
    rope::Rope,
    tensor::{rms_norm, softmax},
    weights::CompressorWeights,
};

/// A compressor's running state for one sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompressorState {
    /// Emitted rows, `head_dim` each, in window order.
    pub rows: Vec<f32>,
    /// Projected kv of the unfinished window's tokens (`width` each).
    pub pending_kv: Vec<f32>,
    /// Projected gate scores of the unfinished window's tokens (`width` each, without bias).
    pub pending_gate: Vec<f32>,
    /// CSA: the last closed window's Ca kv slice (`ratio * head_dim`), empty before the first.
    pub prev_kv: Vec<f32>,
    /// CSA: the last closed window's Ca gate slice with its position bias added.
    pub prev_gate: Vec<f32>,
}

/// The part of a compressor's state that lives in the per-request slot: the unfinished window
/// and the overlap slice. Captured at block boundaries inside a chunk so the prefix cache can
/// resume there.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PendingState {
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    pub prev_kv: Vec<f32>,
    pub prev_gate: Vec<f32>,
}

impl CompressorState {
    /// The slot part of the state now.
    pub fn pending(&self) -> PendingState {
        PendingState {
            pending_kv: self.pending_kv.clone(),
            pending_gate: self.pending_gate.clone(),
            prev_kv: self.prev_kv.clone(),
            prev_gate: self.prev_gate.clone(),
        }
    }

    /// Number of emitted rows.
    pub fn len(&self, head_dim: usize) -> usize {
        self.rows.len() / head_dim
    }

    pub fn row(&self, i: usize, head_dim: usize) -> &[f32] {
        &self.rows[i * head_dim..(i + 1) * head_dim]
    }
}

/// Each token's projected (kv, gate scores) for a compressor. Independent per token, so a
/// whole chunk is projected at once (each weight row read once per block of tokens) and then fed
/// to [`push_many`] in order.
///
/// `ids` name the two linears for a backend (`device`) that runs attention linears.
#[expect(clippy::type_complexity, reason = "a (kv, gate) pair per token")]
pub fn project_many(
    w: &CompressorWeights,
    xs: &[Vec<f32>],
    ids: (LinearId, LinearId),
    device: LayerDevice<'_>,
) -> Result<Vec<(Vec<f32>, Vec<f32>)>, BackendError> {
    let kv = device.linear(ids.0, &w.wkv, xs)?;
    let gate = device.linear(ids.1, &w.wgate, xs)?;
    Ok(kv.into_iter().zip(gate).collect())
}

/// A window closed by a chunk: its slots and, for CSA, the previous window's Ca slice.
struct Closed {
    /// The row's index (windows closed before it).
    window: usize,
    kv: Vec<f32>,
    /// With the position bias added.
    gate: Vec<f32>,
    /// CSA: the previous window's (Ca kv, Ca gate), empty before the first window.
    prev: (Vec<f32>, Vec<f32>),
}

/// Feeds a chunk's projections, token by token in order; a window that closes emits a row,
/// rounded to `stored` (how the rows are stored) as it is computed. `after(t, rows, state)` sees the state after
/// token `t` as one push at a time leaves it, except that the rows of the windows closed so
/// far are counted (`rows`) but not yet in `state.rows`: they are computed at the end, in
/// parallel (each depends only on its own window's slots and the previous window's), and
/// appended in window order.
pub fn push_many(
    w: &CompressorWeights,
    state: &mut CompressorState,
    projected: Vec<(Vec<f32>, Vec<f32>)>,
    eps: f32,
    (rope, stored): (&Rope, RowFormat),
    mut after: impl FnMut(usize, usize, &CompressorState),
) {
    use rayon::prelude::*;
    let width = w.wkv.rows;
    let mut rows = state.len(w.head_dim);
    let mut closed = Vec::new();
    for (t, (kv, gate)) in projected.into_iter().enumerate() {
        state.pending_kv.extend(kv);
        state.pending_gate.extend(gate);
        if state.pending_kv.len() / width >= w.ratio {
            let kv = std::mem::take(&mut state.pending_kv);
            let mut gate = std::mem::take(&mut state.pending_gate);
            for (slot, g) in gate.chunks_exact_mut(width).enumerate() {
                for (gi, bias) in g.iter_mut().zip(w.ape.row(slot)) {
                    *gi += bias;
                }
            }
            let prev = if w.overlap {
                let ca = |v: &[f32]| -> Vec<f32> {
                    v.chunks_exact(width)
                        .flat_map(|t| t[..w.head_dim].iter().copied())
                        .collect()
                };
                let next = (ca(&kv), ca(&gate));
                (
                    std::mem::replace(&mut state.prev_kv, next.0),
                    std::mem::replace(&mut state.prev_gate, next.1),
                )
            } else {
                (Vec::new(), Vec::new())
            };
            closed.push(Closed {
                window: rows,
                kv,
                gate,
                prev,
            });
            rows += 1;
        }
        after(t, rows, state);
    }
    let emitted: Vec<Vec<f32>> = closed
        .par_iter()
        .map(|c| {
            let mut row = pool_window(w, &c.prev, &c.kv, &c.gate);
            rms_norm(&mut row, &w.norm, eps);
            rope.apply(&mut row, c.window * w.ratio, false);
            crate::paged::codec::round(stored, &mut row);
            row
        })
        .collect();
    for row in emitted {
        state.rows.extend_from_slice(&row);
    }
}

/// A closed window's row before its norm and rotation: the per-channel softmax over the gate
/// scores (`gate`, position bias added) weighting the slots' projected `kv` (`ratio` slots of
/// `width` each); with overlap (CSA) the previous window's Ca slices `prev` (kv, gate; empty
/// before the first window) come first.
pub fn pool_window(
    w: &CompressorWeights,
    prev: &(Vec<f32>, Vec<f32>),
    kv: &[f32],
    gate: &[f32],
) -> Vec<f32> {
    if w.overlap {
        overlapped(w, prev, kv, gate)
    } else {
        pooled(w.head_dim, w.ratio, kv, gate, 0, w.wkv.rows)
    }
}

/// Pools `ratio` slots of channel offset `offset` (non-overlapping windows).
fn pooled(
    d: usize,
    ratio: usize,
    kv: &[f32],
    gate: &[f32],
    offset: usize,
    width: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; d];
    let mut scores = vec![0.0f32; ratio];
    for (c, o) in out.iter_mut().enumerate() {
        for (s, score) in scores.iter_mut().enumerate() {
            *score = gate[s * width + offset + c];
        }
        softmax(&mut scores);
        for (s, p) in scores.iter().enumerate() {
            *o += kv[s * width + offset + c] * p;
        }
    }
    out
}

/// CSA: slots 0..ratio are the previous window's Ca (`prev`, weight 0 before the first
/// window), slots ratio..2*ratio this window's Cb.
fn overlapped(
    w: &CompressorWeights,
    prev: &(Vec<f32>, Vec<f32>),
    kv: &[f32],
    gate: &[f32],
) -> Vec<f32> {
    let (d, r, width) = (w.head_dim, w.ratio, 2 * w.head_dim);
    let (prev_kv, prev_gate) = prev;
    let has_prev = !prev_kv.is_empty();
    let mut out = vec![0.0f32; d];
    let mut scores = vec![0.0f32; 2 * r];
    for (c, o) in out.iter_mut().enumerate() {
        for s in 0..r {
            scores[s] = if has_prev {
                prev_gate[s * d + c]
            } else {
                f32::NEG_INFINITY
            };
            scores[r + s] = gate[s * width + d + c];
        }
        softmax(&mut scores);
        // Slot order as in the reference sum: previous Ca slots, then this window's Cb.
        if has_prev {
            for (s, p) in scores[..r].iter().enumerate() {
                *o += prev_kv[s * d + c] * p;
            }
        }
        for (s, p) in scores[r..].iter().enumerate() {
            *o += kv[s * width + d + c] * p;
        }
    }
    out
}
