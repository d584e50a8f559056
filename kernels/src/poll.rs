//! Bounded waits on a device's progress (an event's completion, polled): a decode step waits
//! for its group's collectives two or three times a layer, each done in microseconds, so the
//! first [`SPIN`] of a wait polls without sleeping (a sleep between polls costs the scheduler's
//! granularity: a 50 µs sleep took 130 µs on average on the 2-core VM, a yield 0.6 µs), and
//! only a longer wait sleeps [`SLEEP`] between polls until its timeout.

use std::time::{Duration, Instant};

/// How long a wait polls without sleeping.
pub const SPIN: Duration = Duration::from_millis(1);

/// The sleep between polls after [`SPIN`].
pub const SLEEP: Duration = Duration::from_micros(50);

/// Polls `done` until it says true (`Ok(true)`), fails (its error), or `timeout` has passed
/// since the first poll (`Ok(false)`, after one last poll).
///
/// # Errors
/// `done`'s.
pub fn poll_until<E>(
    mut done: impl FnMut() -> Result<bool, E>,
    timeout: Duration,
) -> Result<bool, E> {
    let started = Instant::now();
    loop {
        let waited = started.elapsed();
        if done()? {
            return Ok(true);
        }
        if waited > timeout {
            return Ok(false);
        }
        if waited < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(SLEEP);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;

    /// Done after some polls: true, after exactly that many; never done: false once the
    /// timeout passed, having polled after it; a failing poll: its error at once.
    #[test]
    fn a_wait_ends_when_done_failed_or_timed_out() {
        let mut polls = 0;
        let done = poll_until::<()>(
            || {
                polls += 1;
                Ok(polls == 5)
            },
            Duration::from_secs(10),
        );
        assert_eq!((done, polls), (Ok(true), 5));
        let started = Instant::now();
        let mut last = started;
        let done = poll_until::<()>(
            || {
                last = Instant::now();
                Ok(false)
            },
            Duration::from_millis(3),
        );
        assert_eq!(done, Ok(false));
        assert!(last - started > Duration::from_millis(3));
        let mut polls = 0;
        let failed = poll_until(
            || {
                polls += 1;
                if polls == 2 { Err("lost") } else { Ok(false) }
            },
            Duration::from_secs(10),
        );
        assert_eq!((failed, polls), (Err("lost"), 2));
    }
}
