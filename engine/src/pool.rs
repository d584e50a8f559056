//! The page pool: fixed-size pages of request state, reference-counted so a prefix-cache block
//! can be shared by many requests. Allocation is all-or-nothing (a request never holds half of
//! what it asked for), and every misuse — releasing a free page, writing a shared page — is an
//! error rather than silent corruption.

/// Index of a page in its pool. 64-bit byte offsets are computed from it (`page * page_bytes`).
pub type PageId = u32;

/// Pool misuse or exhaustion.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("out of pages: {requested} requested, {free} free of {total}")]
    OutOfPages {
        requested: usize,
        free: usize,
        total: usize,
    },
    #[error("page {0} is not allocated")]
    NotAllocated(PageId),
    #[error("page {page} is shared by {refs} holders and cannot be written")]
    Shared { page: PageId, refs: u32 },
    /// State to store that does not fit the sequence or the model (what a device sent back).
    #[error("state that does not fit: {0}")]
    Mismatch(String),
}

/// A pool of `num_pages` pages of `page_bytes` bytes.
#[derive(Debug)]
pub struct PagePool {
    page_bytes: usize,
    data: Vec<u8>,
    refs: Vec<u32>,
    /// Free pages; popped from the end, so recently freed pages are reused first (warm).
    free: Vec<PageId>,
}

impl PagePool {
    pub fn new(num_pages: u32, page_bytes: usize) -> Self {
        Self {
            page_bytes,
            data: vec![0; num_pages as usize * page_bytes],
            refs: vec![0; num_pages as usize],
            free: (0..num_pages).rev().collect(),
        }
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Byte offset of a page in the pool's memory (what a remote writer addresses).
    pub fn offset(&self, page: PageId) -> u64 {
        u64::from(page) * self.page_bytes as u64
    }

    /// The pool's memory (base address, length): one allocation that never moves or changes
    /// size, so a transport can register it for remote writes into reserved pages. Nothing in
    /// this process touches a reserved page until its request is committed.
    pub fn memory(&mut self) -> (usize, usize) {
        (self.data.as_mut_ptr() as usize, self.data.len())
    }

    /// Allocates `n` zeroed pages with one reference each, or none at all.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::OutOfPages {
                requested: n,
                free: self.free.len(),
                total: self.total(),
            });
        }
        let pages = self.free.split_off(self.free.len() - n);
        for &p in &pages {
            self.refs[p as usize] = 1;
            let at = p as usize * self.page_bytes;
            self.data[at..at + self.page_bytes].fill(0);
        }
        Ok(pages)
    }

    /// Adds a holder to an allocated page (sharing).
    pub fn retain(&mut self, page: PageId) -> Result<(), PoolError> {
        match self.refs.get_mut(page as usize) {
            Some(r) if *r > 0 => {
                *r += 1;
                Ok(())
            }
            _ => Err(PoolError::NotAllocated(page)),
        }
    }

    /// Drops a holder; the page is free when the last one is gone.
    pub fn release(&mut self, page: PageId) -> Result<(), PoolError> {
        match self.refs.get_mut(page as usize) {
            Some(r) if *r > 0 => {
                *r -= 1;
                if *r == 0 {
                    self.free.push(page);
                }
                Ok(())
            }
            _ => Err(PoolError::NotAllocated(page)),
        }
    }

    pub fn refs(&self, page: PageId) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    /// Reads an allocated page.
    pub fn page(&self, page: PageId) -> Result<&[u8], PoolError> {
        if self.refs(page) == 0 {
            return Err(PoolError::NotAllocated(page));
        }
        let at = page as usize * self.page_bytes;
        Ok(&self.data[at..at + self.page_bytes])
    }

    /// Writes a page held by exactly one holder (shared pages are immutable).
    pub fn page_mut(&mut self, page: PageId) -> Result<&mut [u8], PoolError> {
        match self.refs(page) {
            0 => Err(PoolError::NotAllocated(page)),
            1 => {
                let at = page as usize * self.page_bytes;
                Ok(&mut self.data[at..at + self.page_bytes])
            }
            refs => Err(PoolError::Shared { page, refs }),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn all_or_nothing_and_clear_errors() {
        let mut pool = PagePool::new(4, 16);
        let a = pool.alloc(3).unwrap();
        let err = pool.alloc(2).unwrap_err();
        assert_eq!(err.to_string(), "out of pages: 2 requested, 1 free of 4");
        assert_eq!(pool.free_count(), 1, "failed allocation took nothing");
        pool.retain(a[0]).unwrap();
        assert!(matches!(
            pool.page_mut(a[0]),
            Err(PoolError::Shared { refs: 2, .. })
        ));
        pool.release(a[0]).unwrap();
        pool.page_mut(a[0]).unwrap()[0] = 7;
        for p in a {
            pool.release(p).unwrap();
        }
        assert_eq!(pool.release(0), Err(PoolError::NotAllocated(0)));
        assert_eq!(pool.free_count(), 4);
        let again = pool.alloc(4).unwrap();
        assert!(
            again
                .iter()
                .all(|&p| pool.page(p).unwrap().iter().all(|&b| b == 0))
        );
        assert_eq!(pool.offset(3), 48);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Extend(usize, usize),
        Fork(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..5).prop_map(Op::Alloc),
            (0usize..8, 0usize..4).prop_map(|(t, n)| Op::Extend(t, n)),
            (0usize..8).prop_map(Op::Fork),
            (0usize..8).prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random interleavings of allocate / extend / fork (share) / free never leak or
        /// double-free: reference counts always equal the number of tables holding a page,
        /// and freeing every table returns the pool to empty.
        #[test]
        fn interleavings_never_leak(ops in prop::collection::vec(op(), 1..80)) {
            let mut pool = PagePool::new(24, 8);
            let mut tables: Vec<Vec<PageId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        if let Ok(pages) = pool.alloc(n) {
                            tables.push(pages);
                        }
                    }
                    Op::Extend(t, n) if !tables.is_empty() => {
                        let t = t % tables.len();
                        if let Ok(pages) = pool.alloc(n) {
                            tables[t].extend(pages);
                        }
                    }
                    Op::Fork(t) if !tables.is_empty() => {
                        let fork = tables[t % tables.len()].clone();
                        for &p in &fork {
                            pool.retain(p).unwrap();
                        }
                        tables.push(fork);
                    }
                    Op::Free(t) if !tables.is_empty() => {
                        for p in tables.swap_remove(t % tables.len()) {
                            pool.release(p).unwrap();
                        }
                    }
                    _ => {}
                }
                let mut holders = vec![0u32; pool.total()];
                for table in &tables {
                    for &p in table {
                        holders[p as usize] += 1;
                    }
                }
                for (p, &h) in holders.iter().enumerate() {
                    prop_assert_eq!(pool.refs(p as PageId), h);
                }
                prop_assert_eq!(pool.used_count(), holders.iter().filter(|&&h| h > 0).count());
            }
            for table in tables {
                for p in table {
                    pool.release(p).unwrap();
                }
            }
            prop_assert_eq!(pool.free_count(), pool.total());
        }
    }
}
