//! Where a sequence's attention state lives in the device arenas: one arena per layer, a fixed
//! region per sequence slot (like a page table with one page per slot, sized for the slot's
//! most tokens). A region holds the sliding window as a ring of K=V rows (the row of position
//! `p` in ring slot `p % ring`), and for each compressor its emitted rows, a ring of unfinished
//! windows' projected slots (window `p / ratio` in ring window `(p / ratio) % windows`, slot
//! `p % ratio`), and for overlapping (CSA) compressors the last closed window's Ca slices.
//!
//! A step may take up to `chunk` consecutive tokens of one sequence (a prompt chunk; 1 for
//! decode). Each token's rows are written before any token attends, so the ring holds
//! `sliding_window + chunk - 1` rows (the chunk's first token still finds its whole window)
//! and the pending ring every window the chunk's tokens touch, `ceil((chunk - 1) / ratio) + 1`.
//! The engine's `SequenceState` is loaded into a slot (the state a prefill hands to decode) and
//! read back from it (to compare).

use std::ops::Range;

use engine::{
    config::{Attention, ModelConfig},
    model::{
        SequenceState,
        attention::AttentionState,
        compressor::{CompressorState, PendingState},
        delta::{CompressorDelta, LayerDelta, StateDelta},
    },
    paged::{codec, layout::RowFormat},
};

use super::{StepOps, WindowClose};

/// One compressor's part of a slot's region (offsets from the region's start, in f32s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressorRegion {
    pub ratio: usize,
    /// Row width (`head_dim` or `index_head_dim`).
    pub d: usize,
    /// f32s a stored row takes (`d`, or a K=V row's stored bytes / 4).
    pub stride: usize,
    /// Slot width: `d`, or `2 * d` with overlap.
    pub width: usize,
    pub overlap: bool,
    /// Unfinished windows the pending ring holds.
    pub windows: usize,
    /// Most rows a slot holds.
    pub capacity: usize,
    pub rows: usize,
    /// The pending ring: per window the projected kv (`ratio * width`), its gate scores right
    /// after.
    pub pending: usize,
    /// The last closed window's Ca kv slice (`ratio * d`), its gate right after.
    pub prev: usize,
}

impl CompressorRegion {
    fn new(
        ratio: usize,
        (d, stride): (usize, usize),
        overlap: bool,
        (tokens, chunk): (usize, usize),
        at: &mut usize,
    ) -> Self {
        let width = if overlap { 2 * d } else { d };
        let capacity = tokens / ratio;
        let windows = (chunk.max(1) - 1).div_ceil(ratio) + 1;
        // Rows start at a multiple of their stride, so a kernel can address them by row index.
        let rows = at.next_multiple_of(stride);
        let pending = rows + capacity * stride;
        let prev = pending + windows * 2 * ratio * width;
        *at = prev + if overlap { 2 * ratio * d } else { 0 };
        Self {
            ratio,
            d,
            stride,
            width,
            overlap,
            windows,
            capacity,
            rows,
            pending,
            prev,
        }
    }

    /// Offset (from the slot's region) of the pending window of position `pos`: its kv slots,
    /// the gate scores `ratio * width` after.
    pub fn pending_window(&self, pos: usize) -> usize {
        self.pending + ((pos / self.ratio) % self.windows) * 2 * self.ratio * self.width
    }

    /// Offset of position `pos`'s kv slot in the pending ring (its gate `ratio * width` after).
    pub fn pending_slot(&self, pos: usize) -> usize {
        self.pending_window(pos) + (pos % self.ratio) * self.width
    }
}

/// One layer's slot region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRegion {
    pub kind: Attention,
    /// f32s per slot.
    pub per_slot: usize,
    /// The window ring (`sliding_window` K=V rows) starts the region.
    pub compressor: Option<CompressorRegion>,
    pub indexer: Option<CompressorRegion>,
}

/// Every layer's arena for `slots` sequences of at most `tokens` tokens each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    pub slots: usize,
    pub tokens: usize,
    pub window: usize,
    /// Most consecutive tokens of one sequence in a step.
    pub chunk: usize,
    /// Rows of the window ring: `window + chunk - 1`.
    pub ring: usize,
    pub head_dim: usize,
    /// How K=V rows (window, CSA and HCA rows) are stored: f32, or DeepSeek's FP8 row (its
    /// bytes in the f32s of the arena).
    pub kv: RowFormat,
    /// f32s a stored K=V row takes.
    pub kv_stride: usize,
    pub layers: Vec<LayerRegion>,
    /// A slot that padding seats share (the last): steps padded to a batch size, and their
    /// window closes to a count, with seats and closes that write only there and whose
    /// results nobody reads (`StateLayout::with_shared_slot`).
    pub shared: Option<usize>,
}

