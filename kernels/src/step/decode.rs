//! The decode step over [`StepOps`]: the engine's forward pass (`engine::model`) for one token
//! of each sequence, in the same operations and order, with the attention state in the arenas
//! of a [`StateLayout`].

use engine::{
    backend::LinearId,
    config::{Attention, ModelConfig},
    scheduler::DecodeOut,
};

use super::{
    Comp, Compressed, IndexAt, Lin, Mixed, Norm, Proj, RopeKind, RowOp, StepOps, Sub, TokenKeys,
    Vector, View, layout::StateLayout,
};

/// A sequence in a slot of the arenas: its slot and its length (the next token's position).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    pub slot: usize,
    pub len: usize,
}

/// The batch size a step of `n` sequences is padded to where steps are replayed as graphs:
/// 1, 2, 4, 8, then multiples of 8 (a graph for each, not for each size).
pub fn batch_bucket(n: usize) -> usize {
    if n <= 8 {
        n.max(1).next_power_of_two()
    } else {
        n.next_multiple_of(8)
    }
}

/// A step that cannot run: its inputs (in words), or an op that failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError<E: std::fmt::Display> {
    #[error("{0}")]
    Input(String),
    #[error("device: {0}")]
    Device(E),
}

impl<E: std::fmt::Display> From<E> for StepError<E> {
    fn from(e: E) -> Self {
        Self::Device(e)
    }
}

/// One step: token `tokens[i]` of the sequence in `seats[i]`, at position `seats[i].len`. A
/// sequence may take up to `layout.chunk` consecutive tokens (a prompt chunk: seats of one
/// slot at consecutive positions, in order). Returns each token's logits and advances each
/// seat's length; on an error the sequences' state must be discarded.
pub fn decode_step<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    layout: &StateLayout,
    arenas: &mut [O::Buf],
    seats: &mut [Seat],
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>, StepError<O::Error>> {
    let Some(out) = decode_launch(ops, c, layout, arenas, seats, tokens)? else {
        return Ok(Vec::new());
    };
    read_logits(ops, c, &out, seats)
}

/// What a step leaves on the device: its logits `[n, vocab]` and each row's argmax and first
/// non-finite index (`StepOps::argmax_rows`, `[n, 2]`).
#[derive(Debug)]
pub struct StepOutputs<B, I> {
    pub logits: B,
    pub argmax: I,
}

/// The outputs of a step launched over `O`.
pub type Launched<O> = StepOutputs<<O as StepOps>::Buf, <O as StepOps>::Idx>;

/// The step's logits from the device; each sequence advances a token.
pub fn read_logits<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    out: &StepOutputs<O::Buf, O::Idx>,
    seats: &mut [Seat],
) -> Result<Vec<Vec<f32>>, StepError<O::Error>> {
    let (n, v) = (seats.len(), c.vocab_size);
    let flat = ops.get(&out.logits, 0..n * v)?;
    for seat in seats.iter_mut() {
        seat.len += 1;
    }
    Ok(flat.chunks_exact(v).map(<[f32]>::to_vec).collect())
}

/// Each sequence's output from the device: its argmax where `argmax[i]` (read for all of them
/// at once: two indices a sequence), else its logits row; each sequence advances a token.
pub fn read_outputs<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    out: &StepOutputs<O::Buf, O::Idx>,
    seats: &mut [Seat],
    argmax: &[bool],
) -> Result<Vec<DecodeOut>, StepError<O::Error>> {
    let (n, v) = (seats.len(), c.vocab_size);
    if argmax.len() != n {
        return Err(StepError::Input(format!(
            "{} argmax choices for {n} sequences",
            argmax.len()
        )));
    }
    let picks = if argmax.iter().any(|&a| a) {
        ops.get_idx(&out.argmax, 0..2 * n)?
    } else {
        Vec::new()
    };
    let mut outs = Vec::with_capacity(n);
    for (r, &wanted) in argmax.iter().enumerate() {
        outs.push(if wanted {
            match picks.get(2 * r..2 * r + 2) {
                // A negative or out-of-range index is refused where it enters the engine.
                Some(&[token, -1]) => DecodeOut::Argmax(token as u32),
                Some(&[_, at]) => DecodeOut::NonFinite(at as usize),
                _ => {
                    return Err(StepError::Input(format!(
                        "{} argmax indices for {n} sequences",
                        picks.len()
                    )));
                }
            }
        } else {
            DecodeOut::Logits(ops.get(&out.logits, r * v..(r + 1) * v)?)
        });
    }
    for seat in seats.iter_mut() {
        seat.len += 1;
    }
    Ok(outs)
}

