//! The disaggregated backend: each request takes two legs. The router reserves pages on a
//! decode worker (under a lease), opens the decode stream, and asks a prefill worker to compute
//! the prompt, write its state into those pages and commit; the decode worker then streams the
//! tokens, the prefill's first token first. A failure on either leg cancels the other and ends
//! the request with an error; dropping the token stream (client gone) cancels both legs.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicUsize, Ordering},
};

use engine::{
    sampling::FinishReason,
    wire::{self, token_from_proto},
};
use futures::future::BoxFuture;
use proto::v1::{
    CancelRequest, ErrorKind, GenerateRequest, InfoRequest, PrefillRequest, RequestId,
    ReserveRequest, StateLayout, TokenBatch, TransportKind, decode_client::DecodeClient,
    prefill_client::PrefillClient, worker_client::WorkerClient,
};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use crate::backend::{
    Backend, BackendError, BackendEvent, BackendRequest, GeneratedToken, TokenStream,
};

/// Milliseconds a reservation may wait for its commit.
const LEASE_MS: u32 = 30_000;

/// Workers of one role, picked round-robin.
#[derive(Debug)]
struct Pool {
    addresses: Vec<String>,
    channels: Vec<Channel>,
    next: AtomicUsize,
}

impl Pool {
    fn new(addresses: &[String]) -> Result<Self, String> {
        let channels = addresses
            .iter()
            .map(|a| {
                Endpoint::from_shared(format!("http://{a}"))
                    .map(|e| e.connect_lazy())
                    .map_err(|e| format!("worker address {a}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            addresses: addresses.to_vec(),
            channels,
            next: AtomicUsize::new(0),
        })
    }

    fn pick(&self) -> (usize, &str, Channel) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.addresses.len();
        (i, &self.addresses[i], self.channels[i].clone())
    }
}

/// The two-leg backend over static prefill and decode worker lists.
#[derive(Debug)]
pub struct PdBackend {
    prefill: Pool,
    decode: Pool,
    /// Each prefill worker's layout (from its `Info`), fetched on first use.
    layouts: Mutex<Vec<Option<StateLayout>>>,
}

fn unavailable(what: &str, status: &tonic::Status) -> BackendError {
    let info = proto::error::from_status(status);
    match ErrorKind::try_from(info.kind).unwrap_or(ErrorKind::Internal) {
        ErrorKind::InvalidArgument => BackendError::Invalid(info.message),
        _ => BackendError::Unavailable(format!("{what}: {}", info.message)),
    }
}

impl PdBackend {
    pub fn new(prefill: &[String], decode: &[String]) -> Result<Self, String> {
        if prefill.is_empty() || decode.is_empty() {
            return Err("the PD backend needs prefill and decode workers".to_owned());
        }
        Ok(Self {
            layouts: Mutex::new(vec![None; prefill.len()]),
            prefill: Pool::new(prefill)?,
            decode: Pool::new(decode)?,
        })
    }

