//! What pdserve's two worker roles share, written once: the settings every worker has
//! ([`settings::WorkerSettings`], which each role's settings embed, and the matching
//! [`settings::WorkerFlags`]), and a worker process's life ([`start::run`]: bind, load the
//! model while reporting progress, register, serve the role's gRPC services, drain, stop).
//! The roles (`prefill-worker`, `decode-worker`) hold only their services and their own keys;
//! [`transports`] starts the transport endpoints they offer; [`metrics`] is a worker's own
//! `/metrics`.

pub mod metrics;
pub mod settings;
pub mod start;
pub mod transports;

pub use settings::{Transport, WorkerFlags, WorkerSettings};
pub use start::{Loaded, RoleSpec, RoleWorker, bind, run};