/// [`decode_step`] up to its logits on the device: every plan written and every launch
/// made, nothing read back and no sequence advanced; `None` for no tokens.
pub fn decode_launch<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    layout: &StateLayout,
    arenas: &mut [O::Buf],
    seats: &[Seat],
    tokens: &[u32],
) -> Result<Option<Launched<O>>, StepError<O::Error>> {
    check(c, layout, seats, tokens).map_err(StepError::Input)?;
    let n = tokens.len();
    if n == 0 {
        return Ok(None);
    }
    let x = forward(ops, c, layout, arenas, seats, tokens)?;
    head(ops, c, &x, n, None).map(Some)
}

/// The layers of a step (checked by the caller): the streams `[n, hc_mult * D]` after the
/// last layer, the tokens' rows written into the arenas.
fn forward<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    layout: &StateLayout,
    arenas: &mut [O::Buf],
    seats: &[Seat],
    tokens: &[u32],
) -> Result<O::Buf, O::Error> {
    let n = tokens.len();
    ops.begin_step();
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let ids = ops.put_idx(&ids)?;
    let mut x = ops.embed(&ids, n)?;
    for (l, arena) in arenas.iter_mut().enumerate() {
        let m = mix_in(ops, c, l, Sub::Attn, &x, n)?;
        let a = attention(ops, c, layout, l, arena, seats, &m.input)?;
        x = ops.hyper_post(&x, &a, &m.post, &m.comb, n)?;
        let m = mix_in(ops, c, l, Sub::Ffn, &x, n)?;
        let y = moe(ops, c, l, &m.input, &ids, n)?;
        x = ops.hyper_post(&x, &y, &m.post, &m.comb, n)?;
    }
    Ok(x)
}

/// The head over the streams `x` of `n` tokens (`hyper_head`, the final norm, the output
/// head, each row's argmax): every row's logits, or only those of the token rows `wanted`
/// (ascending), gathered first.
fn head<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    x: &O::Buf,
    n: usize,
    wanted: Option<&[usize]>,
) -> Result<Launched<O>, StepError<O::Error>> {
    let (d, v) = (c.hidden_size, c.vocab_size);
    let picked;
    let (x, n) = match wanted {
        None => (x, n),
        Some(rows) => {
            if rows.windows(2).any(|w| w[0] >= w[1]) || rows.iter().any(|&r| r >= n) {
                return Err(StepError::Input(format!(
                    "logits of rows {rows:?} of {n}: ascending, each a token of the step"
                )));
            }
            let width = c.hc_mult * d;
            let mut to = vec![-1i64; n];
            for (i, &r) in rows.iter().enumerate() {
                to[r] = (i * width) as i64;
            }
            let mut rows_of_x = ops.alloc(rows.len().max(1) * width)?;
            ops.write_rows(x, width, &mut rows_of_x, &to)?;
            picked = rows_of_x;
            (&picked, rows.len())
        }
    };
    let mut h = ops.hyper_head(x, n)?;
    ops.norm_rope(&mut h, &normed(d, Vector::FinalNorm), n)?;
    let mut logits = ops.alloc(n * v)?;
    ops.linear(
        Lin::Head,
        0..v,
        &h,
        View::rows(d),
        &mut logits,
        View::rows(v),
        n,
    )?;
    let argmax = ops.argmax_rows(&logits, n, v)?;
    Ok(StepOutputs { logits, argmax })
}

