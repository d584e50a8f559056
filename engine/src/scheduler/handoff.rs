//! Moving a request between engines at the prefill/decode boundary. A prefill worker's engine
//! runs a prompt like any request (chunked, batched, prefix-cached), samples the first token,
//! and exports the prompt's state as the bytes of its pages and state slot; a decode worker's
//! engine reserves pages for that state plus headroom, receives the bytes (written by a
//! transport at the offsets it published), and on commit continues exactly where the prefill
//! left off: same state bytes, same random stream, so the tokens equal a one-engine run.

use super::{Engine, EngineError, Event, GenerationRequest, Running, Usage};
use std::ops::Range;

use crate::{
    model::SequenceState,
    paged::store::{PagedSeq, PagedStore},
    pool::{PageId, PoolError},
};

/// A prompt's state in an engine's layout: the bytes of the pages holding the prompt (page
/// `i` holds tokens `[i * page_size, (i + 1) * page_size)`) and of the per-request slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptState {
    pub prompt_len: usize,
    pub pages: Vec<Vec<u8>>,
    pub slot: Vec<u8>,
}

impl PromptState {
    /// Bytes of state in total.
    pub fn bytes(&self) -> usize {
        self.pages.iter().map(Vec::len).sum::<usize>() + self.slot.len()
    }
}

/// Bytes for one of a request's pages (`page`: its index in the request's page sequence) or,
/// with `page` `None`, for its state slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateWrite {
    pub page: Option<usize>,
    pub offset: usize,
    pub bytes: Vec<u8>,
}

/// Before a prefill-only request's first chunk (`start` == its cached tokens): the pages the
/// prefix cache supplied, which are final.
pub(super) fn cached_part(
    store: &PagedStore,
    r: &Running,
    start: usize,
) -> Result<Option<Event>, PoolError> {
    let pages = start / store.layout.page_size;
    if start != r.cached || r.seq.len != r.cached || pages == 0 {
        return Ok(None);
    }
    let writes = r.seq.pages[..pages]
        .iter()
        .enumerate()
        .map(|(page, &p)| {
            Ok(StateWrite {
                page: Some(page),
                offset: 0,
                bytes: store.pages().page(p)?.to_vec(),
            })
        })
        .collect::<Result<Vec<_>, PoolError>>()?;
    Ok(Some(Event::StatePart { id: r.id, writes }))
}

/// After layer `l` computed positions `range` of a prefill-only request: stores the layer's
/// rows in the request's pages and returns them (the layer's bytes of every page the range
/// touches). After the last layer of the prompt's last chunk the slot is final too (every
/// layer has stored its part of it) and goes with them.
pub(super) fn layer_part(
    store: &mut PagedStore,
    r: &Running,
    state: &SequenceState,
    l: usize,
    range: &Range<usize>,
) -> Result<Option<Event>, PoolError> {
    if range.is_empty() {
        return Ok(None);
    }
    store.scatter_layer(&r.seq, state, l, (range.start, range.end))?;
    let ps = store.layout.page_size;
    let mut writes = Vec::new();
    if let Some(bytes) = store.layout.layer_page_bytes(l) {
        for page in range.start / ps..=(range.end - 1) / ps {
            let data = store.pages().page(r.seq.pages[page])?;
            writes.push(StateWrite {
                page: Some(page),
                offset: bytes.start,
                bytes: data[bytes.clone()].to_vec(),
            });
        }
    }
    if range.end == r.prompt_len && l + 1 == state.layers.len() {
        writes.push(StateWrite {
            page: None,
            offset: 0,
            bytes: store.slots().page(r.seq.slot)?.to_vec(),
        });
    }
    Ok((!writes.is_empty()).then_some(Event::StatePart { id: r.id, writes }))
}

/// After a device computed positions `range` of a prefill-only request and what it added was
/// stored in the request's pages: the pages the range touched, whole (every layer's rows of
/// them are final up to `range.end`), and after the prompt's last chunk the slot.
pub(super) fn chunk_part(
    store: &PagedStore,
    r: &Running,
    range: &Range<usize>,
) -> Result<Option<Event>, PoolError> {
    if range.is_empty() {
        return Ok(None);
    }
    let ps = store.layout.page_size;
    let mut writes = Vec::new();
    for page in range.start / ps..=(range.end - 1) / ps {
        writes.push(StateWrite {
            page: Some(page),
            offset: 0,
            bytes: store.pages().page(r.seq.pages[page])?.to_vec(),
        });
    }
    if range.end == r.prompt_len {
        writes.push(StateWrite {
            page: None,
            offset: 0,
            bytes: store.slots().page(r.seq.slot)?.to_vec(),
        });
    }
    Ok(Some(Event::StatePart { id: r.id, writes }))
}

