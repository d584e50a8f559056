//! Sequences whose state lives in a page pool. A forward step gathers what the model reads
//! (the window's last rows, all compressed rows, the compressors' unfinished state) from the
//! pages and the slot, and scatters what the step produced back into them. Pages shared
//! through the prefix cache are never written: new rows only land at positions past the
//! shared prefix.

use super::{
    codec,
    layout::{Placement, Region, RegionKind, StateLayout},
    prefix::{self, PrefixCache},
};
use crate::{
    config::{Attention, ModelConfig},
    model::{
        SequenceState,
        attention::AttentionState,
        compressor::CompressorState,
        delta::{CompressorDelta, StateDelta},
    },
    pool::{PageId, PagePool, PoolError},
};

/// One sequence's handle: its page table, its slot and how many tokens are stored.
/// Why rows of a stored sequence cannot be addressed in the pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowAddressError {
    #[error("no layer {0}")]
    NoLayer(usize),
    #[error("layer {layer} {kind:?} rows are not f32")]
    NotF32 { layer: usize, kind: RegionKind },
    #[error("page {0} of the sequence is not reserved")]
    NotReserved(usize),
    #[error("layer {layer} has no {kind:?} region")]
    NoRegion { layer: usize, kind: RegionKind },
    #[error("layer {0} has no compressed rows")]
    NotCompressed(usize),
    #[error("compressed row {row} of layer {layer} is not closed at length {len}")]
    NotClosed {
        row: usize,
        layer: usize,
        len: usize,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedSeq {
    /// Page `i` holds tokens `[i*page_size, (i+1)*page_size)`.
    pub pages: Vec<PageId>,
    pub slot: PageId,
    pub len: usize,
}

/// The state pools of one worker.
#[derive(Debug)]
pub struct PagedStore {
    pub layout: StateLayout,
    config: ModelConfig,
    pages: PagePool,
    slots: PagePool,
    prefix: PrefixCache,
    prefix_enabled: bool,
}

impl PagedStore {
    pub fn new(config: &ModelConfig, layout: StateLayout, num_pages: u32, num_slots: u32) -> Self {
        Self {
            pages: PagePool::new(num_pages, layout.page_bytes),
            slots: PagePool::new(num_slots, layout.slot_bytes),
            config: config.clone(),
            layout,
            prefix: PrefixCache::default(),
            prefix_enabled: true,
        }
    }

    /// Turns the prefix cache on or off (off drops every cached block).
    pub fn set_prefix_cache(&mut self, enabled: bool) -> Result<(), PoolError> {
        self.prefix_enabled = enabled;
        if !enabled {
            self.prefix.clear(&mut self.pages)?;
        }
        Ok(())
    }

    pub fn prefix(&self) -> &PrefixCache {
        &self.prefix
    }

    /// A new sequence for `prompt`, starting from the longest cached prefix (at least one
    /// prompt token is always left to compute). Returns the sequence and the cached tokens.
    pub fn open_prompt(&mut self, prompt: &[u32]) -> Result<(PagedSeq, usize), PoolError> {
        let mut seq = self.open()?;
        if !self.prefix_enabled || prompt.is_empty() {
            return Ok((seq, 0));
        }
        let ps = self.layout.page_size;
        let keys = prefix::block_keys(prompt, ps);
        let hit = match self
            .prefix
            .lookup(&mut self.pages, &keys, (prompt.len() - 1) / ps)
        {
            Ok(hit) => hit,
            Err(e) => {
                self.release(seq)?;
                return Err(e);
            }
        };
        if let Some(hit) = hit {
            seq.len = hit.pages.len() * ps;
            seq.pages = hit.pages;
            self.slots.page_mut(seq.slot)?.copy_from_slice(&hit.slot);
        }
        let cached = seq.len;
        Ok((seq, cached))
    }

    /// Offers the block that `seq` just completed to the prefix cache (call after `scatter`
    /// with the sequence's tokens so far; only steps that end on a block boundary add one).
    pub fn offer_block(&mut self, seq: &PagedSeq, tokens: &[u32]) -> Result<(), PoolError> {
        let ps = self.layout.page_size;
        if !self.prefix_enabled
            || seq.len == 0
            || !seq.len.is_multiple_of(ps)
            || tokens.len() < seq.len
        {
            return Ok(());
        }
        let depth = seq.len / ps - 1;
        let keys = prefix::block_keys(&tokens[..seq.len], ps);
        let slot = self.slots.page(seq.slot)?.to_vec();
        self.prefix.insert(
            &mut self.pages,
            keys[depth],
            seq.pages[depth],
            Some(&slot),
            depth,
        )
    }

    /// Offers the blocks that a step from position `from` completed strictly inside it (the
    /// one ending at its end goes through [`Self::offer_block`]) without their slots: a
    /// device's prompt chunk sends back the state at its end only. Their pages serve the
    /// deeper blocks of later prompts; no request resumes at their ends.
    pub fn offer_inner_pages(
        &mut self,
        seq: &PagedSeq,
        tokens: &[u32],
        from: usize,
    ) -> Result<(), PoolError> {
        let ps = self.layout.page_size;
        let end = seq.len.min(tokens.len());
        if !self.prefix_enabled || end <= from + 1 {
            return Ok(());
        }
        // Blocks ending after `from` and before `end`.
        let (first, last) = (from / ps, (end - 1) / ps);
        if first >= last {
            return Ok(());
        }
        let keys = prefix::block_keys(&tokens[..last * ps], ps);
        for (depth, (&key, &page)) in keys.iter().zip(&seq.pages).enumerate().skip(first) {
            self.prefix
                .insert(&mut self.pages, key, page, None, depth)?;
        }
        Ok(())
    }

    pub fn pages(&self) -> &PagePool {
        &self.pages
    }

    pub fn pages_mut(&mut self) -> &mut PagePool {
        &mut self.pages
    }

    pub fn slots_mut(&mut self) -> &mut PagePool {
        &mut self.slots
    }

    pub fn slots(&self) -> &PagePool {
        &self.slots
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.page_size)
    }

    /// A new empty sequence (takes a slot).
    pub fn open(&mut self) -> Result<PagedSeq, PoolError> {
        let slot = self.slots.alloc(1)?[0];
        Ok(PagedSeq {
            pages: Vec::new(),
            slot,
            len: 0,
        })
    }

    /// Makes room for `tokens` tokens in total (all or nothing), evicting unreferenced prefix
    /// blocks if the pool is short.
    pub fn reserve(&mut self, seq: &mut PagedSeq, tokens: usize) -> Result<(), PoolError> {
        let need = self.pages_for(tokens).saturating_sub(seq.pages.len());
        if need == 0 {
            return Ok(());
        }
        if need > self.pages.free_count() {
            let short = need - self.pages.free_count();
            self.prefix.evict(&mut self.pages, short)?;
        }
        seq.pages.extend(self.pages.alloc(need)?);
        Ok(())
    }

    /// Returns a sequence's pages and slot to the pools.
    pub fn release(&mut self, seq: PagedSeq) -> Result<(), PoolError> {
        for page in seq.pages {
            self.pages.release(page)?;
        }
        self.slots.release(seq.slot)
    }

    /// The slot bytes as a step ending at block boundary `len` would have left them, from the
    /// compressor snapshots the forward call recorded there (`state.layers[l].boundaries`).
    fn slot_at(
        &self,
        seq: &PagedSeq,
        state: &SequenceState,
        len: usize,
    ) -> Result<Vec<u8>, PoolError> {
        let mut bytes = self.slots.page(seq.slot)?.to_vec();
        for (l, spec) in self.config.layers.iter().enumerate() {
            let Some(b) = state.layers[l].boundaries.iter().find(|b| b.len == len) else {
                continue;
            };
            let ratio = spec.attention.ratio();
            let csa = matches!(spec.attention, Attention::Csa { .. });
            let parts = [
                (
                    &b.compressor,
                    RegionKind::CompressorState,
                    self.config.head_dim,
                    csa,
                ),
                (
                    &b.indexer,
                    RegionKind::IndexerCompressorState,
                    self.config.index_head_dim,
                    true,
                ),
            ];
            for (pending, kind, d, overlap) in parts {
                if let (Some(p), Some(region)) = (pending, self.region(l, kind)) {
                    encode_pending(
                        &mut bytes,
                        region,
                        (&p.pending_kv, &p.pending_gate, &p.prev_kv, &p.prev_gate),
                        len % ratio,
                        (ratio, d, overlap),
                    );
                }
            }
        }
        Ok(bytes)
    }

    /// Offers to the prefix cache every block that a step completed strictly inside its
    /// chunk (the block ending at the step's end goes through [`Self::offer_block`]), using
    /// the compressor snapshots `state` carries for each boundary.
    pub fn offer_inner_blocks(
        &mut self,
        seq: &PagedSeq,
        state: &SequenceState,
        tokens: &[u32],
    ) -> Result<(), PoolError> {
        let ps = self.layout.page_size;
        if !self.prefix_enabled {
            return Ok(());
        }
        let mut lens: Vec<usize> = state
            .layers
            .iter()
            .flat_map(|l| l.boundaries.iter().map(|b| b.len))
            .filter(|&len| {
                len > 0 && len.is_multiple_of(ps) && len < seq.len && len <= tokens.len()
            })
            .collect();
        lens.sort_unstable();
        lens.dedup();
        if lens.is_empty() {
            return Ok(());
        }
        let keys = prefix::block_keys(&tokens[..*lens.last().unwrap_or(&0)], ps);
        for len in lens {
            let depth = len / ps - 1;
            let slot = self.slot_at(seq, state, len)?;
            self.prefix.insert(
                &mut self.pages,
                keys[depth],
                seq.pages[depth],
                Some(&slot),
                depth,
            )?;
        }
        Ok(())
    }

    fn region(&self, layer: usize, kind: RegionKind) -> Option<&Region> {
        self.layout.region(layer, kind)
    }

    /// Page and row of compressed row `w` of a layer with compression `ratio`: the page holding
    /// the window's last token.
    fn compressed_slot(&self, ratio: usize, w: usize) -> (usize, usize) {
        let ps = self.layout.page_size;
        ((w * ratio + ratio - 1) / ps, w % (ps / ratio).max(1))
    }

    fn read_row(
        &self,
        seq: &PagedSeq,
        region: &Region,
        page: usize,
        row: usize,
    ) -> Result<Vec<f32>, PoolError> {
        let bytes = match region.placement {
            Placement::Paged => self.pages.page(seq.pages[page])?,
            Placement::PerRequest => self.slots.page(seq.slot)?,
        };
        Ok(codec::decode(
            region.format,
            &bytes[region.row_range(row)],
            region.elements(),
        ))
    }

    fn write_row(
        &mut self,
        seq: &PagedSeq,
        region: &Region,
        page: usize,
        row: usize,
        values: &[f32],
    ) -> Result<(), PoolError> {
        let range = region.row_range(row);
        let bytes = match region.placement {
            Placement::Paged => self.pages.page_mut(seq.pages[page])?,
            Placement::PerRequest => self.slots.page_mut(seq.slot)?,
        };
        codec::encode(region.format, values, &mut bytes[range]);
        Ok(())
    }

    /// Byte offsets in the page pool (64-bit: a pool may exceed 4 GiB) of the K=V rows decode
    /// attention over a stored sequence reads in `layer`: its window rows for positions
    /// `window_from..len`, then its compressed rows `compressed` (indices of compression
    /// windows: all closed ones for HCA, the indexer's choice for CSA). This is what a device
    /// kernel reading a mirrored pool is given; the rows must be stored as f32.
    pub fn attention_row_offsets(
        &self,
        seq: &PagedSeq,
        layer: usize,
        window_from: usize,
        compressed: &[usize],
    ) -> Result<Vec<u64>, RowAddressError> {
        let spec = self
            .config
            .layers
            .get(layer)
            .ok_or(RowAddressError::NoLayer(layer))?;
        let page_bytes = self.layout.page_bytes as u64;
        let ps = self.layout.page_size;
        let at = |region: &Region, page: usize, row: usize| -> Result<u64, RowAddressError> {
            if region.format != super::layout::RowFormat::F32 {
                return Err(RowAddressError::NotF32 {
                    layer,
                    kind: region.kind,
                });
            }
            let id = *seq
                .pages
                .get(page)
                .ok_or(RowAddressError::NotReserved(page))?;
            Ok(u64::from(id) * page_bytes + region.row_range(row).start as u64)
        };
        let mut out = Vec::with_capacity(seq.len.saturating_sub(window_from) + compressed.len());
        let window = self
            .region(layer, RegionKind::WindowKv)
            .ok_or(RowAddressError::NoRegion {
                layer,
                kind: RegionKind::WindowKv,
            })?;
        for pos in window_from..seq.len {
            out.push(at(window, pos / ps, pos % ps)?);
        }
        if !compressed.is_empty() {
            let kind = match spec.attention {
                Attention::Csa { .. } => RegionKind::CsaKv,
                Attention::Hca { .. } => RegionKind::HcaKv,
                Attention::Sliding => return Err(RowAddressError::NotCompressed(layer)),
            };
            let ratio = spec.attention.ratio();
            let region = self
                .region(layer, kind)
                .ok_or(RowAddressError::NoRegion { layer, kind })?;
            for &w in compressed {
                if (w + 1) * ratio > seq.len {
                    return Err(RowAddressError::NotClosed {
                        row: w,
                        layer,
                        len: seq.len,
                    });
                }
                let (page, row) = self.compressed_slot(ratio, w);
                out.push(at(region, page, row)?);
            }
        }
        Ok(out)
    }

    /// The model state of a stored sequence.
    pub fn gather(&self, seq: &PagedSeq) -> Result<SequenceState, PoolError> {
        let c = &self.config;
        let ps = self.layout.page_size;
        let mut layers = Vec::with_capacity(c.layers.len());
        for (l, spec) in c.layers.iter().enumerate() {
            let mut state = AttentionState::new(spec.attention);
            if let Some(region) = self.region(l, RegionKind::WindowKv) {
                let first = (seq.len + 1).saturating_sub(c.sliding_window);
                for pos in first..seq.len {
                    state
                        .window
                        .extend(self.read_row(seq, region, pos / ps, pos % ps)?);
                }
            }
            let ratio = spec.attention.ratio();
            let csa = matches!(spec.attention, Attention::Csa { .. });
            if let Some(comp) = state.compressor.as_mut() {
                let kind = if csa {
                    RegionKind::CsaKv
                } else {
                    RegionKind::HcaKv
                };
                let (rows_region, state_region) = (
                    self.region(l, kind).cloned(),
                    self.region(l, RegionKind::CompressorState).cloned(),
                );
                if let (Some(rows), Some(slot)) = (rows_region, state_region) {
                    *comp = self.gather_compressor(seq, &rows, &slot, ratio, c.head_dim, csa)?;
                }
            }
            if let Some(idx) = state.indexer.as_mut() {
                let (rows_region, state_region) = (
                    self.region(l, RegionKind::IndexerKeys).cloned(),
                    self.region(l, RegionKind::IndexerCompressorState).cloned(),
                );
                if let (Some(rows), Some(slot)) = (rows_region, state_region) {
                    *idx =
                        self.gather_compressor(seq, &rows, &slot, ratio, c.index_head_dim, true)?;
                }
            }
            layers.push(state);
        }
        Ok(SequenceState {
            len: seq.len,
            layers,
        })
    }

    fn gather_compressor(
        &self,
        seq: &PagedSeq,
        rows: &Region,
        slot: &Region,
        ratio: usize,
        d: usize,
        overlap: bool,
    ) -> Result<CompressorState, PoolError> {
        let mut comp = CompressorState::default();
        for w in 0..seq.len / ratio {
            let (page, row) = self.compressed_slot(ratio, w);
            comp.rows.extend(self.read_row(seq, rows, page, row)?);
        }
        let width = if overlap { 2 * d } else { d };
        for i in 0..seq.len % ratio {
            let row = self.read_row(seq, slot, 0, i)?;
            comp.pending_kv.extend_from_slice(&row[..width]);
            comp.pending_gate.extend_from_slice(&row[width..]);
        }
        if overlap && seq.len >= ratio {
            for i in 0..ratio {
                let row = self.read_row(seq, slot, 0, ratio + i)?;
                comp.prev_kv.extend_from_slice(&row[..d]);
                comp.prev_gate.extend_from_slice(&row[width..width + d]);
            }
        }
        Ok(comp)
    }

    /// Stores what a forward step added to `state` (positions `seq.len..state.len`). The pages
    /// must have been reserved.
    pub fn scatter(&mut self, seq: &mut PagedSeq, state: &SequenceState) -> Result<(), PoolError> {
        let (from, to) = (seq.len, state.len);
        for l in 0..self.config.layers.len() {
            self.scatter_layer(seq, state, l, (from, to))?;
        }
        seq.len = to;
        Ok(())
    }

    /// Stores layer `l`'s part of a step that computed positions `from..to` (the sequence's
    /// length is not changed: [`Self::scatter`] does that once every layer is stored). Lets a
    /// layer's rows be read out of the pages while later layers are still being computed.
    pub fn scatter_layer(
        &mut self,
        seq: &PagedSeq,
        state: &SequenceState,
        l: usize,
        (from, to): (usize, usize),
    ) -> Result<(), PoolError> {
        let layer = &state.layers[l];
        let part = CompressorPart::of_state;
        // The state's window ends at position `to - 1`.
        let parts = LayerPart {
            window: &layer.window,
            compressor: layer.compressor.as_ref().map(part),
            indexer: layer.indexer.as_ref().map(part),
        };
        self.store_layer(seq, l, (from, to), &parts)
    }

    /// Stores what a step over positions `delta.from..delta.to` added (a device's read back of
    /// a prompt chunk), as [`Self::scatter`] stores a whole state. The pages must have been
    /// reserved; a delta that is not of this model's shape, or not from the sequence's end, is
    /// refused before anything is written.
    pub fn scatter_delta(
        &mut self,
        seq: &mut PagedSeq,
        delta: &StateDelta,
    ) -> Result<(), PoolError> {
        if delta.from != seq.len {
            return Err(PoolError::Mismatch(format!(
                "a delta from position {} for a sequence of {} tokens",
                delta.from, seq.len
            )));
        }
        delta.check(&self.config).map_err(PoolError::Mismatch)?;
        let (from, to) = (delta.from, delta.to);
        for (l, layer) in delta.layers.iter().enumerate() {
            let ratio = self.config.layers[l].attention.ratio();
            let part = |comp| CompressorPart::of_delta(comp, from / ratio);
            let parts = LayerPart {
                window: &layer.window,
                compressor: layer.compressor.as_ref().map(part),
                indexer: layer.indexer.as_ref().map(part),
            };
            self.store_layer(seq, l, (from, to), &parts)?;
        }
        seq.len = to;
        Ok(())
    }

    /// Stores layer `l`'s rows of positions `from..to` and its compressors' slot part.
    fn store_layer(
        &mut self,
        seq: &PagedSeq,
        l: usize,
        (from, to): (usize, usize),
        parts: &LayerPart<'_>,
    ) -> Result<(), PoolError> {
        let ps = self.layout.page_size;
        if self.pages_for(to) > seq.pages.len() {
            return Err(PoolError::OutOfPages {
                requested: self.pages_for(to) - seq.pages.len(),
                free: 0,
                total: self.pages.total(),
            });
        }
        let (head_dim, index_head_dim) = (self.config.head_dim, self.config.index_head_dim);
        let spec = self.config.layers[l];
        if let Some(region) = self.region(l, RegionKind::WindowKv).cloned() {
            // The window's rows end at position `to - 1`.
            let rows = parts.window.len() / head_dim;
            for pos in from.max(to.saturating_sub(rows))..to {
                let i = rows - (to - pos);
                let row = &parts.window[i * head_dim..(i + 1) * head_dim];
                self.write_row(seq, &region, pos / ps, pos % ps, row)?;
            }
        }
        let ratio = spec.attention.ratio();
        let csa = matches!(spec.attention, Attention::Csa { .. });
        if let Some(comp) = &parts.compressor {
            let kind = if csa {
                RegionKind::CsaKv
            } else {
                RegionKind::HcaKv
            };
            let rows = self.region(l, kind).cloned();
            let slot = self.region(l, RegionKind::CompressorState).cloned();
            if let (Some(rows), Some(slot)) = (rows, slot) {
                let shape = (ratio, head_dim, csa);
                self.scatter_compressor(seq, comp, (&rows, &slot), (from, to), shape)?;
            }
        }
        if let Some(idx) = &parts.indexer {
            let rows = self.region(l, RegionKind::IndexerKeys).cloned();
            let slot = self.region(l, RegionKind::IndexerCompressorState).cloned();
            if let (Some(rows), Some(slot)) = (rows, slot) {
                let shape = (ratio, index_head_dim, true);
                self.scatter_compressor(seq, idx, (&rows, &slot), (from, to), shape)?;
            }
        }
        Ok(())
    }

    fn scatter_compressor(
        &mut self,
        seq: &PagedSeq,
        comp: &CompressorPart<'_>,
        (rows, slot): (&Region, &Region),
        (from, to): (usize, usize),
        (ratio, d, overlap): (usize, usize, bool),
    ) -> Result<(), PoolError> {
        for w in from / ratio..to / ratio {
            let (page, row) = self.compressed_slot(ratio, w);
            let i = w - comp.first;
            self.write_row(seq, rows, page, row, &comp.rows[i * d..(i + 1) * d])?;
        }
        let slot_bytes = self.slots.page_mut(seq.slot)?;
        encode_pending(
            slot_bytes,
            slot,
            comp.pending,
            to % ratio,
            (ratio, d, overlap),
        );
        Ok(())
    }
}