/// f32s a K=V row of `head_dim` values takes stored as `kv` (its bytes, a whole number of
/// f32s).
pub fn kv_stride(head_dim: usize, kv: RowFormat) -> Result<usize, String> {
    let bytes = kv.row_bytes(head_dim);
    match kv.e4m3_bf16_split(head_dim) {
        None => Ok(head_dim),
        Some((nope, rope)) if nope + rope == head_dim && bytes.is_multiple_of(4) => Ok(bytes / 4),
        Some(_) => Err(format!(
            "a {kv:?} K=V row of {head_dim} values takes {bytes} bytes, not whole f32s"
        )),
    }
}

/// A stored K=V row of `row`'s values in `kv`, as the f32s (bit patterns) the arena holds.
pub fn pack_kv_row(kv: RowFormat, row: &[f32]) -> Vec<f32> {
    if kv == RowFormat::F32 {
        return row.to_vec();
    }
    let mut bytes = vec![0u8; kv.row_bytes(row.len()).next_multiple_of(4)];
    codec::encode(kv, row, &mut bytes);
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        .collect()
}

/// The `head_dim` values of a stored K=V row (the arena's f32s from its start).
pub fn unpack_kv_row(kv: RowFormat, stored: &[f32], head_dim: usize) -> Vec<f32> {
    if kv == RowFormat::F32 {
        return stored[..head_dim].to_vec();
    }
    let bytes: Vec<u8> = stored
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect();
    codec::decode(kv, &bytes, head_dim)
}

impl StateLayout {
    /// Arenas with f32 K=V rows.
    pub fn new(c: &ModelConfig, slots: usize, tokens: usize) -> Self {
        Self::stored(c, slots, tokens, RowFormat::F32)
    }

    /// Arenas with K=V rows stored as `kv` (a model's `Model::kv_rows`).
    ///
    /// # Panics
    /// When an FP8 row of the model's `head_dim` is not a whole number of f32s (DeepSeek's
    /// 584-byte row is 146).
    pub fn stored(c: &ModelConfig, slots: usize, tokens: usize, kv: RowFormat) -> Self {
        Self::chunked(c, (slots, tokens), kv, 1)
    }

    /// Arenas whose steps take up to `chunk` consecutive tokens of a sequence (a prompt chunk).
    ///
    /// # Panics
    /// As [`Self::stored`].
    pub fn chunked(
        c: &ModelConfig,
        (slots, tokens): (usize, usize),
        kv: RowFormat,
        chunk: usize,
    ) -> Self {
        #[expect(clippy::expect_used, reason = "a model's own row format")]
        let stride = kv_stride(c.head_dim, kv).expect("K=V rows of whole f32s");
        let chunk = chunk.max(1);
        let ring = c.sliding_window + chunk - 1;
        let layers = c
            .layers
            .iter()
            .map(|spec| {
                let mut at = ring * stride;
                let kind = spec.attention;
                let compressor = (kind != Attention::Sliding).then(|| {
                    let overlap = matches!(kind, Attention::Csa { .. });
                    let rows = (c.head_dim, stride);
                    CompressorRegion::new(kind.ratio(), rows, overlap, (tokens, chunk), &mut at)
                });
                let indexer = matches!(kind, Attention::Csa { .. }).then(|| {
                    let rows = (c.index_head_dim, c.index_head_dim);
                    CompressorRegion::new(kind.ratio(), rows, true, (tokens, chunk), &mut at)
                });
                // Every slot's rows at the same alignment as the first slot's.
                let align = if indexer.is_some() {
                    lcm(stride, c.index_head_dim)
                } else {
                    stride
                };
                LayerRegion {
                    kind,
                    per_slot: at.next_multiple_of(align.max(1)),
                    compressor,
                    indexer,
                }
            })
            .collect();
        Self {
            slots,
            tokens,
            window: c.sliding_window,
            chunk,
            ring,
            head_dim: c.head_dim,
            kv,
            kv_stride: stride,
            layers,
            shared: None,
        }
    }

