//! Where a sequence's attention state lives in the device arenas: one arena per layer, a fixed
//! region per sequence slot (like a page table with one page per slot, sized for the slot's
//! most tokens). A region holds the sliding window as a ring of `sliding_window` K=V rows (the
//! row of position `p` in ring slot `p % sliding_window`), and for each compressor its emitted
//! rows, the unfinished window's projected slots (`p % ratio`), and for overlapping (CSA)
//! compressors the last closed window's Ca slices. The engine's `SequenceState` is loaded into
//! a slot (the state a prefill hands to decode) and read back from it (to compare).

use engine::{
    config::{Attention, ModelConfig},
    model::{SequenceState, attention::AttentionState, compressor::CompressorState},
};

use super::{StepOps, WindowClose};

/// One compressor's part of a slot's region (offsets from the region's start, in f32s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressorRegion {
    pub ratio: usize,
    /// Row width (`head_dim` or `index_head_dim`).
    pub d: usize,
    /// Slot width: `d`, or `2 * d` with overlap.
    pub width: usize,
    pub overlap: bool,
    /// Most rows a slot holds.
    pub capacity: usize,
    pub rows: usize,
    /// Projected kv of the unfinished window (`ratio * width`), its gate scores right after.
    pub pending: usize,
    /// The last closed window's Ca kv slice (`ratio * d`), its gate right after.
    pub prev: usize,
}

impl CompressorRegion {
    fn new(ratio: usize, d: usize, overlap: bool, tokens: usize, at: &mut usize) -> Self {
        let width = if overlap { 2 * d } else { d };
        let capacity = tokens / ratio;
        // Rows start at a multiple of their width, so a kernel can address them by row index.
        let rows = at.next_multiple_of(d);
        let pending = rows + capacity * d;
        let prev = pending + 2 * ratio * width;
        *at = prev + if overlap { 2 * ratio * d } else { 0 };
        Self {
            ratio,
            d,
            width,
            overlap,
            capacity,
            rows,
            pending,
            prev,
        }
    }
}

/// One layer's slot region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRegion {
    pub kind: Attention,
    /// f32s per slot.
    pub per_slot: usize,
    /// The window ring (`sliding_window * head_dim`) starts the region.
    pub compressor: Option<CompressorRegion>,
    pub indexer: Option<CompressorRegion>,
}

/// Every layer's arena for `slots` sequences of at most `tokens` tokens each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    pub slots: usize,
    pub tokens: usize,
    pub window: usize,
    pub head_dim: usize,
    pub layers: Vec<LayerRegion>,
}

impl StateLayout {
    pub fn new(c: &ModelConfig, slots: usize, tokens: usize) -> Self {
        let layers = c
            .layers
            .iter()
            .map(|spec| {
                let mut at = c.sliding_window * c.head_dim;
                let kind = spec.attention;
                let compressor = (kind != Attention::Sliding).then(|| {
                    let overlap = matches!(kind, Attention::Csa { .. });
                    CompressorRegion::new(kind.ratio(), c.head_dim, overlap, tokens, &mut at)
                });
                let indexer = matches!(kind, Attention::Csa { .. }).then(|| {
                    CompressorRegion::new(kind.ratio(), c.index_head_dim, true, tokens, &mut at)
                });
                // Every slot's rows at the same alignment as the first slot's.
                let align = if indexer.is_some() {
                    lcm(c.head_dim, c.index_head_dim)
                } else {
                    c.head_dim
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
            head_dim: c.head_dim,
            layers,
        }
    }

    /// f32s of layer `layer`'s arena.
    pub fn arena_len(&self, layer: usize) -> usize {
        self.slots * self.layers[layer].per_slot
    }

    /// Fresh arenas (NaN until written).
    pub fn arenas<O: StepOps>(&self, ops: &O) -> Result<Vec<O::Buf>, O::Error> {
        (0..self.layers.len())
            .map(|l| ops.alloc(self.arena_len(l)))
            .collect()
    }

    /// Where slot `slot`'s region of layer `layer` starts.
    pub fn base(&self, layer: usize, slot: usize) -> usize {
        slot * self.layers[layer].per_slot
    }

    /// The ring row of position `pos`.
    pub fn window_row(&self, layer: usize, slot: usize, pos: usize) -> i64 {
        (self.base(layer, slot) + (pos % self.window) * self.head_dim) as i64
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
            pending: (base + r.pending) as i64,
            prev: (base + r.prev) as i64,
            has_prev: r.overlap && pos + 1 > r.ratio,
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
                ops.put_at(
                    arena,
                    self.window_row(l, slot, p) as usize,
                    &layer.window[row * hd..(row + 1) * hd],
                )?;
            }
            let region = &self.layers[l];
            for (r, cs) in [
                (region.compressor, &layer.compressor),
                (region.indexer, &layer.indexer),
            ] {
                if let (Some(r), Some(cs)) = (r, cs) {
                    load_compressor(ops, arena, &r, base, len, cs, l)?;
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
                state.window.extend(ops.get(arena, at..at + hd)?);
            }
            if let Some(r) = &region.compressor {
                state.compressor = Some(read_compressor(ops, arena, r, base, len)?);
            }
            if let Some(r) = &region.indexer {
                state.indexer = Some(read_compressor(ops, arena, r, base, len)?);
            }
            layers.push(state);
        }
        Ok(SequenceState { len, layers })
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
    r: &CompressorRegion,
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
    ops.put_at(arena, base + r.rows, &cs.rows)?;
    ops.put_at(arena, base + r.pending, &cs.pending_kv)?;
    ops.put_at(
        arena,
        base + r.pending + r.ratio * r.width,
        &cs.pending_gate,
    )?;
    if prev > 0 {
        ops.put_at(arena, base + r.prev, &cs.prev_kv)?;
        ops.put_at(arena, base + r.prev + r.ratio * r.d, &cs.prev_gate)?;
    }
    Ok(())
}

fn read_compressor<O: StepOps>(
    ops: &O,
    arena: &O::Buf,
    r: &CompressorRegion,
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
    Ok(CompressorState {
        rows: at(r.rows, rows * r.d)?,
        pending_kv: at(r.pending, pending * r.width)?,
        pending_gate: at(r.pending + r.ratio * r.width, pending * r.width)?,
        prev_kv: at(r.prev, prev)?,
        prev_gate: at(r.prev + r.ratio * r.d, prev)?,
    })
}
