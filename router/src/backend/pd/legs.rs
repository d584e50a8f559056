//! Both legs of one attempt, released together.

use proto::v1::{
    CancelRequest, RequestId, decode_client::DecodeClient, prefill_client::PrefillClient,
};

use crate::backend::workers::Worker;

type Channel = proto::auth::AuthChannel;

/// The decode reservation and the prefill of one attempt. Until the attempt hands its token
/// stream out ([`Legs::hand_over`]), dropping this (an error at any step, or the caller gone
/// mid-attempt) cancels both, so no exit path leaves a reservation or a prefill behind.
pub(super) struct Legs {
    decode: Channel,
    prefill: Channel,
    request_id: RequestId,
    /// Why both legs are cancelled if the attempt ends now.
    reason: &'static str,
    armed: bool,
}

impl Legs {
    pub(super) fn new(decode: &Worker, prefill: &Worker, request_id: &RequestId) -> Self {
        Self {
            decode: decode.channel.clone(),
            prefill: prefill.channel.clone(),
            request_id: request_id.clone(),
            reason: "reservation abandoned",
            armed: true,
        }
    }

    /// The reason given to both workers if the attempt fails from here on.
    pub(super) fn on_failure(&mut self, reason: &'static str) {
        self.reason = reason;
    }

    /// Disarms the guard and returns what cancels both legs when called (the token stream
    /// calls it when dropped before its end; a stream that ended normally never does).
    pub(super) fn hand_over(mut self) -> impl FnOnce(&str) + Send + Sync + 'static {
        self.armed = false;
        let (decode, prefill, request_id) = (
            self.decode.clone(),
            self.prefill.clone(),
            self.request_id.clone(),
        );
        move |reason: &str| cancel(decode, prefill, request_id, reason)
    }
}

impl Drop for Legs {
    fn drop(&mut self) {
        if self.armed {
            cancel(
                self.decode.clone(),
                self.prefill.clone(),
                self.request_id.clone(),
                self.reason,
            );
        }
    }
}

/// Tells both workers to drop the request (in the background; outside a runtime, at
/// shutdown, the workers' leases and stream ends clean up instead).
fn cancel(decode: Channel, prefill: Channel, request_id: RequestId, reason: &str) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let req = CancelRequest {
        request_id: Some(request_id),
        reason: reason.to_owned(),
    };
    runtime.spawn(async move {
        let _ = DecodeClient::new(decode).cancel(req.clone()).await;
        let _ = PrefillClient::new(prefill).cancel(req).await;
    });
}