    async fn prefill_layout(
        &self,
        i: usize,
        channel: Channel,
    ) -> Result<StateLayout, BackendError> {
        let cached = self
            .layouts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)[i]
            .clone();
        if let Some(layout) = cached {
            return Ok(layout);
        }
        let info = WorkerClient::new(channel)
            .info(InfoRequest {})
            .await
            .map_err(|s| unavailable("prefill worker", &s))?
            .into_inner();
        let layout = info.layout.ok_or_else(|| {
            BackendError::Unavailable("the prefill worker serves no model".to_owned())
        })?;
        self.layouts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)[i] = Some(layout.clone());
        Ok(layout)
    }

    async fn start(&self, request: BackendRequest) -> Result<TokenStream, BackendError> {
        let (p, _, p_channel) = self.prefill.pick();
        let (_, decode_address, d_channel) = self.decode.pick();
        let decode_address = decode_address.to_owned();
        let layout = self.prefill_layout(p, p_channel.clone()).await?;
        let request_id = RequestId {
            id: uuid::Uuid::now_v7().to_string(),
            attempt: 1,
        };
        let mut decode = DecodeClient::new(d_channel.clone());
        let reserved = decode
            .reserve(ReserveRequest {
                request_id: Some(request_id.clone()),
                prompt_tokens: u32::try_from(request.prompt.len()).unwrap_or(u32::MAX),
                max_new_tokens: request.stop.max_tokens,
                lease_ms: LEASE_MS,
                prefill_layout: Some(layout),
                transports: vec![TransportKind::Tcp.into()],
            })
            .await
            .map_err(|s| unavailable("decode worker", &s))?
            .into_inner();
        let destination = reserved.destination.ok_or_else(|| {
            BackendError::Unavailable("the decode worker returned no destination".to_owned())
        })?;
        let sampling = wire::sampling_to_proto(&request.sampling);
        let stop = wire::stop_to_proto(&request.stop);
        let cancel_both = {
            let (d, p) = (d_channel.clone(), p_channel.clone());
            let id = request_id.clone();
            move |reason: &str| {
                let (d, p, id, reason) = (d.clone(), p.clone(), id.clone(), reason.to_owned());
                tokio::spawn(async move {
                    let req = CancelRequest {
                        request_id: Some(id),
                        reason,
                    };
                    let _ = DecodeClient::new(d).cancel(req.clone()).await;
                    let _ = PrefillClient::new(p).cancel(req).await;
                });
            }
        };
        // The decode stream first: it waits for the commit the prefill sends.
        let stream = match decode
            .generate(GenerateRequest {
                reservation_id: destination.reservation_id.clone(),
                request_id: Some(request_id.clone()),
                sampling: Some(sampling.clone()),
                stop: Some(stop.clone()),
                prompt_token_ids: request.prompt.clone(),
                deadline_ms: 0,
            })
            .await
        {
            Ok(s) => s.into_inner(),
            Err(s) => {
                cancel_both("decode stream refused");
                return Err(unavailable("decode worker", &s));
            }
        };
        let prefilled = PrefillClient::new(p_channel)
            .prefill(PrefillRequest {
                request_id: Some(request_id.clone()),
                prompt_token_ids: request.prompt,
                sampling: Some(sampling),
                stop: Some(stop),
                destination: Some(destination),
                decode_address,
                checksums: false,
                deadline_ms: 0,
            })
            .await;
        let prefilled = match prefilled {
            Ok(r) => r.into_inner(),
            Err(s) => {
                cancel_both("prefill failed");
                return Err(unavailable("prefill worker", &s));
            }
        };
        let cached = prefilled
            .usage
            .map_or(0, |u| u.cached_prompt_tokens as usize);
        let (tx, rx) = mpsc::unbounded_channel();
        let forward = tokio::spawn(forward(stream, tx, cached));
        let cancel = Arc::new(cancel_both);
        Ok(TokenStream::new(rx, move || {
            forward.abort();
            cancel("client went away");
        }))
    }
}

/// Decode's token batches as backend events; a stream that breaks or ends without a finish is
/// a failure, never a short answer.
async fn forward(
    mut stream: tonic::Streaming<TokenBatch>,
    tx: mpsc::UnboundedSender<BackendEvent>,
    cached_tokens: usize,
) {
    loop {
        let batch = match stream.message().await {
            Ok(Some(batch)) => batch,
            Ok(None) => {
                let _ = tx.send(BackendEvent::Failed(
                    "the decode stream ended without a finish".to_owned(),
                ));
                return;
            }
            Err(status) => {
                let info = proto::error::from_status(&status);
                let _ = tx.send(BackendEvent::Failed(format!(
                    "decode worker: {}",
                    info.message
                )));
                return;
            }
        };
        if !batch.tokens.is_empty() {
            let tokens = batch
                .tokens
                .iter()
                .map(|t| {
                    let s = token_from_proto(t);
                    GeneratedToken {
                        id: s.token,
                        logprob: s.logprob,
                        top_logprobs: s.top_logprobs,
                    }
                })
                .collect();
            if tx.send(BackendEvent::Tokens(tokens)).is_err() {
                return;
            }
        }
        let reason = proto::v1::FinishReason::try_from(batch.finish_reason)
            .unwrap_or(proto::v1::FinishReason::Error);
        let end = match reason {
            proto::v1::FinishReason::Unspecified => continue,
            proto::v1::FinishReason::Stop | proto::v1::FinishReason::Length => {
                let mut usage = wire::usage_from_proto(&batch.usage.unwrap_or_default());
                usage.cached_tokens = cached_tokens;
                BackendEvent::Finished {
                    reason: if reason == proto::v1::FinishReason::Stop {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    },
                    usage,
                }
            }
            proto::v1::FinishReason::Cancelled => {
                BackendEvent::Failed("the request was cancelled on the decode worker".to_owned())
            }
            proto::v1::FinishReason::Error => BackendEvent::Failed(format!(
                "decode worker: {}",
                batch.error.map(|e| e.message).unwrap_or_default()
            )),
        };
        let _ = tx.send(end);
        return;
    }
}

impl Backend for PdBackend {
    fn submit(&self, request: BackendRequest) -> BoxFuture<'_, Result<TokenStream, BackendError>> {
        Box::pin(self.start(request))
    }

    fn is_ready(&self) -> bool {
        true
    }
}
