//! Collectives between the ranks of one worker, behind one small interface. On GPUs they are
//! NCCL's (one communicator per group, ranks as threads); on the CPU backend, and in every test,
//! [`InProcessGroup`] gives ranks that are threads of one process the same semantics.
//!
//! Every call has a timeout: a rank that died or hangs makes the others fail with an error
//! naming it, within the timeout, instead of waiting forever. A failure is sticky: once one
//! call of the group failed, every later call fails at once (the ranks are no longer in
//! lockstep, so no later result could be trusted).

use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

/// Why a collective call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// Some ranks did not reach the call in time.
    #[error("{op}: ranks {missing:?} did not arrive within {after:?}")]
    Timeout {
        op: &'static str,
        after: Duration,
        missing: Vec<usize>,
    },
    /// The call's work did not finish in time (a rank died or hangs; a device collective
    /// cannot say which).
    #[error("{op}: did not complete within {after:?} (a rank died or hangs)")]
    Stalled { op: &'static str, after: Duration },
    /// A rank failed (or a call of the group already did).
    #[error("rank {rank} failed: {reason}")]
    PeerFailed { rank: usize, reason: String },
    /// The call's arguments do not fit the group.
    #[error("{0}")]
    Shape(String),
}

/// The operations the ranks of a worker need. Payloads are `f32` rows (hidden states,
/// expert outputs; small integers such as expert ids are exact in `f32`).
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// All-to-all with per-destination sizes: `sends[r]` goes to rank `r` (this rank's own
    /// entry included); returns what every rank sent to this one, by source rank.
    fn exchange(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CollectiveError>;

    /// Every rank's `data`, by rank.
    fn all_gather(&mut self, data: Vec<f32>) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let sends = vec![data; self.size()];
        self.exchange(sends)
    }

    /// Returns once every rank called it.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let sends = vec![Vec::new(); self.size()];
        self.exchange(sends).map(|_| ())
    }

    /// Marks this rank failed: every rank's current and later calls fail naming it.
    fn fail(&mut self, reason: &str);

    /// Why the group failed, once it did (sticky: every later call fails); `None` while it
    /// works, or where the collective cannot tell before its next call.
    fn failure(&self) -> Option<String> {
        None
    }

    /// The collective as its own type, where a caller can do more with it (a device's
    /// kernels exchange device buffers over NCCL directly); `None` by default.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// A rank's collective as a model's parallel parts hold it: shared by the forward pass and the
/// lockstep loop (which fails it when the ranks lose lockstep), so behind a lock that a
/// panicking holder does not poison for the others.
pub struct SharedCollective(std::sync::Mutex<Box<dyn Collective>>);

impl std::fmt::Debug for SharedCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not locked: a holder may be waiting in a call.
        f.debug_struct("SharedCollective").finish_non_exhaustive()
    }
}

impl SharedCollective {
    pub fn new(collective: Box<dyn Collective>) -> Self {
        Self(std::sync::Mutex::new(collective))
    }

    /// The collective, for one call.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Box<dyn Collective>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks this rank failed, so its peers stop at once.
    pub fn fail(&self, reason: &str) {
        self.lock().fail(reason);
    }