    /// Slots for sequences (all but the shared one).
    pub fn sequence_slots(&self) -> usize {
        self.slots - usize::from(self.shared.is_some())
    }

    /// The same arenas with one slot more, for padding (`shared`).
    #[must_use]
    pub fn with_shared_slot(mut self) -> Self {
        if self.shared.is_none() {
            self.shared = Some(self.slots);
            self.slots += 1;
        }
        self
    }

    /// f32s of layer `layer`'s arena.
    pub fn arena_len(&self, layer: usize) -> usize {
        self.slots * self.layers[layer].per_slot
    }

    /// Fresh arenas (NaN until written).
    pub fn arenas<O: StepOps>(&self, ops: &O) -> Result<Vec<O::Buf>, O::Error> {
        (0..self.layers.len())
            .map(|l| ops.alloc_state(self.arena_len(l)))
            .collect()
    }

    /// Where slot `slot`'s region of layer `layer` starts.
    pub fn base(&self, layer: usize, slot: usize) -> usize {
        slot * self.layers[layer].per_slot
    }

    /// The ring row of position `pos`.
    pub fn window_row(&self, layer: usize, slot: usize, pos: usize) -> i64 {
        (self.base(layer, slot) + (pos % self.ring) * self.kv_stride) as i64
    }

    /// The window rows a token at `pos` attends to, oldest first.
    pub fn window_keys(&self, layer: usize, slot: usize, pos: usize) -> Vec<i64> {
        ((pos + 1).saturating_sub(self.window)..=pos)
            .map(|p| self.window_row(layer, slot, p))
            .collect()
    }

    /// The close of the window that token `pos` completes, if it does.
    pub fn close_at(&self, r: &CompressorRegion, base: usize, pos: usize) -> Option<WindowClose> {
        ((pos + 1).is_multiple_of(r.ratio)).then(|| WindowClose {
            pending: (base + r.pending_window(pos)) as i64,
            prev: (base + r.prev) as i64,
            has_prev: r.overlap && pos + 1 > r.ratio,
            prev_in_batch: None,
            keeps_prev: true,
        })
    }

    /// Loads `state` into slot `slot` (`state.len` tokens, at most [`Self::tokens`]).
    pub fn load<O: StepOps>(
        &self,
        ops: &O,
        arenas: &mut [O::Buf],
        slot: usize,
        state: &SequenceState,
    ) -> Result<(), O::Error> {
        let len = state.len;
        if slot >= self.slots || len > self.tokens || state.layers.len() != self.layers.len() {
            return Err(format!(
                "a state of {len} tokens and {} layers does not fit slot {slot} of {} (at most {} \
                 tokens, {} layers)",
                state.layers.len(),
                self.slots,
                self.tokens,
                self.layers.len()
            )
            .into());
        }
        let hd = self.head_dim;
        for (l, (layer, arena)) in state.layers.iter().zip(arenas.iter_mut()).enumerate() {
            let base = self.base(l, slot);
            let held = layer.window.len() / hd;
            let needed = len.min(self.window - 1);
            if held < needed {
                return Err(format!(
                    "layer {l}: the state holds {held} window rows, the next token needs {needed}"
                )
                .into());
            }
            for p in len - needed..len {
                let row = held - (len - p);
                let stored = pack_kv_row(self.kv, &layer.window[row * hd..(row + 1) * hd]);
                ops.put_at(arena, self.window_row(l, slot, p) as usize, &stored)?;
            }
            let region = &self.layers[l];
            for (r, cs, kv) in [
                (region.compressor, &layer.compressor, self.kv),
                (region.indexer, &layer.indexer, RowFormat::F32),
            ] {
                if let (Some(r), Some(cs)) = (r, cs) {
                    load_compressor(ops, arena, (&r, kv), base, len, cs, l)?;
                }
            }
        }
        Ok(())
    }