/// Pages reserved for a request whose prompt state another worker writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub id: u64,
    pub prompt_len: usize,
    /// Capacity in tokens (prompt plus decode headroom).
    pub capacity: usize,
    /// Pool pages in sequence order with their byte offsets in the page pool.
    pub pages: Vec<(PageId, u64)>,
    /// The state slot and its byte offset in the slot pool.
    pub slot: (PageId, u64),
}

/// The `Prefilled` event of a prefill-only request that just sampled its first token.
pub(super) fn export(store: &PagedStore, r: &Running) -> Result<Event, PoolError> {
    let n = store.pages_for(r.prompt_len);
    let pages = r.seq.pages[..n]
        .iter()
        .map(|&p| store.pages().page(p).map(<[u8]>::to_vec))
        .collect::<Result<Vec<_>, _>>()?;
    let slot = store.slots().page(r.seq.slot)?.to_vec();
    Ok(Event::Prefilled {
        id: r.id,
        state: PromptState {
            prompt_len: r.prompt_len,
            pages,
            slot,
        },
        seed: r.sampler.seed(),
        cached_tokens: r.cached,
        finish: r.sampler.finish(),
    })
}

/// A handoff call that does not fit the reservation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandoffError {
    #[error("no reservation {0}")]
    UnknownReservation(u64),
    #[error("request {0} already exists")]
    Duplicate(u64),
    #[error("write outside the reservation: {0}")]
    OutOfBounds(String),
    #[error("commit does not match the reservation: {0}")]
    Mismatch(String),
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl Engine {
    /// Queues a prefill-only request: it is scheduled like any other (only its prompt's pages
    /// are reserved), and after its first token the engine emits `Token` (index 0) and
    /// `Prefilled` with the exported state, then releases its pages.
    pub fn add_prefill(&mut self, req: GenerationRequest) -> Result<(), EngineError> {
        self.enqueue(req, true)
    }

    /// Reserves a slot and pages for `prompt_len + max_tokens` tokens, for a request whose
    /// prompt state will be written from outside. All or nothing.
    pub fn reserve(
        &mut self,
        id: u64,
        prompt_len: usize,
        max_tokens: usize,
    ) -> Result<Reservation, EngineError> {
        if prompt_len == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        let known = self.running.iter().any(|r| r.id == id)
            || self.waiting.iter().any(|(w, ..)| w.id == id)
            || self.reserved.iter().any(|(r, _)| *r == id);
        if known {
            return Err(EngineError::DuplicateId(id));
        }
        let capacity = prompt_len + max_tokens;
        let limit = self.model.config.max_position_embeddings;
        if capacity > limit {
            return Err(EngineError::TooLong {
                tokens: capacity,
                limit,
            });
        }
        let needed = self.store.pages_for(capacity);
        if needed > self.store.pages().total() {
            return Err(EngineError::TooLarge {
                needed,
                tokens: capacity,
                total: self.store.pages().total(),
            });
        }
        let mut seq = self.store.open().map_err(EngineError::Pool)?;
        if let Err(e) = self.store.reserve(&mut seq, capacity) {
            let _ = self.store.release(seq);
            return Err(EngineError::Pool(e));
        }
        let reservation = Reservation {
            id,
            prompt_len,
            capacity,
            pages: seq
                .pages
                .iter()
                .map(|&p| (p, self.store.pages().offset(p)))
                .collect(),
            slot: (seq.slot, self.store.slots().offset(seq.slot)),
        };
        self.reserved.push((id, seq));
        Ok(reservation)
    }

    /// Releases a reservation that was not committed; false if there is none.
    pub fn release_reservation(&mut self, id: u64) -> bool {
        let Some(i) = self.reserved.iter().position(|(r, _)| *r == id) else {
            return false;
        };
        let (_, seq) = self.reserved.swap_remove(i);
        // The pages were allocated by this store; releasing them cannot fail.
        let _ = self.store.release(seq);
        true
    }

    /// The page pool's and the slot pool's memory (base address, length), for a transport
    /// that writes reserved pages remotely (see [`crate::pool::PagePool::memory`]).
    pub fn state_memory(&mut self) -> [(usize, usize); 2] {
        [
            self.store.pages_mut().memory(),
            self.store.slots_mut().memory(),
        ]
    }

    /// Reservations waiting for their state.
    pub fn reservations(&self) -> usize {
        self.reserved.len()
    }

    fn reservation(&self, id: u64) -> Result<&PagedSeq, HandoffError> {
        self.reserved
            .iter()
            .find(|(r, _)| *r == id)
            .map(|(_, seq)| seq)
            .ok_or(HandoffError::UnknownReservation(id))
    }

    /// Writes `bytes` at `offset` of the reservation's `index`-th page (or of its slot when
    /// `index` is `None`).
    pub fn write_state(
        &mut self,
        id: u64,
        index: Option<usize>,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), HandoffError> {
        let seq = self.reservation(id)?;
        let (slot, page) = (seq.slot, index.map(|i| seq.pages.get(i).copied()));
        let target = match page {
            None => self.store.slots_mut().page_mut(slot)?,
            Some(Some(page)) => self.store.pages_mut().page_mut(page)?,
            Some(None) => {
                return Err(HandoffError::OutOfBounds(format!(
                    "page {} of {}",
                    index.unwrap_or_default(),
                    seq.pages.len()
                )));
            }
        };
        let end = offset
            .checked_add(bytes.len())
            .filter(|&end| end <= target.len())
            .ok_or_else(|| {
                HandoffError::OutOfBounds(format!(
                    "{} bytes at offset {offset} of a {}-byte page",
                    bytes.len(),
                    target.len()
                ))
            })?;
        target[offset..end].copy_from_slice(bytes);
        Ok(())
    }

    /// The bytes of a reservation's page (by pool page number) or of its slot (`None`), to
    /// verify what a transport wrote.
    pub fn reserved_bytes(&self, id: u64, page: Option<u64>) -> Result<&[u8], HandoffError> {
        let seq = self.reservation(id)?;
        match page {
            None => Ok(self.store.slots().page(seq.slot)?),
            Some(p) => {
                let page = seq
                    .pages
                    .iter()
                    .copied()
                    .find(|&q| u64::from(q) == p)
                    .ok_or_else(|| {
                        HandoffError::OutOfBounds(format!("page {p} is not reserved"))
                    })?;
                Ok(self.store.pages().page(page)?)
            }
        }
    }

    /// Writes a whole exported state into a reservation (the in-process transport).
    pub fn import(&mut self, id: u64, state: &PromptState) -> Result<(), HandoffError> {
        let seq = self.reservation(id)?;
        if state.pages.len() != self.store.pages_for(state.prompt_len)
            || state.pages.len() > seq.pages.len()
        {
            return Err(HandoffError::Mismatch(format!(
                "{} pages for a {}-token prompt",
                state.pages.len(),
                state.prompt_len
            )));
        }
        for (i, page) in state.pages.iter().enumerate() {
            self.write_state(id, Some(i), 0, page)?;
        }
        self.write_state(id, None, 0, &state.slot)
    }

    /// Turns a reservation whose state has been written into a running request that continues
    /// after `first` (the token the prefill sampled with the same random stream). `req` is
    /// the full request (prompt, sampling, stop) under the reservation's id. Returns
    /// `Finished` at once when the first token already ends the request.
    pub fn commit(
        &mut self,
        req: GenerationRequest,
        first: u32,
        seed: u64,
    ) -> Result<Option<Event>, EngineError> {
        let Some(i) = self.reserved.iter().position(|(r, _)| *r == req.id) else {
            return Err(EngineError::Handoff(HandoffError::UnknownReservation(
                req.id,
            )));
        };
        let prompt_len = req.prompt.len();
        let capacity = self.reserved[i].1.pages.len() * self.store.layout.page_size;
        let total = prompt_len + req.stop.max_tokens as usize;
        if prompt_len == 0 || total > capacity {
            return Err(EngineError::Handoff(HandoffError::Mismatch(format!(
                "{prompt_len} prompt tokens + {} new tokens do not fit the reserved {capacity}",
                req.stop.max_tokens
            ))));
        }
        let mut sampling = req.sampling.clone();
        sampling.seed = Some(seed);
        let mut sampler = self.sampler(sampling, req.stop.clone(), &req.prompt, seed)?;
        sampler.resume(&[first])?;
        let (id, mut seq) = self.reserved.swap_remove(i);
        seq.len = prompt_len;
        if let Some(reason) = sampler.finish() {
            let _ = self.store.release(seq);
            return Ok(Some(Event::Finished {
                id,
                reason,
                usage: Usage {
                    prompt_tokens: prompt_len,
                    cached_tokens: 0,
                    completion_tokens: 1,
                },
            }));
        }
        let mut tokens = req.prompt;
        tokens.push(first);
        self.running.push(Running {
            id,
            tokens,
            prompt_len,
            cached: 0,
            seq,
            sampler,
            handoff: false,
            // The prompt was computed on the prefill worker, which reported them.
            prompt_logprobs: None,
            prompt_entries: Vec::new(),
            slot: None,
        });
        Ok(None)
    }
}
