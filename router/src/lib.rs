//! The router: OpenAI-compatible HTTP API (chat completions, completions, Anthropic messages,
//! responses, models, tokenize/detokenize, health, metrics, worker listing) on DeepSeek's
//! official encoder and parser; the worker registry (`Registry` gRPC service, static lists,
//! health polling) and routing policies; the two-leg prefill/decode backend ([`backend::pd`]),
//! or an in-process engine for development. [`api`] holds the protocols, [`backend`] what
//! generates.

pub mod api;
pub mod backend;
pub mod config;
pub mod error;
pub mod metrics;
pub mod served;

use api::http;
use backend::workers;

use std::{
    future::{Future, IntoFuture},
    net::SocketAddr,
    sync::Arc,
    time::Duration,
};

use common::grpc;
pub use config::{Cli, RouterConfig};
pub use error::RouterError;
use proto::v1::registry_server::RegistryServer;
use tokio::{net::TcpListener, sync::watch};
use tonic::service::Routes;

/// A router whose listeners are bound but not yet serving.
#[derive(Debug)]
pub struct BoundRouter {
    config: RouterConfig,
    http: TcpListener,
    grpc: TcpListener,
    http_addr: SocketAddr,
    grpc_addr: SocketAddr,
}

impl BoundRouter {
    /// Binds both listeners; "address in use" is a configuration error naming the key.
    pub async fn bind(config: RouterConfig) -> Result<Self, RouterError> {
        let http = common::listen::bind("http_listen", config.http_listen).await?;
        let grpc = common::listen::bind("grpc_listen", config.grpc_listen).await?;
        Ok(Self {
            http_addr: http.local_addr()?,
            grpc_addr: grpc.local_addr()?,
            http,
            grpc,
            config,
        })
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// Serves HTTP and gRPC until `shutdown` resolves, then lets in-flight requests finish
    /// within the grace period.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), RouterError> {
        let grace = Duration::from_millis(self.config.shutdown_grace_ms);
        let (stop_tx, stop_rx) = watch::channel(false);
        let (reporter, health) = grpc::health();
        grpc::set_serving(&reporter, &[]).await;

        let security = common::cluster_auth::Security::load(
            self.config.cluster_secret_file.as_deref(),
            &self.config.tls,
        )
        .map_err(|e| RouterError::Startup(format!("{}: {}", e.key, e.reason)))?;
        common::cluster_auth::warn_if_open(&security, self.grpc_addr);
        let workers = workers::Workers::new(
            &self.config.prefill_workers,
            &self.config.decode_workers,
            &security.credentials(),
        )
        .map_err(|e| RouterError::Startup(e.to_string()))?;
        let state = Arc::new(http::AppState::new(&self.config, Arc::clone(&workers)));
        if let Some(dir) = self.config.model_dir.clone() {
            let config = self.config.clone();
            let loading = Arc::clone(&state);
            let pd_workers = Arc::clone(&workers);
            tokio::task::spawn_blocking(move || {
                let loaded = if config.disaggregated() {
                    served::Served::load_pd(&config, &dir, pd_workers)
                } else {
                    served::Served::load_local(&config, &dir)
                };
                match loaded {
                    Ok(served) => {
                        tracing::info!(model = %served.name, dir = %dir.display(), "model loaded");
                        let _ = loading.served.set(Arc::new(served));
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "model failed to load");
                        let _ = loading.load_error.set(e.to_string());
                    }
                }
            });
        }
        let notifier = common::systemd::Notifier::from_env();
        let announce = tokio::spawn(announce_ready(
            notifier.clone(),
            Arc::clone(&state),
            self.config.model_dir.is_some(),
            self.http_addr,
        ));
        let watchdog = tokio::spawn(notifier.clone().keep_watchdog(|| true));
        let app = http::routes(state);
        let mut http_stop = stop_rx.clone();
        let http_server = axum::serve(self.http, app).with_graceful_shutdown(async move {
            let _ = http_stop.wait_for(|stop| *stop).await;
        });
        let mut grpc_stop = stop_rx.clone();
        let grpc_server = grpc::serve(
            self.grpc,
            Routes::new(health).add_service(RegistryServer::new(workers::RegistryService(workers))),
            &security,
            async move {
                let _ = grpc_stop.wait_for(|stop| *stop).await;
                grpc::set_not_serving(&reporter, &[]).await;
            },
            grace,
        );
        let trigger = async move {
            shutdown.await;
            tracing::info!("router stopping");
            announce.abort();
            watchdog.abort();
            notifier.stopping("finishing requests in flight");
            let _ = stop_tx.send(true);
        };
        let http_bounded = async move {
            let mut stop = stop_rx;
            let http_server = http_server.into_future();
            tokio::pin!(http_server);
            tokio::select! {
                r = &mut http_server => r,
                () = async {
                    let _ = stop.wait_for(|s| *s).await;
                    tokio::time::sleep(grace).await;
                } => Ok(()),
            }
        };
        let ((), http_result, grpc_result) = tokio::join!(trigger, http_bounded, grpc_server);
        http_result?;
        grpc_result?;
        Ok(())
    }
}

/// Tells systemd the router is ready once its model is loaded (at once without a model); a
/// model that fails to load leaves the unit starting, with the reason as its status.
async fn announce_ready(
    notifier: common::systemd::Notifier,
    state: Arc<http::AppState>,
    has_model: bool,
    http: SocketAddr,
) {
    if has_model {
        notifier.status("loading the model");
        loop {
            if let Some(served) = state.served.get() {
                notifier.ready(&format!("serving {} on {http}", served.name));
                return;
            }
            if let Some(error) = state.load_error.get() {
                notifier.status(&format!("the model failed to load: {error}"));
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    notifier.ready(&format!("serving on {http} (no model)"));
}

/// Runs the router as a process until SIGTERM/SIGINT.
pub async fn run(
    config: RouterConfig,
    mut signal: common::shutdown::ShutdownSignal,
) -> Result<(), RouterError> {
    let router = BoundRouter::bind(config).await?;
    tracing::info!(http = %router.http_addr(), grpc = %router.grpc_addr(), "router listening");
    common::cli::announce_ready(
        "router",
        &[("http", router.http_addr()), ("grpc", router.grpc_addr())],
    );
    router
        .serve(async move {
            let name = signal.recv().await;
            tracing::info!(signal = name, "shutdown requested");
        })
        .await
}
