//! The prefix cache: full page-aligned blocks of earlier prompts, keyed by a chained hash of
//! every token up to the block's end. DeepSeek-V4's compressed rows and compressor state depend
//! on all earlier tokens, so a block is cached together with a snapshot of the request's slot
//! (the compressors' unfinished state) at the block's end: resuming from a cached prefix then
//! starts from exactly the state a full recompute would reach. Pages are shared by reference
//! count and never written once full; eviction is LRU over blocks no request holds.

use std::collections::HashMap;

pub use proto::request::{BlockKey, block_keys};

use crate::pool::{PageId, PagePool, PoolError};

#[derive(Debug)]
struct Block {
    page: PageId,
    /// The request slot's bytes at the end of this block.
    slot: Vec<u8>,
    last_used: u64,
    /// Block index in its sequence (deeper blocks are evicted first on ties).
    depth: usize,
}

/// Cached blocks.
#[derive(Debug, Default)]
pub struct PrefixCache {
    blocks: HashMap<BlockKey, Block>,
    tick: u64,
    hits: u64,
    lookups: u64,
}

/// A cache hit: the pages (each retained for the caller) and the slot snapshot to start from.
#[derive(Debug)]
pub struct Hit {
    pub pages: Vec<PageId>,
    pub slot: Vec<u8>,
}

impl PrefixCache {
    /// Longest cached prefix of `keys`, limited to `max_blocks`; retains the pages.
    pub fn lookup(
        &mut self,
        pages: &mut PagePool,
        keys: &[BlockKey],
        max_blocks: usize,
    ) -> Result<Option<Hit>, PoolError> {
        self.tick += 1;
        self.lookups += 1;
        let mut matched = Vec::new();
        for key in keys.iter().take(max_blocks) {
            match self.blocks.get(key) {
                Some(_) => matched.push(*key),
                None => break,
            }
        }
        let Some(last) = matched.last() else {
            return Ok(None);
        };
        self.hits += 1;
        let slot = self.blocks[last].slot.clone();
        let mut out = Vec::with_capacity(matched.len());
        for key in &matched {
            if let Some(block) = self.blocks.get_mut(key) {
                block.last_used = self.tick;
                pages.retain(block.page)?;
                out.push(block.page);
            }
        }
        Ok(Some(Hit { pages: out, slot }))
    }

    /// How many of `keys`, from the first, are cached (a read: no page is retained and the
    /// cache's statistics do not change).
    pub fn cached_blocks(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|key| self.blocks.contains_key(*key))
            .count()
    }

    /// Records block `depth` of a sequence (its page and the slot at the block's end), unless
    /// already cached. The cache takes its own reference on the page.
    pub fn insert(
        &mut self,
        pages: &mut PagePool,
        key: BlockKey,
        page: PageId,
        slot: &[u8],
        depth: usize,
    ) -> Result<(), PoolError> {
        self.tick += 1;
        if let Some(block) = self.blocks.get_mut(&key) {
            block.last_used = self.tick;
            return Ok(());
        }
        pages.retain(page)?;
        self.blocks.insert(
            key,
            Block {
                page,
                slot: slot.to_vec(),
                last_used: self.tick,
                depth,
            },
        );
        Ok(())
    }

    /// Frees up to `want` pages by dropping the least recently used blocks that no request
    /// holds; returns how many pages were freed.
    pub fn evict(&mut self, pages: &mut PagePool, want: usize) -> Result<usize, PoolError> {
        let mut candidates: Vec<(u64, std::cmp::Reverse<usize>, BlockKey)> = self
            .blocks
            .iter()
            .filter(|(_, b)| pages.refs(b.page) == 1)
            .map(|(k, b)| (b.last_used, std::cmp::Reverse(b.depth), *k))
            .collect();
        candidates.sort_unstable();
        let mut freed = 0;
        for (_, _, key) in candidates.into_iter().take(want) {
            if let Some(block) = self.blocks.remove(&key) {
                pages.release(block.page)?;
                freed += 1;
            }
        }
        Ok(freed)
    }

    /// Drops every block (pages held by requests stay with them).
    pub fn clear(&mut self, pages: &mut PagePool) -> Result<(), PoolError> {
        for (_, block) in self.blocks.drain() {
            pages.release(block.page)?;
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Pages held only by the cache (evictable).
    pub fn evictable(&self, pages: &PagePool) -> usize {
        self.blocks
            .values()
            .filter(|b| pages.refs(b.page) == 1)
            .count()
    }

    /// (lookups, lookups that hit at least one block).
    pub fn stats(&self) -> (u64, u64) {
        (self.lookups, self.hits)
    }
}
