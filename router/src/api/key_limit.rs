//! Requests in flight per API key, bounded by `max_concurrent_per_key`. A request holds its
//! slot until its response body has been sent or dropped, so a stream counts until it ends
//! (or its client goes away).

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use axum::body::{Body, Bytes, HttpBody};

/// The counters.
#[derive(Debug)]
pub struct KeyLimits {
    limit: u32,
    in_flight: Mutex<HashMap<String, u32>>,
}

/// A held slot; dropping it frees the slot.
#[derive(Debug)]
pub struct KeySlot {
    limits: Arc<KeyLimits>,
    key: String,
}

impl KeyLimits {
    pub fn new(limit: u32) -> Arc<Self> {
        Arc::new(Self {
            limit,
            in_flight: Mutex::new(HashMap::new()),
        })
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A slot for `key`, or `None` when it already has `limit` requests in flight.
    pub fn acquire(self: &Arc<Self>, key: &str) -> Option<KeySlot> {
        let mut counts = self.counts();
        let n = counts.entry(key.to_owned()).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(KeySlot {
            limits: Arc::clone(self),
            key: key.to_owned(),
        })
    }

    /// Requests in flight for `key`.
    pub fn in_flight(&self, key: &str) -> u32 {
        self.counts().get(key).copied().unwrap_or(0)
    }
}

impl Drop for KeySlot {
    fn drop(&mut self) {
        let mut counts = self.limits.counts();
        if let Some(n) = counts.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// A response body that holds a slot until it is finished or dropped.
struct SlotBody {
    inner: Body,
    slot: Option<KeySlot>,
}

impl HttpBody for SlotBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            // The body has ended: the request is over.
            this.slot = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// `body` holding `slot` until it ends.
pub fn hold(body: Body, slot: KeySlot) -> Body {
    Body::new(SlotBody {
        inner: body,
        slot: Some(slot),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_per_key_and_freed_on_drop() {
        let limits = KeyLimits::new(2);
        let a1 = limits.acquire("a");
        let a2 = limits.acquire("a");
        assert!(a1.is_some() && a2.is_some());
        assert!(limits.acquire("a").is_none(), "a third is refused");
        let b = limits.acquire("b");
        assert!(b.is_some(), "other keys are independent");
        drop(a1);
        assert_eq!(limits.in_flight("a"), 1);
        assert!(limits.acquire("a").is_some());
        drop((a2, b));
        assert_eq!(limits.in_flight("a"), 0);
        assert_eq!(limits.in_flight("b"), 0);
    }
}
