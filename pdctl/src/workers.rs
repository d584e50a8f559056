//! `pdctl workers`: a router's prefill and decode workers (static and registered) with their
//! liveness and load, from its `GET /workers`.

use std::{net::SocketAddr, time::Duration};

use serde_json::Value;

use crate::PdctlError;

/// Arguments of `pdctl workers`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkersArgs {
    /// The router's HTTP address (host:port).
    #[arg(long, value_name = "ADDR")]
    pub url: SocketAddr,
    /// API key, when the router requires one.
    #[arg(long, env = common::env::API_KEY, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Print the JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn err(message: String) -> PdctlError {
    PdctlError::Unhealthy {
        what: "router".to_owned(),
        reason: message,
    }
}

/// Runs `pdctl workers`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn run(args: &WorkersArgs) -> Result<(), PdctlError> {
    let bearer = args.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer
        .as_deref()
        .map(|b| vec![("authorization", b)])
        .unwrap_or_default();
    let response = common::http_client::request_with(
        args.url,
        "GET",
        "/workers",
        &headers,
        None,
        Duration::from_secs(10),
    )
    .await
    .map_err(|e| err(e.to_string()))?;
    let body: Value = serde_json::from_slice(&response.body)
        .map_err(|e| err(format!("GET /workers: not JSON ({e})")))?;
    if response.status != 200 {
        return Err(err(format!(
            "GET /workers: HTTP {}: {body}",
            response.status
        )));
    }
    if args.json {
        println!("{body:#}");
        return Ok(());
    }
    println!(
        "{:<8} {:<22} {:<6} {:<10} {:>8} {:>8} {:>8} {:>14}  id",
        "role", "address", "alive", "source", "inflight", "running", "reserv", "pages used/all"
    );
    for w in body["workers"].as_array().into_iter().flatten() {
        let text = |k: &str| w[k].as_str().unwrap_or("").to_owned();
        let num = |k: &str| w[k].as_u64().unwrap_or(0);
        println!(
            "{:<8} {:<22} {:<6} {:<10} {:>8} {:>8} {:>8} {:>14}  {}",
            text("role"),
            text("address"),
            if w["alive"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            },
            if w["registered"].as_bool() == Some(true) {
                "registered"
            } else {
                "static"
            },
            num("in_flight"),
            num("running_requests") + num("queued_requests"),
            num("reservations"),
            format!("{}/{}", num("pages_used"), num("pages_total")),
            text("id"),
        );
    }
    Ok(())
}