/// A step of prompt chunks (and decode tokens) that needs the logits of some tokens only:
/// [`decode_step`]'s tokens and seats, the output head over the token rows `wanted`
/// (ascending; a chunk's last, say) alone. Returns their logits, in `wanted`'s order, and
/// advances each seat's length.
pub fn prompt_step<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    layout: &StateLayout,
    arenas: &mut [O::Buf],
    seats: &mut [Seat],
    (tokens, wanted): (&[u32], &[usize]),
) -> Result<Vec<Vec<f32>>, StepError<O::Error>> {
    check(c, layout, seats, tokens).map_err(StepError::Input)?;
    let n = tokens.len();
    let logits = if n == 0 {
        Vec::new()
    } else {
        let x = forward(ops, c, layout, arenas, seats, tokens)?;
        if wanted.is_empty() {
            // A chunk inside a prompt: its rows are all it leaves.
            for seat in seats.iter_mut() {
                seat.len += 1;
            }
            return Ok(Vec::new());
        }
        let out = head(ops, c, &x, n, Some(wanted))?;
        let v = c.vocab_size;
        let flat = ops.get(&out.logits, 0..wanted.len() * v)?;
        flat.chunks_exact(v).map(<[f32]>::to_vec).collect()
    };
    for seat in seats.iter_mut() {
        seat.len += 1;
    }
    Ok(logits)
}

/// The reference of [`decode_step`]: the engine's forward for token `tokens[i]` of the
/// sequence in `states[i]`, each sequence's logits (what the device step is checked against).
pub fn engine_decode(
    model: &engine::model::Model,
    states: &mut [engine::model::SequenceState],
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>, engine::model::ForwardError> {
    use engine::model::{Logits, Step};
    let mut batch: Vec<Step<'_>> = states
        .iter_mut()
        .zip(tokens)
        .map(|(state, t)| Step {
            state,
            tokens: std::slice::from_ref(t),
            logits: Logits::Last,
        })
        .collect();
    Ok(model
        .forward_batch(&mut batch)?
        .into_iter()
        .map(|mut logits| logits.pop().unwrap_or_default())
        .collect())
}

fn check(
    c: &ModelConfig,
    layout: &StateLayout,
    seats: &[Seat],
    tokens: &[u32],
) -> Result<(), String> {
    if seats.len() != tokens.len() || layout.layers.len() != c.layers.len() {
        return Err(format!(
            "{} tokens for {} sequences",
            tokens.len(),
            seats.len()
        ));
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(format!(
            "token id {t} is outside the vocabulary (size {})",
            c.vocab_size
        ));
    }
    // Padding seats may share the shared slot: nothing of theirs is read. Otherwise a slot's
    // tokens (at most `layout.chunk`: a prompt chunk) are at consecutive positions, in order.
    let mut last: std::collections::HashMap<usize, (usize, usize)> =
        std::collections::HashMap::new();
    for s in seats.iter().filter(|s| Some(s.slot) != layout.shared) {
        match last.get(&s.slot) {
            Some(&(len, count)) if len + 1 == s.len && count < layout.chunk => {
                last.insert(s.slot, (s.len, count + 1));
            }
            Some(&(len, count)) => {
                return Err(format!(
                    "slot {}: a token at {} after one at {len} (a step takes at most {} \
                     consecutive tokens of a sequence, in order; {count} so far)",
                    s.slot, s.len, layout.chunk
                ));
            }
            None => {
                last.insert(s.slot, (s.len, 1));
            }
        }
    }
    if let Some(s) = seats
        .iter()
        .find(|s| s.slot >= layout.slots || s.len >= layout.tokens)
    {
        return Err(format!(
            "slot {} at {} tokens: the arenas hold {} slots of {} tokens",
            s.slot, s.len, layout.slots, layout.tokens
        ));
    }
    Ok(())
}

/// One row of `width` normed by a weight vector, no rotation.
fn normed(width: usize, v: Vector) -> RowOp<'static> {
    RowOp {
        heads: 1,
        head_dim: width,
        norm: Norm::Weighted(v),
        rope: None,
        inverse: false,
    }
}

