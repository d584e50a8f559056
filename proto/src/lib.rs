//! The pdserve wire protocol, version 1: every message and gRPC service exchanged between the
//! router, prefill workers and decode workers. No other crate defines a wire type.
//!
//! The `.proto` sources in `pdserve/v1/` are the documentation of every field; this crate
//! compiles them (protox, no system protoc) and adds the few helpers every peer needs:
//! the error-kind mapping to gRPC codes ([`error`]), layout comparison ([`layout`]), reading a
//! model load's progress ([`progress`]), the credentials every internal call carries
//! ([`auth`]), and the request vocabulary with its wire conversions ([`request`]).

pub mod auth;
pub mod error;
pub mod layout;
pub mod progress;
pub mod request;

/// Generated messages, clients and servers of package `pdserve.v1`.
#[allow(
    missing_debug_implementations,
    clippy::pedantic,
    clippy::all,
    reason = "generated code"
)]
pub mod v1 {
    tonic::include_proto!("pdserve.v1");
}

/// Encoded `FileDescriptorSet` of the whole package (for reflection and tests).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/pdserve_v1_descriptor.bin"));

/// gRPC metadata key of the client's request id (`X-Request-Id`), sent with every call the
/// router makes for that request so the workers' log lines carry it.
pub const REQUEST_ID_METADATA: &str = "x-request-id";

/// The client's request id on a gRPC call, if it carries one.
pub fn request_id_of<T>(request: &tonic::Request<T>) -> &str {
    request
        .metadata()
        .get(REQUEST_ID_METADATA)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
}

/// `message` as a gRPC request carrying the client's request id.
pub fn with_request_id<T>(message: T, id: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = id.parse() {
        request.metadata_mut().insert(REQUEST_ID_METADATA, value);
    }
    request
}

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: v1::ProtocolVersion = v1::ProtocolVersion::V1;

/// Name of each gRPC service, as registered in the standard health service.
pub mod service_names {
    /// `pdserve.v1.Prefill`.
    pub const PREFILL: &str = "pdserve.v1.Prefill";
    /// `pdserve.v1.Decode`.
    pub const DECODE: &str = "pdserve.v1.Decode";
    /// `pdserve.v1.StateTransfer`.
    pub const STATE_TRANSFER: &str = "pdserve.v1.StateTransfer";
    /// `pdserve.v1.Worker`.
    pub const WORKER: &str = "pdserve.v1.Worker";
    /// `pdserve.v1.Registry`.
    pub const REGISTRY: &str = "pdserve.v1.Registry";
}