/// A compressor's rows (of windows `first..`) and slot part (unfinished window's kv and gate,
/// the overlap slice's kv and gate), as a state or a delta holds them.
struct CompressorPart<'a> {
    rows: &'a [f32],
    first: usize,
    pending: (&'a [f32], &'a [f32], &'a [f32], &'a [f32]),
}

impl<'a> CompressorPart<'a> {
    fn of_state(comp: &'a CompressorState) -> Self {
        Self {
            rows: &comp.rows,
            first: 0,
            pending: (
                &comp.pending_kv,
                &comp.pending_gate,
                &comp.prev_kv,
                &comp.prev_gate,
            ),
        }
    }

    fn of_delta(comp: &'a CompressorDelta, first: usize) -> Self {
        let p = &comp.pending;
        Self {
            rows: &comp.rows,
            first,
            pending: (&p.pending_kv, &p.pending_gate, &p.prev_kv, &p.prev_gate),
        }
    }
}

/// A layer's K=V rows (ending at a step's last position) and compressors, to store.
struct LayerPart<'a> {
    window: &'a [f32],
    compressor: Option<CompressorPart<'a>>,
    indexer: Option<CompressorPart<'a>>,
}

/// Writes a compressor's slot part (`pending` rows of the unfinished window, then the overlap
/// slice) into slot bytes.
fn encode_pending(
    bytes: &mut [u8],
    slot: &Region,
    (pending_kv, pending_gate, prev_kv, prev_gate): (&[f32], &[f32], &[f32], &[f32]),
    pending: usize,
    (ratio, d, overlap): (usize, usize, bool),
) {
    let width = if overlap { 2 * d } else { d };
    let mut row = vec![0.0f32; 2 * width];
    for i in 0..pending {
        row[..width].copy_from_slice(&pending_kv[i * width..(i + 1) * width]);
        row[width..].copy_from_slice(&pending_gate[i * width..(i + 1) * width]);
        codec::encode(slot.format, &row, &mut bytes[slot.row_range(i)]);
    }
    if overlap && !prev_kv.is_empty() {
        for i in 0..ratio {
            row.fill(0.0);
            row[..d].copy_from_slice(&prev_kv[i * d..(i + 1) * d]);
            row[width..width + d].copy_from_slice(&prev_gate[i * d..(i + 1) * d]);
            codec::encode(slot.format, &row, &mut bytes[slot.row_range(ratio + i)]);
        }
    }
}
