//! Reservations wait their turn when the worker is full. A `Reserve` that finds no free request
//! slot or pages joins a FIFO queue and retries each time a request ends (and at least every
//! 50 ms), up to the wait its caller allows; only the head of the queue may take freed room,
//! so a request that waited is never overtaken by one that just arrived.

use std::{
    collections::VecDeque,
    sync::{
        Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::Notify;

/// Longest pause between two tries of a waiting reservation.
const RECHECK: Duration = Duration::from_millis(50);

/// The queue of waiting reservations.
#[derive(Debug, Default)]
pub struct Admission {
    queue: Mutex<VecDeque<u64>>,
    freed: Notify,
    next: AtomicU64,
}

/// One `Reserve` call's place; leaving (success, failure, or the caller going away) gives the
/// turn to the next one.
#[derive(Debug)]
pub struct Ticket<'a> {
    admission: &'a Admission,
    id: u64,
    queued: bool,
}

impl Admission {
    fn queue(&self) -> MutexGuard<'_, VecDeque<u64>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn ticket(&self) -> Ticket<'_> {
        Ticket {
            admission: self,
            id: self.next.fetch_add(1, Ordering::Relaxed),
            queued: false,
        }
    }

    /// Room may have been freed (a request ended, a reservation was released).
    pub fn freed(&self) {
        self.freed.notify_waiters();
    }

    /// Reservations waiting.
    pub fn waiting(&self) -> usize {
        self.queue().len()
    }
}

impl Ticket<'_> {
    /// Whether this call may try now: nobody is waiting, or it is first in line.
    pub fn may_try(&self) -> bool {
        let queue = self.admission.queue();
        queue.front().is_none_or(|&head| head == self.id)
    }

    /// Waits (in line) for freed room until `until`; false once `until` has passed.
    pub async fn wait(&mut self, until: Instant) -> bool {
        if !self.queued {
            self.admission.queue().push_back(self.id);
            self.queued = true;
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        let _ =
            tokio::time::timeout(RECHECK.min(until - now), self.admission.freed.notified()).await;
        true
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.queued {
            self.admission.queue().retain(|&id| id != self.id);
            // The next in line may try at once.
            self.admission.freed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_the_head_of_the_line_may_try_and_leaving_passes_the_turn() {
        let admission = Admission::default();
        let mut first = admission.ticket();
        let mut second = admission.ticket();
        assert!(first.may_try() && second.may_try(), "nobody waits yet");
        let later = Instant::now() + Duration::from_secs(5);
        assert!(first.wait(later).await);
        assert!(second.wait(later).await);
        assert!(first.may_try());
        assert!(!second.may_try(), "second in line");
        let newcomer = admission.ticket();
        assert!(!newcomer.may_try(), "a newcomer does not overtake the line");
        drop(first);
        assert!(second.may_try());
        assert_eq!(admission.waiting(), 1);
        assert!(!second.wait(Instant::now()).await, "the deadline passed");
        drop(second);
        assert_eq!(admission.waiting(), 0);
        assert!(newcomer.may_try());
    }
}