/// `rows` of `w` times `n` whole rows of `x`, as a new buffer `[n, rows.len()]`.
fn project<O: StepOps>(
    ops: &O,
    w: Lin,
    rows: std::ops::Range<usize>,
    x: &O::Buf,
    cols: usize,
    n: usize,
) -> Result<O::Buf, O::Error> {
    let width = rows.len();
    let mut y = ops.alloc(n * width)?;
    ops.linear(w, rows, x, View::rows(cols), &mut y, View::rows(width), n)?;
    Ok(y)
}

/// A sublayer's input from the streams (normed by the sublayer's norm), post and comb, as
/// `hyper::pre_many` and the norm compute them.
fn mix_in<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    l: usize,
    sub: Sub,
    x: &O::Buf,
    n: usize,
) -> Result<Mixed<O::Buf>, O::Error> {
    let (hc, d) = (c.hc_mult, c.hidden_size);
    let mut flat = ops.copy(x, n * hc * d)?;
    let unit = RowOp {
        heads: 1,
        head_dim: hc * d,
        norm: Norm::Unweighted,
        rope: None,
        inverse: false,
    };
    ops.norm_rope(&mut flat, &unit, n)?;
    let mixes = project(ops, Lin::Mix(l, sub), 0..(2 + hc) * hc, &flat, hc * d, n)?;
    let mut mixed = ops.hyper_pre(l, sub, x, &mixes, n)?;
    let norm = match sub {
        Sub::Attn => Vector::AttnNorm(l),
        Sub::Ffn => Vector::FfnNorm(l),
    };
    ops.norm_rope(&mut mixed.input, &normed(d, norm), n)?;
    Ok(mixed)
}

