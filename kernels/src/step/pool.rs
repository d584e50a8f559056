//! Device buffers a decode step reuses instead of allocating: activations come from a
//! [`BufPool`] as [`StepBuf`]s that go back to it when dropped, and the step's plans (row
//! offsets, counts, rotation tables) are written into buffers a [`PlanStore`] keeps from step
//! to step. After the first step of a batch size a step makes no device buffer, and the same
//! sequence of requests gets the same buffers in the same order: what a CUDA graph needs (its
//! launches name fixed addresses), and what keeps a step free of allocations and their
//! synchronisation.

use std::{
    collections::{BTreeMap, HashMap},
    hash::Hash,
    mem::ManuallyDrop,
    ops::{Deref, DerefMut},
    sync::{Arc, Mutex, PoisonError},
};

/// The capacity a request of `len` values gets: a power of two (at least 16), so batch sizes
/// near each other share buffers and a pool holds a few sizes, not one per batch size.
pub fn size_class(len: usize) -> usize {
    len.max(16).next_power_of_two()
}

/// Free buffers by capacity, taken last in, first out (so the same requests in the same order
/// get the same buffers).
#[derive(Debug)]
pub struct BufPool<B> {
    free: Mutex<BTreeMap<usize, Vec<B>>>,
}

impl<B> Default for BufPool<B> {
    fn default() -> Self {
        Self {
            free: Mutex::new(BTreeMap::new()),
        }
    }
}

impl<B> BufPool<B> {
    /// A free buffer of capacity `class`, if there is one.
    fn take(&self, class: usize) -> Option<B> {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&class)
            .and_then(Vec::pop)
    }

    fn give(&self, class: usize, buf: B) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(class)
            .or_default()
            .push(buf);
    }

    /// Buffers waiting to be reused.
    pub fn free_count(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(Vec::len)
            .sum()
    }
}

/// A buffer of `len` values with the capacity of its size class, from `pool` (or made by
/// `make` when the pool has none of that class). It goes back to the pool when dropped.
pub fn take<B, E>(
    pool: &Arc<BufPool<B>>,
    len: usize,
    make: impl FnOnce(usize) -> Result<B, E>,
) -> Result<StepBuf<B>, E> {
    let class = size_class(len);
    let buf = match pool.take(class) {
        Some(buf) => buf,
        None => make(class)?,
    };
    Ok(StepBuf {
        buf: ManuallyDrop::new(buf),
        home: Some((class, Arc::clone(pool))),
    })
}

/// A device buffer of a step: back to its pool when dropped, or (made by [`StepBuf::kept`],
/// as the arenas are) freed then.
#[derive(Debug)]
pub struct StepBuf<B> {
    /// Taken out once, by `drop`.
    buf: ManuallyDrop<B>,
    home: Option<(usize, Arc<BufPool<B>>)>,
}

impl<B> StepBuf<B> {
    /// A buffer that is no pool's (its length exactly what was asked).
    pub fn kept(buf: B) -> Self {
        Self {
            buf: ManuallyDrop::new(buf),
            home: None,
        }
    }
}

impl<B> Deref for StepBuf<B> {
    type Target = B;
    fn deref(&self) -> &B {
        &self.buf
    }
}

impl<B> DerefMut for StepBuf<B> {
    fn deref_mut(&mut self) -> &mut B {
        &mut self.buf
    }
}

impl<B> Drop for StepBuf<B> {
    fn drop(&mut self) {
        // SAFETY: `buf` is taken here, once, and never read again.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        if let Some((class, pool)) = self.home.take() {
            pool.give(class, buf);
        }
    }
}

/// Read-only plans of a step on the device, written into buffers kept from step to step: the
/// same values twice in a step share one buffer (the layers of a kind have the same plans),
/// and [`PlanStore::begin_step`] frees them all for the next step.
#[derive(Debug)]
pub struct PlanStore<B, T> {
    /// The buffers written this step, in order, with their classes.
    used: Vec<(usize, Arc<B>)>,
    /// Which of `used` holds these values.
    by_values: HashMap<Vec<T>, usize>,
    free: BTreeMap<usize, Vec<B>>,
}

impl<B, T> Default for PlanStore<B, T> {
    fn default() -> Self {
        Self {
            used: Vec::new(),
            by_values: HashMap::new(),
            free: BTreeMap::new(),
        }
    }
}

impl<B, T: Clone + Eq + Hash> PlanStore<B, T> {
    /// The step's buffers are free again, to be taken in the order this step took them.
    pub fn begin_step(&mut self) {
        self.by_values.clear();
        for (class, buf) in self.used.drain(..).rev() {
            // A plan still held past its step (none is, but then it is not reused).
            if let Ok(buf) = Arc::try_unwrap(buf) {
                self.free.entry(class).or_default().push(buf);
            }
        }
    }