    /// Why the group failed, once it did ([`Collective::failure`]).
    pub fn failure(&self) -> Option<String> {
        self.lock().failure()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Ranks are depositing their sends.
    Collecting,
    /// Every rank deposited; ranks are taking what was sent to them.
    Reading,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    /// `slots[source][destination]`, for this round.
    slots: Vec<Option<Vec<Vec<f32>>>>,
    /// Ranks that took their part of this round.
    read: Vec<bool>,
    /// Ranks that were dropped: they finished their last call and will not arrive again.
    left: Vec<bool>,
    failed: Option<(usize, String)>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A group of ranks that are threads of this process.
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// `size` ranks whose calls wait at most `timeout` for the others.
    #[expect(clippy::new_ret_no_self, reason = "a group is its ranks")]
    pub fn new(size: usize, timeout: Duration) -> Vec<InProcessRank> {
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                phase: Phase::Collecting,
                slots: vec![None; size],
                read: vec![false; size],
                left: vec![false; size],
                failed: None,
            }),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| InProcessRank {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

/// One rank of an [`InProcessGroup`]. Dropping it marks it gone: a peer that then waits for it
/// to arrive fails at once naming it, so a rank whose thread ends (or panics) stops its peers
/// at their next call instead of at their timeout.
#[derive(Debug)]
pub struct InProcessRank {
    rank: usize,
    shared: Arc<Shared>,
}

impl InProcessRank {
    fn failure(state: &State) -> Option<CollectiveError> {
        state
            .failed
            .as_ref()
            .map(|(rank, reason)| CollectiveError::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            })
    }

    /// Waits on the condition until `done`, the group fails, or the deadline; on timeout the
    /// group fails naming the ranks `missing` reports.
    fn wait<'a>(
        &self,
        mut state: MutexGuard<'a, State>,
        op: &'static str,
        deadline: Instant,
        done: impl Fn(&State) -> bool,
        missing: impl Fn(&State) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, State>, CollectiveError> {
        loop {
            // A round every rank completed can still be read after a failure.
            if done(&state) {
                return Ok(state);
            }
            if let Some(e) = Self::failure(&state) {
                return Err(e);
            }
            if let Some(&gone) = missing(&state).iter().find(|&&r| state.left[r]) {
                let reason = "the rank stopped".to_owned();
                state.failed = Some((gone, reason.clone()));
                self.shared.changed.notify_all();
                return Err(CollectiveError::PeerFailed { rank: gone, reason });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = missing(&state);
                let error = CollectiveError::Timeout {
                    op,
                    after: self.shared.timeout,
                    missing: missing.clone(),
                };
                let first = missing.first().copied().unwrap_or(self.rank);
                state.failed = Some((first, error.to_string()));
                self.shared.changed.notify_all();
                return Err(error);
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Collective for InProcessRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn exchange(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let size = self.shared.size;
        if sends.len() != size {
            return Err(CollectiveError::Shape(format!(
                "exchange: {} sends for a group of {size}",
                sends.len()
            )));
        }
        let deadline = Instant::now() + self.shared.timeout;
        let me = self.rank;
        let state = self.shared.lock();
        // Sticky: no call starts in a group that failed.
        if let Some(e) = Self::failure(&state) {
            return Err(e);
        }
        // The previous round must be fully read before this one collects.
        let state = self.wait(
            state,
            "exchange",
            deadline,
            |s| s.phase == Phase::Collecting && s.slots[me].is_none(),
            |s| (0..size).filter(|&r| !s.read[r]).collect(),
        )?;
        let mut state = state;
        state.slots[me] = Some(sends);
        if state.slots.iter().all(Option::is_some) {
            state.phase = Phase::Reading;
            self.shared.changed.notify_all();
        }
        let mut state = self.wait(
            state,
            "exchange",
            deadline,
            |s| s.phase == Phase::Reading,
            |s| (0..size).filter(|&r| s.slots[r].is_none()).collect(),
        )?;
        let received: Vec<Vec<f32>> = (0..size)
            .map(|source| {
                state.slots[source]
                    .as_mut()
                    .map(|s| std::mem::take(&mut s[me]))
                    .unwrap_or_default()
            })
            .collect();
        state.read[me] = true;
        if state.read.iter().all(|&r| r) {
            state.phase = Phase::Collecting;
            state.slots.iter_mut().for_each(|s| *s = None);
            state.read.iter_mut().for_each(|r| *r = false);
            self.shared.changed.notify_all();
        }
        Ok(received)
    }

    fn fail(&mut self, reason: &str) {
        let mut state = self.shared.lock();
        if state.failed.is_none() {
            state.failed = Some((self.rank, reason.to_owned()));
        }
        self.shared.changed.notify_all();
    }

    fn failure(&self) -> Option<String> {
        Self::failure(&self.shared.lock()).map(|e| e.to_string())
    }
}

impl Drop for InProcessRank {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        // Its part of a round in progress stays readable; peers waiting for its next arrival
        // fail at once.
        state.left[self.rank] = true;
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests;
