//! The `Worker` gRPC service (Info, Drain) shared by prefill and decode workers.

use std::sync::Arc;

use proto::v1::{
    Ack, DrainRequest, InfoRequest, Load, Role, WorkerInfo, WorkerState, worker_server::Worker,
};
use tokio::sync::{Notify, RwLock};
use tonic::{Request, Response, Status};

/// A new unique worker id: role and a time-ordered UUID.
pub fn new_worker_id(role: Role) -> String {
    let role = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Unspecified => "worker",
    };
    format!("{role}-{}", uuid::Uuid::now_v7())
}

/// Shared, updatable description of this worker.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    info: Arc<RwLock<WorkerInfo>>,
    drain: Arc<Notify>,
}

impl WorkerHandle {
    pub fn new(info: WorkerInfo) -> Self {
        Self {
            info: Arc::new(RwLock::new(info)),
            drain: Arc::new(Notify::new()),
        }
    }

    pub async fn snapshot(&self) -> WorkerInfo {
        self.info.read().await.clone()
    }

    pub async fn set_state(&self, state: WorkerState) {
        self.info.write().await.state = state.into();
    }

    /// Records the served model: its name (here, the fingerprint) and state layout, and the
    /// transports the worker offers.
    pub async fn set_model(
        &self,
        model_name: String,
        layout: proto::v1::StateLayout,
        transports: &[proto::v1::TransportKind],
    ) {
        let mut info = self.info.write().await;
        info.model_name = model_name;
        info.layout = Some(layout);
        info.transports = transports.iter().map(|&t| t.into()).collect();
    }

    pub async fn set_load(&self, load: Load) {
        self.info.write().await.load = Some(load);
    }

    /// Resolves when a drain was requested over gRPC.
    pub async fn drain_requested(&self) {
        self.drain.notified().await;
    }
}

/// gRPC adapter.
#[derive(Debug, Clone)]
pub struct WorkerService {
    handle: WorkerHandle,
}

impl WorkerService {
    pub fn new(handle: WorkerHandle) -> Self {
        Self { handle }
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(&self, _request: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(self.handle.snapshot().await))
    }

    async fn drain(&self, _request: Request<DrainRequest>) -> Result<Response<Ack>, Status> {
        self.handle.set_state(WorkerState::Draining).await;
        // notify_one stores a permit, so a drain requested before anyone waits is not lost.
        self.handle.drain.notify_one();
        Ok(Response::new(Ack {}))
    }
}