    /// `values` in a buffer of the device: the one written with them this step, or a kept
    /// buffer (made by `make` if none is free) written with `write`.
    pub fn plan<E>(
        &mut self,
        values: &[T],
        make: impl FnOnce(usize) -> Result<B, E>,
        write: impl FnOnce(&mut B, &[T]) -> Result<(), E>,
    ) -> Result<Arc<B>, E> {
        if let Some(&i) = self.by_values.get(values) {
            return Ok(Arc::clone(&self.used[i].1));
        }
        let (class, buf) = self.scratch(values, make, write)?;
        let kept = self.keep(class, buf);
        self.by_values.insert(values.to_vec(), self.used.len() - 1);
        Ok(kept)
    }

    /// A buffer of its own written with `values` (a kernel writes into it before the others
    /// read it), with its class for [`Self::keep`].
    pub fn scratch<E>(
        &mut self,
        values: &[T],
        make: impl FnOnce(usize) -> Result<B, E>,
        write: impl FnOnce(&mut B, &[T]) -> Result<(), E>,
    ) -> Result<(usize, B), E> {
        let class = size_class(values.len());
        let mut buf = match self.free.get_mut(&class).and_then(Vec::pop) {
            Some(buf) => buf,
            None => make(class)?,
        };
        if !values.is_empty() {
            write(&mut buf, values)?;
        }
        Ok((class, buf))
    }

    /// `buf` (from [`Self::scratch`]) used this step, freed at the next.
    pub fn keep(&mut self, class: usize, buf: B) -> Arc<B> {
        let buf = Arc::new(buf);
        self.used.push((class, Arc::clone(&buf)));
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_covering_the_length() {
        for len in [0, 1, 15, 16, 17, 1000, 1024, 1025] {
            let class = size_class(len);
            assert!(class >= len && class >= 16 && class.is_power_of_two());
            assert!(class < 2 * len.max(16));
        }
    }

    /// The same requests in the same order get the same buffers, step after step.
    #[test]
    fn the_same_requests_get_the_same_buffers() {
        let pool = Arc::new(BufPool::<Vec<f32>>::default());
        let made = std::cell::Cell::new(0);
        let make = |class: usize| -> Result<Vec<f32>, ()> {
            made.set(made.get() + 1);
            Ok(vec![0.0; class])
        };
        let step = || {
            let a = take(&pool, 10, make).unwrap();
            let b = take(&pool, 100, make).unwrap();
            let ids = vec![a.as_ptr(), b.as_ptr()];
            drop(a);
            let c = take(&pool, 12, make).unwrap();
            let mut ids = ids;
            ids.push(c.as_ptr());
            assert!(c.len() >= 12 && b.len() >= 100);
            ids
        };
        let first = step();
        assert_eq!(made.get(), 2, "the third request reuses the first's buffer");
        assert_eq!(first[0], first[2]);
        let second = step();
        assert_eq!(made.get(), 2, "no buffer made in a second step");
        assert_eq!(first, second);
        assert_eq!(pool.free_count(), 2);
        let kept = StepBuf::kept(vec![1.0f32; 3]);
        drop(kept);
        assert_eq!(pool.free_count(), 2, "a kept buffer is no pool's");
    }

    #[test]
    fn plans_are_shared_within_a_step_and_reused_by_the_next() {
        let mut store = PlanStore::<Vec<i64>, i64>::default();
        let made = std::cell::Cell::new(0);
        let make = |class: usize| -> Result<Vec<i64>, ()> {
            made.set(made.get() + 1);
            Ok(vec![0; class])
        };
        let write = |b: &mut Vec<i64>, v: &[i64]| -> Result<(), ()> {
            b[..v.len()].copy_from_slice(v);
            Ok(())
        };
        let mut step = |values: [&[i64]; 3]| {
            store.begin_step();
            let bufs: Vec<Arc<Vec<i64>>> = values
                .iter()
                .map(|v| store.plan(v, make, write).unwrap())
                .collect();
            for (b, v) in bufs.iter().zip(values) {
                assert_eq!(&b[..v.len()], v);
            }
            bufs.iter().map(|b| b.as_ptr()).collect::<Vec<_>>()
        };
        let first = step([&[1, 2], &[3], &[1, 2]]);
        assert_eq!(made.get(), 2);
        assert_eq!(first[0], first[2], "the same values share a buffer");
        let second = step([&[7, 8], &[9], &[7, 8]]);
        assert_eq!(made.get(), 2, "the next step writes the kept buffers");
        assert_eq!(first, second, "in the same order");
    }
}