    /// Reads slot `slot`'s state of `len` tokens back in the engine's form, windows trimmed as
    /// `SequenceState::normalized` trims them.
    pub fn read<O: StepOps>(
        &self,
        ops: &O,
        arenas: &[O::Buf],
        slot: usize,
        len: usize,
    ) -> Result<SequenceState, O::Error> {
        let hd = self.head_dim;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (l, (region, arena)) in self.layers.iter().zip(arenas).enumerate() {
            let base = self.base(l, slot);
            let mut state = AttentionState::new(region.kind);
            for p in len - len.min(self.window - 1)..len {
                let at = self.window_row(l, slot, p) as usize;
                let stored = ops.get(arena, at..at + self.kv_stride)?;
                state.window.extend(unpack_kv_row(self.kv, &stored, hd));
            }
            if let Some(r) = &region.compressor {
                state.compressor = Some(read_compressor(ops, arena, (r, self.kv), base, len)?);
            }
            if let Some(r) = &region.indexer {
                let f32_rows = (r, RowFormat::F32);
                state.indexer = Some(read_compressor(ops, arena, f32_rows, base, len)?);
            }
            layers.push(state);
        }
        Ok(SequenceState { len, layers })
    }
}

impl StateLayout {
    /// What a step over positions `from..to` added to slot `slot`'s state, in the engine's
    /// form ([`StateDelta`]): those positions' K=V rows (still in the window ring: at most
    /// `ring` of them), the rows of the windows they closed, and each compressor's slot part
    /// at `to`. What a prompt chunk sends back, instead of the whole state.
    pub fn read_delta<O: StepOps>(
        &self,
        ops: &O,
        arenas: &[O::Buf],
        slot: usize,
        span: (usize, usize),
    ) -> Result<StateDelta, O::Error> {
        let mut deltas = self.read_deltas(ops, arenas, &[(slot, span)])?;
        deltas
            .pop()
            .ok_or_else(|| "read_deltas gave no delta".to_owned().into())
    }

    /// [`Self::read_delta`] of several `(slot, (from, to))` at once: every piece of every
    /// delta in one [`StepOps::get_many`] (one crossing on a device).
    pub fn read_deltas<O: StepOps>(
        &self,
        ops: &O,
        arenas: &[O::Buf],
        spans: &[(usize, (usize, usize))],
    ) -> Result<Vec<StateDelta>, O::Error> {
        for &(slot, (from, to)) in spans {
            if slot >= self.slots || from > to || to > self.tokens || to - from > self.ring {
                return Err(format!(
                    "no delta of positions {from}..{to} in slot {slot} of {} ({} tokens, a \
                     ring of {})",
                    self.slots, self.tokens, self.ring
                )
                .into());
            }
        }
        // Every delta's pieces, layer by layer, in the order `delta_of` takes them.
        let mut parts = Vec::new();
        for &(slot, span) in spans {
            for (l, arena) in arenas.iter().enumerate().take(self.layers.len()) {
                for range in self.delta_pieces(l, slot, span) {
                    parts.push((arena, range));
                }
            }
        }
        let mut got = ops.get_many(&parts)?.into_iter();
        Ok(spans
            .iter()
            .map(|&(_, span)| self.delta_of(span, &mut got))
            .collect())
    }

    /// The ranges of layer `l`'s arena a delta of slot `slot` over `span` reads: the ring's
    /// rows of the span in two runs (the second empty unless it wraps), then per compressor
    /// (the attention's, then the indexer's, where the layer has them) its closed rows, its
    /// unfinished window's kv and gate slots, its overlap slice's kv and gate.
    fn delta_pieces(&self, l: usize, slot: usize, (from, to): (usize, usize)) -> Vec<Range<usize>> {
        let base = self.base(l, slot);
        let at = |p: usize| self.window_row(l, slot, p) as usize;
        let first = (to - from).min(self.ring - from % self.ring);
        let mut pieces = vec![
            at(from)..at(from) + first * self.kv_stride,
            at(from + first)..at(from + first) + (to - from - first) * self.kv_stride,
        ];
        let region = &self.layers[l];
        for r in [region.compressor, region.indexer].into_iter().flatten() {
            let rows = base + r.rows + from / r.ratio * r.stride;
            let pending = base + r.pending_window(to);
            let (open, prev) = (to % r.ratio * r.width, base + r.prev);
            let prev_len = if r.overlap && to >= r.ratio {
                r.ratio * r.d
            } else {
                0
            };
            pieces.extend([
                rows..rows + (to / r.ratio - from / r.ratio) * r.stride,
                pending..pending + open,
                pending + r.ratio * r.width..pending + r.ratio * r.width + open,
                prev..prev + prev_len,
                prev + r.ratio * r.d..prev + r.ratio * r.d + prev_len,
            ]);
        }
        // An empty piece reads nothing, wherever it would have started.
        pieces
            .into_iter()
            .map(|r| if r.is_empty() { 0..0 } else { r })
            .collect()
    }

