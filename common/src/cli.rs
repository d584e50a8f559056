//! What every binary's `main` does around its library: report errors on one line with the
//! right exit status, and announce readiness.

use std::{fmt, future::Future, process::ExitCode};

/// vLLM's `--host` and `--port`: the IP and the port of the service's listen address
/// (`ServiceConfig::HOST_PORT_KEY`), each replacing its part of whatever address the other
/// layers gave.
#[derive(Debug, Clone, Default, clap::Args, serde::Serialize)]
pub struct HostPortFlags {
    /// IP address to listen on (vLLM's `--host`): replaces the listen address's IP.
    #[arg(long, value_name = "IP")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Port to listen on (vLLM's `--port`): replaces the listen address's port.
    #[arg(long, value_name = "PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

/// `--config FILE` (env `PDSERVE_CONFIG`): the TOML layer of a service's settings, the same
/// flag for every service.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ConfigFileArg {
    /// TOML configuration file.
    #[arg(long = "config", env = crate::env::CONFIG, value_name = "FILE")]
    pub path: Option<std::path::PathBuf>,
}

/// Exit status for configuration errors (bad key, type, value, port in use).
pub const EXIT_CONFIG: u8 = 2;
/// Exit status for failures while running.
pub const EXIT_RUNTIME: u8 = 1;

/// Prints `program: error: message` on stderr and returns the exit code.
#[expect(
    clippy::print_stderr,
    reason = "the one place binaries report fatal errors"
)]
pub fn fail(program: &str, error: &dyn fmt::Display, code: u8) -> ExitCode {
    eprintln!("{program}: error: {error}");
    ExitCode::from(code)
}

/// Prints the readiness line on stdout: `PDSERVE_READY role=<role> <name>=<addr> ...`.
/// Launchers and tests read the bound addresses from it (ports may be ephemeral).
pub fn announce_ready(role: &str, addrs: &[(&str, std::net::SocketAddr)]) {
    announce("PDSERVE_READY", role, addrs);
}

/// Prints the listening line on stdout: `PDSERVE_LISTENING role=<role> <name>=<addr> ...`.
/// A worker prints it as soon as it answers health and `Worker.Info`, before its model is
/// loaded; the readiness line follows once it serves. Launchers learn from it where to ask
/// for load progress (ports may be ephemeral).
pub fn announce_listening(role: &str, addrs: &[(&str, std::net::SocketAddr)]) {
    announce("PDSERVE_LISTENING", role, addrs);
}

#[expect(
    clippy::print_stdout,
    reason = "the readiness and listening lines are the stdout contract"
)]
fn announce(tag: &str, role: &str, addrs: &[(&str, std::net::SocketAddr)]) {
    use std::{fmt::Write as _, io::Write as _};
    let mut line = format!("{tag} role={role}");
    for (name, addr) in addrs {
        let _ = write!(line, " {name}={addr}");
    }
    println!("{line}");
    let _ = std::io::stdout().flush();
}

/// Parses a readiness line back into its fields.
pub fn parse_ready(line: &str) -> Option<Vec<(String, String)>> {
    Some(fields(line.trim().strip_prefix("PDSERVE_READY ")?))
}

/// Parses a listening line back into its fields.
pub fn parse_listening(line: &str) -> Option<Vec<(String, String)>> {
    Some(fields(line.trim().strip_prefix("PDSERVE_LISTENING ")?))
}

fn fields(rest: &str) -> Vec<(String, String)> {
    rest.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// An error that knows which exit status it means.
pub trait ExitStatus: fmt::Display {
    fn exit_code(&self) -> u8;
}

impl ExitStatus for crate::ConfigError {
    fn exit_code(&self) -> u8 {
        EXIT_CONFIG
    }
}

/// The whole life of a service binary: load and validate the configuration once (errors exit
/// 2 before anything starts), install logging and signal handlers, run `serve` on a tokio
/// runtime, and turn its result into the exit status.
pub fn run_service<C, E, F, Fut>(
    program: &str,
    config_file: Option<&std::path::Path>,
    cli: &impl serde::Serialize,
    serve: F,
) -> ExitCode
where
    C: crate::ServiceConfig,
    E: ExitStatus,
    F: FnOnce(C, crate::shutdown::ShutdownSignal) -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    // Lossy: a non-UTF-8 value must still reach the validator rather than vanish.
    let env = std::env::vars_os().map(|(k, v)| {
        (
            k.to_string_lossy().into_owned(),
            v.to_string_lossy().into_owned(),
        )
    });
    let config = match crate::config::load::<C>(config_file, env, cli) {
        Ok(config) => config,
        Err(e) => return fail(program, &e, EXIT_CONFIG),
    };
    if let Err(e) = crate::logging::check_env() {
        return fail(program, &e, EXIT_CONFIG);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(program, &e, EXIT_RUNTIME),
    };
    // Dropped after the service returns, while the runtime still runs: buffered spans leave.
    let _telemetry = runtime.block_on(async { crate::logging::init(program) });
    runtime.block_on(async move {
        let signal = match crate::shutdown::ShutdownSignal::install() {
            Ok(s) => s,
            Err(e) => return fail(program, &e, EXIT_RUNTIME),
        };
        match serve(config, signal).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(program, &e, e.exit_code()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_line_round_trips() {
        let fields =
            parse_ready("PDSERVE_READY role=router http=127.0.0.1:1 grpc=127.0.0.1:2\n").unwrap();
        assert_eq!(fields[0], ("role".into(), "router".into()));
        assert_eq!(fields[2], ("grpc".into(), "127.0.0.1:2".into()));
        assert!(parse_ready("something else").is_none());
        let listening = parse_listening("PDSERVE_LISTENING role=decode grpc=127.0.0.1:3").unwrap();
        assert_eq!(listening[1], ("grpc".into(), "127.0.0.1:3".into()));
        assert!(parse_ready("PDSERVE_LISTENING role=decode grpc=127.0.0.1:3").is_none());
        assert!(parse_listening("PDSERVE_READY role=decode grpc=127.0.0.1:3").is_none());
    }
}