/// Layer `l`'s attention for every token (`attention::forward` and the model's `wo_b`):
/// `[n, D]`. Writes the tokens' rows into the arena.
fn attention<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    layout: &StateLayout,
    l: usize,
    arena: &mut O::Buf,
    seats: &[Seat],
    h: &O::Buf,
) -> Result<O::Buf, O::Error> {
    let n = seats.len();
    // A rank of a tensor-parallel group computes its share of the heads and output groups.
    let (head_share, group_share) = ops.head_share(c);
    let (d, hd, heads) = (c.hidden_size, c.head_dim, head_share.len());
    let kind = layout.layers[l].kind;
    let rope = if kind == Attention::Sliding {
        RopeKind::Main
    } else {
        RopeKind::Compress
    };
    let positions: Vec<usize> = seats.iter().map(|s| s.len).collect();
    let lin = |id| Lin::Attn(l, id);
    let mut qr = project(ops, lin(LinearId::QA), 0..c.q_lora_rank, h, d, n)?;
    ops.norm_rope(&mut qr, &normed(c.q_lora_rank, Vector::QNorm(l)), n)?;
    let q_rows = head_share.start * hd..head_share.end * hd;
    let mut q = project(ops, lin(LinearId::QB), q_rows, &qr, c.q_lora_rank, n)?;
    let rotated = |norm| RowOp {
        heads,
        head_dim: hd,
        norm,
        rope: Some((rope, &positions)),
        inverse: false,
    };
    ops.norm_rope(&mut q, &rotated(Norm::Unweighted), n)?;
    let mut kv = project(ops, lin(LinearId::Kv), 0..hd, h, d, n)?;
    let kv_op = RowOp {
        heads: 1,
        ..rotated(Norm::Weighted(Vector::KvNorm(l)))
    };
    ops.norm_rope(&mut kv, &kv_op, n)?;
    ops.round_kv_rows(&mut kv, n)?;
    let ring: Vec<i64> = seats
        .iter()
        .map(|s| layout.window_row(l, s.slot, s.len))
        .collect();
    ops.store_kv_rows(&kv, arena, &ring)?;
    let region = layout.layers[l];
    let compressors = [
        (
            region.compressor,
            Comp::Attn,
            LinearId::CompressorKv,
            LinearId::CompressorGate,
        ),
        (
            region.indexer,
            Comp::Index,
            LinearId::IndexerCompressorKv,
            LinearId::IndexerCompressorGate,
        ),
    ];
    for (r, comp, kv_id, gate_id) in compressors {
        let Some(r) = r else { continue };
        let slot_of = |s: &Seat, gate: bool| {
            let base = layout.base(l, s.slot) + r.pending_slot(s.len);
            let gate = if gate { r.ratio * r.width } else { 0 };
            (base + gate) as i64
        };
        for (id, gate) in [(kv_id, false), (gate_id, true)] {
            let y = project(ops, lin(id), 0..r.width, h, d, n)?;
            let at: Vec<i64> = seats.iter().map(|s| slot_of(s, gate)).collect();
            ops.write_rows(&y, r.width, arena, &at)?;
        }
        let mut closing: Vec<(&Seat, super::WindowClose)> = seats
            .iter()
            .filter_map(|s| {
                layout
                    .close_at(&r, layout.base(l, s.slot), s.len)
                    .map(|close| (s, close))
            })
            .collect();
        // With a shared slot, the closes are padded to a batch size (at least one) by closes
        // of the shared slot's first window: a step keeps its launches however many of its
        // sequences close a window.
        let padding = layout.shared.map(|slot| Seat {
            slot,
            len: r.ratio - 1,
        });
        if let Some(pad) = padding.as_ref() {
            let close = layout.close_at(&r, layout.base(l, pad.slot), pad.len);
            while let Some(close) =
                close.filter(|_| closing.len() < batch_bucket(closing.len().max(1)))
            {
                closing.push((pad, close));
            }
        }
        if closing.is_empty() {
            continue;
        }
        let mut closes: Vec<_> = closing.iter().map(|(_, close)| *close).collect();
        // A prompt chunk closing several windows of one sequence: each after its previous.
        for i in 0..closing.len() {
            let (s, _) = closing[i];
            let previous = (0..i).rev().find(|&j| {
                let (t, _) = closing[j];
                Some(s.slot) != layout.shared && t.slot == s.slot && t.len + r.ratio == s.len
            });
            if let Some(j) = previous {
                closes[i].prev_in_batch = Some(j);
                closes[j].keeps_prev = false;
            }
        }
        let mut rows = ops.close_windows(l, comp, arena, &closes)?;
        let window_pos: Vec<usize> = closing.iter().map(|(s, _)| s.len + 1 - r.ratio).collect();
        let row_op = RowOp {
            heads: 1,
            head_dim: r.d,
            norm: Norm::Weighted(Vector::CompressorNorm(l, comp)),
            rope: Some((RopeKind::Compress, &window_pos)),
            inverse: false,
        };
        ops.norm_rope(&mut rows, &row_op, closing.len())?;
        let at: Vec<i64> = closing
            .iter()
            .map(|(s, _)| (layout.base(l, s.slot) + r.rows + (s.len / r.ratio) * r.stride) as i64)
            .collect();
        if comp == Comp::Attn {
            // CSA and HCA rows are stored as K=V rows; the indexer's keys as computed.
            ops.round_kv_rows(&mut rows, closing.len())?;
            ops.store_kv_rows(&rows, arena, &at)?;
        } else {
            ops.write_rows(&rows, r.d, arena, &at)?;
        }
    }
    let chosen = match region.indexer {
        Some(ir) => {
            let (hi, di) = (c.index_n_heads, c.index_head_dim);
            let iq = project(
                ops,
                lin(LinearId::IndexerQB),
                0..hi * di,
                &qr,
                c.q_lora_rank,
                n,
            )?;
            let iw = project(ops, lin(LinearId::IndexerWeights), 0..hi, h, d, n)?;
            let at: Vec<IndexAt> = seats
                .iter()
                .map(|s| IndexAt {
                    pos: s.len,
                    rows: (layout.base(l, s.slot) + ir.rows) as i64,
                    visible: (s.len + 1) / ir.ratio,
                })
                .collect();
            Some(ops.index_select(&iq, &iw, arena, &at, c.index_topk)?)
        }
        None => None,
    };
    let keys: Vec<TokenKeys> = seats
        .iter()
        .map(|s| {
            let rows =
                |r: &super::layout::CompressorRegion| (layout.base(l, s.slot) + r.rows) as i64;
            TokenKeys {
                window: layout.window_keys(l, s.slot, s.len),
                compressed: match (kind, region.compressor) {
                    (Attention::Csa { .. }, Some(r)) => Compressed::Chosen {
                        rows: rows(&r),
                        count: ((s.len + 1) / r.ratio).min(c.index_topk),
                    },
                    (_, Some(r)) => Compressed::All {
                        rows: rows(&r),
                        count: (s.len + 1) / r.ratio,
                    },
                    (_, None) => Compressed::None,
                },
            }
        })
        .collect();
    let chosen = chosen.as_ref().map(|idx| (idx, c.index_topk));
    let mut out = ops.attend(l, &q, arena, &keys, chosen)?;
    let back = RowOp {
        norm: Norm::None,
        inverse: true,
        ..rotated(Norm::None)
    };
    ops.norm_rope(&mut out, &back, n)?;
    // The grouped low-rank output projection: each group's heads to its block of `wo_a`.
    let (groups, rank) = (group_share.len(), c.o_lora_rank);
    let group_in = c.num_heads * hd / c.o_groups;
    let mut lows = ops.alloc(n * groups * rank)?;
    for (i, g) in group_share.enumerate() {
        ops.linear(
            lin(LinearId::OA),
            g * rank..(g + 1) * rank,
            &out,
            View {
                stride: heads * hd,
                start: i * group_in,
            },
            &mut lows,
            View {
                stride: groups * rank,
                start: i * rank,
            },
            n,
        )?;
    }
    let lows = ops.gather_lows(lows, n, groups * rank)?;
    project(ops, lin(LinearId::OB), 0..d, &lows, c.o_groups * rank, n)
}

/// Layer `l`'s MoE for every token (`moe::forward_many`): `[n, D]`.
fn moe<O: StepOps>(
    ops: &O,
    c: &ModelConfig,
    l: usize,
    h: &O::Buf,
    ids: &O::Idx,
    n: usize,
) -> Result<O::Buf, O::Error> {
    let (d, inter, k) = (c.hidden_size, c.moe_intermediate_size, c.experts_per_token);
    let logits = project(ops, Lin::Gate(l), 0..c.n_routed_experts, h, d, n)?;
    let (experts, weights) = ops.route(l, &logits, ids, n)?;
    let ys = ops.routed_experts(l, h, &experts, (k, inter), n * k)?;
    let shared_gate = project(ops, Lin::Shared(l, Proj::Gate), 0..inter, h, d, n)?;
    let shared_up = project(ops, Lin::Shared(l, Proj::Up), 0..inter, h, d, n)?;
    let shared_act = ops.swiglu(&shared_gate, &shared_up, n, inter)?;
    let shared = project(ops, Lin::Shared(l, Proj::Down), 0..d, &shared_act, inter, n)?;
    ops.combine(&ys, &weights, &shared, n, k)
}