    /// A delta from the values of its pieces (`delta_pieces`' order, layer by layer).
    fn delta_of(
        &self,
        (from, to): (usize, usize),
        got: &mut impl Iterator<Item = Vec<f32>>,
    ) -> StateDelta {
        let hd = self.head_dim;
        let mut next = || got.next().unwrap_or_default();
        let layers = self
            .layers
            .iter()
            .map(|region| {
                let mut layer = LayerDelta::default();
                for stored in [next(), next()] {
                    for row in stored.chunks_exact(self.kv_stride) {
                        layer.window.extend(unpack_kv_row(self.kv, row, hd));
                    }
                }
                let mut part = |r: &CompressorRegion, kv: RowFormat| {
                    let rows = next();
                    CompressorDelta {
                        rows: rows
                            .chunks_exact(r.stride.max(1))
                            .flat_map(|row| unpack_kv_row(kv, row, r.d))
                            .collect(),
                        pending: PendingState {
                            pending_kv: next(),
                            pending_gate: next(),
                            prev_kv: next(),
                            prev_gate: next(),
                        },
                    }
                };
                layer.compressor = region.compressor.as_ref().map(|r| part(r, self.kv));
                layer.indexer = region.indexer.as_ref().map(|r| part(r, RowFormat::F32));
                layer
            })
            .collect();
        StateDelta { from, to, layers }
    }
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    if a == 0 || b == 0 {
        0
    } else {
        a / gcd(a, b) * b
    }
}

fn load_compressor<O: StepOps>(
    ops: &O,
    arena: &mut O::Buf,
    (r, kv): (&CompressorRegion, RowFormat),
    base: usize,
    len: usize,
    cs: &CompressorState,
    layer: usize,
) -> Result<(), O::Error> {
    let (rows, pending) = (len / r.ratio, len % r.ratio);
    let prev = if r.overlap && rows > 0 {
        r.ratio * r.d
    } else {
        0
    };
    if rows > r.capacity
        || cs.rows.len() != rows * r.d
        || cs.pending_kv.len() != pending * r.width
        || cs.pending_gate.len() != pending * r.width
        || cs.prev_kv.len() != prev
        || cs.prev_gate.len() != prev
    {
        return Err(format!(
            "layer {layer}: a compressor state that is not {len} tokens' (rows of {}, ratio {})",
            r.d, r.ratio
        )
        .into());
    }
    let stored: Vec<f32> = cs
        .rows
        .chunks_exact(r.d.max(1))
        .flat_map(|row| pack_kv_row(kv, row))
        .collect();
    ops.put_at(arena, base + r.rows, &stored)?;
    let window = base + r.pending_window(len);
    ops.put_at(arena, window, &cs.pending_kv)?;
    ops.put_at(arena, window + r.ratio * r.width, &cs.pending_gate)?;
    if prev > 0 {
        ops.put_at(arena, base + r.prev, &cs.prev_kv)?;
        ops.put_at(arena, base + r.prev + r.ratio * r.d, &cs.prev_gate)?;
    }
    Ok(())
}

fn read_compressor<O: StepOps>(
    ops: &O,
    arena: &O::Buf,
    (r, kv): (&CompressorRegion, RowFormat),
    base: usize,
    len: usize,
) -> Result<CompressorState, O::Error> {
    let (rows, pending) = (len / r.ratio, len % r.ratio);
    let prev = if r.overlap && rows > 0 {
        r.ratio * r.d
    } else {
        0
    };
    let at = |offset: usize, n: usize| {
        if n == 0 {
            return Ok(Vec::new());
        }
        ops.get(arena, base + offset..base + offset + n)
    };
    let stored = at(r.rows, rows * r.stride)?;
    Ok(CompressorState {
        rows: stored
            .chunks_exact(r.stride.max(1))
            .flat_map(|row| unpack_kv_row(kv, row, r.d))
            .collect(),
        pending_kv: at(r.pending_window(len), pending * r.width)?,
        pending_gate: at(r.pending_window(len) + r.ratio * r.width, pending * r.width)?,
        prev_kv: at(r.prev, prev)?,
        prev_gate: at(r.prev + r.ratio * r.d, prev)?,
    })
}
