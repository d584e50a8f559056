//! The prefix cache: full page-aligned blocks of earlier prompts, keyed by a chained hash of
//! every token up to the block's end. DeepSeek-V4's compressed rows and compressor state depend
//! on all earlier tokens, so a block is cached together with a snapshot of the request's slot
//! (the compressors' unfinished state) at the block's end: resuming from a cached prefix then
//! starts from exactly the state a full recompute would reach. A block completed inside a step
//! that computed several (a device's prompt chunk, which sends back the state at its end only)
//! is cached without a snapshot: its page serves the deeper blocks, but no request resumes at
//! its end. Pages are shared by reference count and never written once full; eviction is LRU
//! over blocks no request holds.

use std::collections::HashMap;

pub use proto::request::{BlockKey, block_keys};

use crate::pool::{PageId, PagePool, PoolError};

#[derive(Debug)]
struct Block {
    page: PageId,
    /// The request slot's bytes at the end of this block; none where the step that completed
    /// it went on past its end (a request cannot resume there).
    slot: Option<Vec<u8>>,
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
    /// Longest cached prefix of `keys` that a request can resume from (its last block has a
    /// slot snapshot), limited to `max_blocks`; retains the pages.
    pub fn lookup(
        &mut self,
        pages: &mut PagePool,
        keys: &[BlockKey],
        max_blocks: usize,
    ) -> Result<Option<Hit>, PoolError> {
        self.tick += 1;
        self.lookups += 1;
        let depth = self.resumable(&keys[..keys.len().min(max_blocks)]);
        let Some(slot) = depth
            .checked_sub(1)
            .and_then(|last| self.blocks.get(&keys[last]))
            .and_then(|b| b.slot.clone())
        else {
            return Ok(None);
        };
        self.hits += 1;
        let mut out = Vec::with_capacity(depth);
        for key in &keys[..depth] {
            if let Some(block) = self.blocks.get_mut(key) {
                block.last_used = self.tick;
                pages.retain(block.page)?;
                out.push(block.page);
            }
        }
        Ok(Some(Hit { pages: out, slot }))
    }

    /// How many of `keys`, from the first, a request could resume from: the cached run's
    /// deepest block with a slot snapshot (a read: no page is retained and the cache's
    /// statistics do not change).
    pub fn cached_blocks(&self, keys: &[BlockKey]) -> usize {
        self.resumable(keys)
    }

    fn resumable(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .map_while(|key| self.blocks.get(key))
            .enumerate()
            .filter(|(_, b)| b.slot.is_some())
            .last()
            .map_or(0, |(i, _)| i + 1)
    }

    /// Records block `depth` of a sequence (its page and the slot at the block's end, where
    /// known), unless already cached; a cached block without a slot gets this one. The cache
    /// takes its own reference on the page.
    pub fn insert(
        &mut self,
        pages: &mut PagePool,
        key: BlockKey,
        page: PageId,
        slot: Option<&[u8]>,
        depth: usize,
    ) -> Result<(), PoolError> {
        self.tick += 1;
        if let Some(block) = self.blocks.get_mut(&key) {
            block.last_used = self.tick;
            if block.slot.is_none() {
                block.slot = slot.map(<[u8]>::to_vec);
            }
            return Ok(());
        }
        pages.retain(page)?;
        self.blocks.insert(
            key,
            Block {
                page,
                slot: slot.map(<[u8]>::to_vec),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;

    /// A run of cached blocks resumes at its deepest block with a slot: blocks without one
    /// (completed inside a longer step) lend their pages to the deeper blocks only, and a
    /// later offer of the same block with its slot makes it resumable.
    #[test]
    fn a_prefix_resumes_at_its_deepest_block_with_a_slot() {
        let mut pages = PagePool::new(8, 16);
        let mut cache = PrefixCache::default();
        let tokens: Vec<u32> = (0..16).collect();
        let keys = block_keys(&tokens, 4);
        let held = pages.alloc(4).unwrap();
        for (depth, slot) in [(0, None), (1, Some(&[1u8][..])), (2, None)] {
            cache
                .insert(&mut pages, keys[depth], held[depth], slot, depth)
                .unwrap();
        }
        assert_eq!(cache.cached_blocks(&keys), 2);
        let hit = cache.lookup(&mut pages, &keys, 4).unwrap().unwrap();
        assert_eq!((hit.pages, hit.slot), (held[..2].to_vec(), vec![1]));
        assert!(cache.lookup(&mut pages, &keys[..1], 4).unwrap().is_none());
        assert!(cache.lookup(&mut pages, &keys, 1).unwrap().is_none());
        assert_eq!(cache.stats(), (3, 1));
        cache
            .insert(&mut pages, keys[2], held[2], Some(&[3]), 2)
            .unwrap();
        let hit = cache.lookup(&mut pages, &keys, 4).unwrap().unwrap();
        assert_eq!((hit.pages.len(), hit.slot), (3, vec![3]));
        // A block already resumable keeps its slot.
        cache
            .insert(&mut pages, keys[1], held[1], Some(&[9]), 1)
            .unwrap();
        assert_eq!(
            cache
                .lookup(&mut pages, &keys[..2], 4)
                .unwrap()
                .unwrap()
                .slot,
            vec![1]
        );
    }
}
