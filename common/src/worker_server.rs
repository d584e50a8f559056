//! The process skeleton both worker roles share: a bound gRPC listener, the `Worker` identity
//! service, standard health, drain and graceful shutdown. Each role adds its own services.

use std::{future::Future, net::SocketAddr, time::Duration};

use proto::{
    auth::{ClusterSecret, Credentials},
    v1::{Role, WorkerInfo, WorkerState, worker_server::WorkerServer as WorkerGrpc},
};
use tokio::net::TcpListener;
use tonic::service::Routes;

use crate::{
    ConfigError,
    cli::{EXIT_RUNTIME, ExitStatus},
    grpc,
    worker_info::{WorkerHandle, WorkerService, new_worker_id},
};

/// Failures of a worker process's server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The worker could not start serving (e.g. its model failed to load).
    #[error("{0}")]
    Startup(String),
}

impl ExitStatus for ServeError {
    fn exit_code(&self) -> u8 {
        match self {
            ServeError::Config(e) => e.exit_code(),
            ServeError::Transport(_) | ServeError::Io(_) | ServeError::Startup(_) => EXIT_RUNTIME,
        }
    }
}

/// Where and how a worker listens.
#[derive(Debug, Clone)]
pub struct ListenOptions {
    /// Configuration key of the listen address (for error messages).
    pub key: &'static str,
    pub listen: SocketAddr,
    /// Address others dial; default: the bound address.
    pub advertise: Option<String>,
    /// How long in-flight calls may run after shutdown begins.
    pub grace: Duration,
    /// The cluster secret every call but health must carry; `None`: calls are not checked.
    pub secret: Option<ClusterSecret>,
}

/// A worker whose listener is bound (its address is known) but not yet serving.
#[derive(Debug)]
pub struct WorkerServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    grace: Duration,
    secret: Option<ClusterSecret>,
    handle: WorkerHandle,
}

impl WorkerServer {
    /// Binds the listener; "address in use" is a configuration error naming the key.
    pub async fn bind(role: Role, options: ListenOptions) -> Result<Self, ServeError> {
        let listener = crate::listen::bind(options.key, options.listen).await?;
        let local_addr = listener.local_addr()?;
        crate::cluster_auth::warn_if_open(options.secret.as_ref(), local_addr);
        let handle = WorkerHandle::new(WorkerInfo {
            worker_id: new_worker_id(role),
            role: role.into(),
            state: WorkerState::Starting.into(),
            address: options.advertise.unwrap_or_else(|| local_addr.to_string()),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..WorkerInfo::default()
        });
        Ok(Self {
            listener,
            local_addr,
            grace: options.grace,
            secret: options.secret,
            handle,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn handle(&self) -> &WorkerHandle {
        &self.handle
    }

    /// What this worker's own calls to other processes carry.
    pub fn credentials(&self) -> Credentials {
        Credentials::new(self.secret.as_ref())
    }

    /// Serves the identity and health services plus `role_routes` (whose names are listed in
    /// `role_services` for health) until `shutdown` resolves or a drain is requested.
    pub async fn serve(
        self,
        role_routes: impl FnOnce(Routes) -> Routes,
        role_services: &[&str],
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let (reporter, health) = grpc::health();
        let routes = role_routes(
            Routes::new(health)
                .add_service(WorkerGrpc::new(WorkerService::new(self.handle.clone()))),
        );
        let mut services = vec![proto::service_names::WORKER];
        services.extend_from_slice(role_services);
        grpc::set_serving(&reporter, &services).await;
        self.handle.set_state(WorkerState::Ready).await;
        let handle = self.handle.clone();
        let stop = async move {
            tokio::select! {
                () = shutdown => {}
                () = handle.drain_requested() => {}
            }
            handle.set_state(WorkerState::Draining).await;
            grpc::set_not_serving(&reporter, &services).await;
            tracing::info!("worker stopping");
        };
        grpc::serve(self.listener, routes, self.secret, stop, self.grace).await?;
        Ok(())
    }

    /// Runs as a process: announce readiness on stdout, serve until SIGTERM/SIGINT.
    pub async fn run_until_signal(
        self,
        role_name: &str,
        role_routes: impl FnOnce(Routes) -> Routes,
        role_services: &[&str],
        mut signal: crate::shutdown::ShutdownSignal,
    ) -> Result<(), ServeError> {
        tracing::info!(addr = %self.local_addr, role = role_name, "worker listening");
        crate::cli::announce_ready(role_name, &[("grpc", self.local_addr)]);
        self.serve(role_routes, role_services, async move {
            let name = signal.recv().await;
            tracing::info!(signal = name, "shutdown requested");
        })
        .await
    }
}
