//! Device buffers a decode step reuses instead of allocating: activations come from a
//! [`BufPool`] as [`StepBuf`]s that go back to it when dropped, and the step's plans (row
//! offsets, counts, rotation tables) are written into buffers a [`PlanStore`] keeps from step
//! to step. After the first step of a batch size a step makes no device buffer, and the same
//! sequence of requests gets the same buffers whatever order the last step returned them in
//! (a request takes the oldest free buffer of its size): what a CUDA graph needs (its launches
//! name fixed addresses), and what keeps a step free of allocations and their synchronisation.

use std::{
    collections::{BTreeMap, HashMap},
    hash::Hash,
    mem::ManuallyDrop,
    ops::{Deref, DerefMut},
    sync::atomic::{AtomicU64, Ordering},
    sync::{Arc, Mutex, PoisonError},
};

/// The capacity a request of `len` values gets: a power of two (at least 16), so batch sizes
/// near each other share buffers and a pool holds a few sizes, not one per batch size.
pub fn size_class(len: usize) -> usize {
    len.max(16).next_power_of_two()
}

/// A buffer's place in a pool: its capacity, then its age (made first, taken first).
pub type Place = (usize, u64);

/// The free buffers of `class` in `free`: the oldest, if any.
fn oldest<B>(free: &mut BTreeMap<Place, B>, class: usize) -> Option<(Place, B)> {
    let place = *free.range((class, 0)..=(class, u64::MAX)).next()?.0;
    free.remove(&place).map(|buf| (place, buf))
}

/// Free buffers by capacity; a request takes the oldest one of its class, so which buffers a
/// sequence of requests gets depends on which are free, not on the order they came back in.
#[derive(Debug)]
pub struct BufPool<B> {
    free: Mutex<BTreeMap<Place, B>>,
    made: AtomicU64,
}

impl<B> Default for BufPool<B> {
    fn default() -> Self {
        Self {
            free: Mutex::new(BTreeMap::new()),
            made: AtomicU64::new(0),
        }
    }
}

impl<B> BufPool<B> {
    fn take(&self, class: usize) -> Option<(Place, B)> {
        oldest(
            &mut self.free.lock().unwrap_or_else(PoisonError::into_inner),
            class,
        )
    }

    fn give(&self, place: Place, buf: B) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(place, buf);
    }

    /// Buffers waiting to be reused.
    pub fn free_count(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
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
    let (place, buf) = if let Some(kept) = pool.take(class) {
        kept
    } else {
        let buf = make(class)?;
        ((class, pool.made.fetch_add(1, Ordering::Relaxed)), buf)
    };
    Ok(StepBuf {
        buf: ManuallyDrop::new(buf),
        home: Some((place, Arc::clone(pool))),
    })
}

/// A device buffer of a step: back to its pool when dropped, or (made by [`StepBuf::kept`],
/// as the arenas are) freed then.
#[derive(Debug)]
pub struct StepBuf<B> {
    /// Taken out once, by `drop`.
    buf: ManuallyDrop<B>,
    home: Option<(Place, Arc<BufPool<B>>)>,
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
        if let Some((place, pool)) = self.home.take() {
            pool.give(place, buf);
        }
    }
}

/// Plans of a step on the device, written into buffers kept from step to step: the same
/// values twice in a step share one buffer (the layers of a kind have the same plans), no
/// buffer is written twice in a step (so every write can precede every launch, as in a
/// graph), and [`PlanStore::begin_step`] frees them all for the next step.
#[derive(Debug)]
pub struct PlanStore<B, T> {
    /// The buffers written this step, in order, with their places.
    used: Vec<(Place, Arc<B>)>,
    /// Which of `used` holds these values.
    by_values: HashMap<Vec<T>, usize>,
    free: BTreeMap<Place, B>,
    made: u64,
}

impl<B, T> Default for PlanStore<B, T> {
    fn default() -> Self {
        Self {
            used: Vec::new(),
            by_values: HashMap::new(),
            free: BTreeMap::new(),
            made: 0,
        }
    }
}

impl<B, T> PlanStore<B, T> {
    /// The step's buffers are free again: the same requests take the same buffers.
    pub fn begin_step(&mut self) {
        self.by_values.clear();
        for (place, buf) in self.used.drain(..) {
            // A plan still held past its step (none is, but then it is not reused).
            if let Ok(buf) = Arc::try_unwrap(buf) {
                self.free.insert(place, buf);
            }
        }
    }

    /// A buffer of its own written with `values` (a kernel writes into it before the others
    /// read it), with its place for [`Self::keep`].
    pub fn scratch<E>(
        &mut self,
        values: &[T],
        make: impl FnOnce(usize) -> Result<B, E>,
        write: impl FnOnce(&mut B, &[T]) -> Result<(), E>,
    ) -> Result<(Place, B), E> {
        let class = size_class(values.len());
        let (place, mut buf) = if let Some(kept) = oldest(&mut self.free, class) {
            kept
        } else {
            self.made += 1;
            ((class, self.made), make(class)?)
        };
        if !values.is_empty() {
            write(&mut buf, values)?;
        }
        Ok((place, buf))
    }

    /// `buf` (from [`Self::scratch`]) used this step, freed at the next.
    pub fn keep(&mut self, place: Place, buf: B) -> Arc<B> {
        let buf = Arc::new(buf);
        self.used.push((place, Arc::clone(&buf)));
        buf
    }
}

impl<B, T: Clone + Eq + Hash> PlanStore<B, T> {
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
        let (place, buf) = self.scratch(values, make, write)?;
        let kept = self.keep(place, buf);
        self.by_values.insert(values.to_vec(), self.used.len() - 1);
        Ok(kept)
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

    /// Which buffers a step's requests get does not depend on the order the last step gave
    /// its buffers back in.
    #[test]
    fn the_order_buffers_come_back_in_does_not_matter() {
        let pool = Arc::new(BufPool::<Vec<f32>>::default());
        let make = |class: usize| -> Result<Vec<f32>, ()> { Ok(vec![0.0; class]) };
        let (a, b) = (
            take(&pool, 20, make).unwrap(),
            take(&pool, 20, make).unwrap(),
        );
        let ids = (a.as_ptr(), b.as_ptr());
        drop(a);
        drop(b);
        let (a, b) = (
            take(&pool, 20, make).unwrap(),
            take(&pool, 20, make).unwrap(),
        );
        assert_eq!(ids, (a.as_ptr(), b.as_ptr()));
        drop(b);
        drop(a);
        let (a, b) = (
            take(&pool, 20, make).unwrap(),
            take(&pool, 20, make).unwrap(),
        );
        assert_eq!(ids, (a.as_ptr(), b.as_ptr()));
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
